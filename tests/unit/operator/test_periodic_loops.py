"""ObjectLoops: the finalizer-free replacement of Kopf timers (operator/sparsegate/handlers/periodic.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from localcluster.health import wait_for_async
from sparsegate.handlers.periodic import ObjectLoops


class Rounds:
    """A tick that counts its rounds and answers ``after`` (None: the interval)."""

    def __init__(self, after: float | None = None) -> None:
        self.n, self.after = 0, after

    async def __call__(self, _: Any) -> float | None:
        self.n += 1
        return self.after


def body(*, deleting: bool = False, generation: int = 1) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "g", "namespace": "ns", "generation": generation}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    return {"metadata": meta}


async def test_first_event_starts_a_loop_that_ticks_with_the_latest_body() -> None:
    loops = ObjectLoops(kind="GateConfig", interval_s=0.01)
    seen: list[int] = []

    async def tick(b: Any) -> None:
        seen.append(b["metadata"]["generation"])

    assert loops.seen(key=("ns", "g"), event_type=None, body=body(generation=1), tick=tick)
    await asyncio.sleep(0.05)
    loops.seen(key=("ns", "g"), event_type="MODIFIED", body=body(generation=2), tick=tick)
    await asyncio.sleep(0.05)
    await loops.stop()
    assert seen[0] == 1 and seen[-1] == 2 and len(seen) >= 4
    assert set(seen) == {1, 2} and seen == sorted(seen)  # one loop, never two interleaved


async def test_deleted_or_deleting_objects_stop_their_loop() -> None:
    loops = ObjectLoops(kind="RoutingPolicy", interval_s=0.01)
    tick = Rounds()
    loops.seen(key=("ns", "a"), event_type="ADDED", body=body(), tick=tick)
    loops.seen(key=("ns", "b"), event_type="ADDED", body=body(), tick=tick)
    await asyncio.sleep(0.03)
    assert not loops.seen(key=("ns", "a"), event_type="DELETED", body=body(), tick=tick)
    assert not loops.seen(key=("ns", "b"), event_type="MODIFIED", body=body(deleting=True), tick=tick)
    assert len(loops) == 0
    before = tick.n
    await asyncio.sleep(0.05)
    assert tick.n == before  # cancelled: no tick after the deletion was seen
    await loops.stop()


async def test_a_failing_round_is_logged_and_the_loop_goes_on(caplog) -> None:
    loops = ObjectLoops(kind="GateConfig", interval_s=0.01)
    rounds = 0

    async def tick(_: Any) -> None:
        nonlocal rounds
        rounds += 1
        if rounds == 1:
            raise ConnectionResetError("API server went away")

    loops.seen(key=("ns", "g"), event_type=None, body=body(), tick=tick)
    for _ in range(500):  # ~0.03 s on a quiet machine; a loaded one may take far longer
        if rounds >= 3:
            break
        await asyncio.sleep(0.01)
    await loops.stop()
    assert rounds >= 3
    assert "ConnectionResetError" in caplog.text



async def test_a_failure_that_persists_is_logged_once_with_its_traceback_not_every_round(caplog) -> None:
    """The API server (or OPA) down fails every round of every object's loop: an ERROR with a
    traceback per object per round was log spam for as long as it lasted. Logged when it starts,
    when the error changes, and when it comes back after a round that succeeded."""
    errors = ["down"] * 6 + ["refused"] * 3 + [None] + ["down"] * 2
    rounds = 0

    async def tick(_: Any) -> None:
        nonlocal rounds
        rounds += 1
        error = errors[min(rounds, len(errors)) - 1]
        if error is not None:
            raise ConnectionError(error)

    caplog.set_level(logging.DEBUG, logger="test.persisting")
    loops = ObjectLoops(kind="GateConfig", interval_s=0.01)
    loops.seen(key=("ns", "g"), event_type=None, body=body(), tick=tick, logger=logging.getLogger("test.persisting"))
    for _ in range(1000):  # ~0.15 s on a quiet machine
        if rounds >= len(errors):
            break
        await asyncio.sleep(0.01)
    await loops.stop()
    assert rounds >= len(errors)
    logged = [r for r in caplog.records if r.name == "test.persisting" and r.levelno >= logging.WARNING]
    assert [str(r.exc_info[1]) for r in logged if r.exc_info] == ["down", "refused", "down"]
    assert len(logged) == 3
    assert any("failed again" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)

async def test_deleted_before_its_first_event_starts_nothing() -> None:
    loops = ObjectLoops(kind="GateConfig", interval_s=0.01)

    async def tick(_: Any) -> None:
        raise AssertionError("no loop for an object already being deleted")

    assert not loops.seen(key=("ns", "g"), event_type=None, body=body(deleting=True), tick=tick)
    await asyncio.sleep(0.03)
    assert ("ns", "g") not in loops


async def test_wake_runs_the_next_round_at_once_for_the_named_objects_only() -> None:
    loops = ObjectLoops(kind="SparseModel", interval_s=60.0)
    rounds: dict[str, int] = {"a": 0, "b": 0}

    def tick_for(name: str) -> Any:
        async def tick(_: Any) -> None:
            rounds[name] += 1
        return tick

    loops.seen(key=("ns", "a"), event_type=None, body=body(), tick=tick_for("a"))
    loops.seen(key=("ns", "b"), event_type=None, body=body(), tick=tick_for("b"))
    await asyncio.sleep(0.05)
    assert rounds == {"a": 1, "b": 1}  # first rounds; the next is 60 s away
    assert loops.wake([("ns", "a")]) == 1
    await asyncio.sleep(0.05)
    assert rounds == {"a": 2, "b": 1}
    assert loops.wake() == 2
    await asyncio.sleep(0.05)
    await loops.stop()
    assert rounds == {"a": 3, "b": 2}


async def test_discard_ends_a_live_objects_loop_and_the_next_event_starts_one() -> None:
    loops = ObjectLoops(kind="SparseModel access", interval_s=0.01)
    tick = Rounds()
    loops.seen(key=("ns", "m"), event_type="ADDED", body=body(), tick=tick)
    await asyncio.sleep(0.03)
    loops.discard(("ns", "m"))
    loops.discard(("ns", "never-seen"))  # no loop: nothing to do
    assert len(loops) == 0 and loops.wake([("ns", "m")]) == 0
    before = tick.n
    await asyncio.sleep(0.03)
    assert tick.n == before
    assert loops.seen(key=("ns", "m"), event_type="MODIFIED", body=body(), tick=tick)
    await asyncio.sleep(0.03)
    await loops.stop()
    assert tick.n > before




async def until(condition: Any, timeout_s: float = 10.0) -> None:
    """Poll: a loaded CI machine may run a due round late, never early."""
    await wait_for_async(condition, what="the rounds expected", timeout_s=timeout_s, interval_s=0.005)


async def test_a_round_may_put_off_the_next_and_an_event_brings_it_within_the_interval() -> None:
    loops = ObjectLoops(kind="GateConfig", interval_s=0.05)
    rounds: list[int] = []
    at: list[float] = []
    clock = asyncio.get_running_loop().time

    async def tick(b: Any) -> float:
        rounds.append(b["metadata"]["generation"])
        at.append(clock())
        return 60.0  # resting: nothing to do for a minute

    loops.seen(key=("ns", "g"), event_type=None, body=body(generation=1), tick=tick)
    await until(lambda: rounds == [1])
    await asyncio.sleep(0.2)
    assert rounds == [1]  # four intervals passed, one round
    event_at = clock()
    loops.seen(key=("ns", "g"), event_type="MODIFIED", body=body(generation=2), tick=tick)
    await asyncio.sleep(0.01)
    assert rounds == [1]  # not at once: within the interval
    await until(lambda: rounds == [1, 2])
    # Within the 0.05 s interval; bounded loosely (a loaded machine runs it late), far under the 60 s rest.
    assert at[1] - event_at < 2.0, at[1] - event_at
    await loops.stop()


async def test_a_burst_of_nudges_costs_one_round_per_interval() -> None:
    loops = ObjectLoops(kind="GateConfig", interval_s=0.3)
    tick = Rounds(after=60.0)
    loops.seen(key=("ns", "g"), event_type=None, body=body(), tick=tick)
    await until(lambda: tick.n == 1)
    for _ in range(50):
        assert loops.nudge([("ns", "g"), ("ns", "gone")]) == 1
        await asyncio.sleep(0)
    await until(lambda: tick.n == 2)
    await asyncio.sleep(0.4)
    assert tick.n == 2
    await loops.stop()


async def test_an_event_during_a_round_bounds_the_next_one() -> None:
    loops = ObjectLoops(kind="GateConfig", interval_s=0.05)
    rounds = 0
    release = asyncio.Event()

    async def tick(_: Any) -> float:
        nonlocal rounds
        rounds += 1
        if rounds == 1:
            await release.wait()
        return 60.0

    loops.seen(key=("ns", "g"), event_type=None, body=body(), tick=tick)
    await until(lambda: rounds == 1)
    loops.nudge([("ns", "g")])  # arrives while the first round runs: its result is not final
    release.set()
    await until(lambda: rounds == 2)
    await asyncio.sleep(0.1)
    assert rounds == 2
    loops.wake([("ns", "g")])  # wake: at once, not within the interval
    await until(lambda: rounds == 3, timeout_s=5.0)  # vs a minute unwoken
    await loops.stop()


async def test_the_deletion_of_an_earlier_object_of_the_name_leaves_the_new_ones_loop_running() -> None:
    """Deleted and created again under its name: Kopf queues events per uid, so the old object's
    DELETED may be handled after the new one's first event; it must not end the new one's loop."""
    loops = ObjectLoops(kind="GateConfig", interval_s=0.01)
    tick = Rounds()
    old, new = body(), body(generation=1)
    old["metadata"]["uid"], new["metadata"]["uid"] = "uid-old", "uid-new"
    loops.seen(key=("ns", "g"), event_type="ADDED", body=old, tick=tick)
    await asyncio.sleep(0.02)
    assert loops.seen(key=("ns", "g"), event_type="ADDED", body=new, tick=tick)
    assert not loops.seen(key=("ns", "g"), event_type="DELETED", body=old, tick=tick)
    assert ("ns", "g") in loops
    before = tick.n
    await asyncio.sleep(0.05)
    assert tick.n > before  # still ticking
    assert not loops.seen(key=("ns", "g"), event_type="DELETED", body=new, tick=tick)
    assert len(loops) == 0
    await loops.stop()


async def test_an_earlier_models_deletion_leaves_the_re_created_enforcing_models_access_loop() -> None:
    """The access loop of a model deleted and created again under its name with requestAuth Enforce:
    the old (not enforcing) object's DELETED, handled after the new one's first event, must not end
    the new one's loop (its pods would get no access rules until the model changed again)."""
    from types import SimpleNamespace

    from sparsegate.handlers import accesssync

    class Sync:
        def __init__(self) -> None:
            self.rounds = 0

        async def tick(self, **_: Any) -> None:
            self.rounds += 1

    sync = Sync()
    memo = SimpleNamespace(access_sync=sync, access_cache=object())
    indexes = {k: {} for k in ("sparsegate_model_views", "sparsegate_model_pod_views",
                               "sparsegate_model_deployment_views", "sparsegate_model_replicaset_views",
                               "sparsegate_gate_views")}

    def model(uid: str, enforce: bool) -> dict[str, Any]:
        spec = {"access": {"requestAuth": "Enforce"}} if enforce else {}
        return {"metadata": {"namespace": "ns", "name": "m", "uid": uid}, "spec": spec}

    async def event(type_: str, body_: dict[str, Any]) -> None:
        await accesssync.sparsemodel_access_loop(type=type_, body=body_, namespace="ns", name="m", memo=memo,
                                                 sparsegate_routing_policies={}, logger=logging.getLogger("test"),
                                                 **indexes)

    try:
        await event("ADDED", model("uid-new", enforce=True))
        await event("DELETED", model("uid-old", enforce=False))
        assert ("ns", "m") in accesssync._loops, "the re-created model's access loop was ended"
        await until(lambda: sync.rounds >= 1)
        await event("DELETED", model("uid-new", enforce=True))
        assert ("ns", "m") not in accesssync._loops
    finally:
        await accesssync._loops.stop()


def test_retries_back_off_until_an_attempt_succeeds_and_stop_cancels_the_rest(monkeypatch) -> None:
    """A failed attempt (False or an exception) is tried again after a delay doubling up to the cap;
    one key keeps one task; stop() ends what is still retrying."""
    from sparsegate.handlers import periodic

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(periodic.asyncio, "sleep", recorded)
    outcomes = iter([RuntimeError("API server down"), False, False, True])
    calls: list[int] = []

    async def attempt() -> bool:
        calls.append(1)
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def never() -> bool:
        return False

    async def scenario() -> None:
        retries = periodic.Retries("test sync")
        retries.start("k", attempt, delay_s=1.0, max_delay_s=3.0)
        retries.start("k", never, delay_s=1.0)  # already retrying: kept as it is
        retries.start("other", never, delay_s=1.0)
        for _ in range(100):
            if "k" not in retries.pending():
                break
            await real_sleep(0)
        assert len(calls) == 4 and retries.pending() == ["other"]
        await retries.stop()
        assert retries.pending() == []

    asyncio.run(scenario())
    assert [d for d in slept if d != 1.0][:2] == [2.0, 3.0]  # k: 1, 2, then capped at 3
