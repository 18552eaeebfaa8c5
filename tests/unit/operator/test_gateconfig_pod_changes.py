"""A model pod's watch event reaches its GateConfig's rollout loop (handlers/gateconfig.py): events
of serving pods (Ready, addressed, not going) move the GateConfig's pod-change count, which makes
its next tick check the pods even when it is resting; other pod events cost nothing."""

from __future__ import annotations

import logging
from typing import Any

from sparsegate_contracts import names

from sparsegate.domain.fleet_view import model_view, pod_serving
from sparsegate.handlers import gateconfig


def pod(model: str | None, *, ready: bool = True, ip: str | None = "127.30.0.5", going: bool = False) -> dict[str, Any]:
    labels = {names.NAME_LABEL: names.MODEL_SERVER_NAME}
    if model:
        labels[names.MODEL_LABEL] = model
    meta: dict[str, Any] = {"name": f"{model}-0", "namespace": "ns", "labels": labels}
    if going:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_only_a_ready_addressed_live_pod_is_serving() -> None:
    assert pod_serving(pod("m"))
    assert not pod_serving(pod("m", ready=False))
    assert not pod_serving(pod("m", ip=None))
    assert not pod_serving(pod("m", going=True))
    assert not pod_serving({"metadata": {}, "status": {"podIP": "127.30.0.5"}})  # no conditions yet


async def test_serving_pod_events_count_per_gate(monkeypatch) -> None:
    monkeypatch.setattr(gateconfig, "_pod_changes", {})
    index = {("ns", m): [model_view({"metadata": {"name": m, "namespace": "ns"},
                                     "spec": {"gateConfigRef": {"name": g}}})]
             for m, g in (("m-a", "gate-1"), ("m-b", "gate-1"), ("m-c", "gate-2"))}
    index[("ns", "m-unref")] = [model_view({"metadata": {"name": "m-unref", "namespace": "ns"}, "spec": {}})]
    events = [pod("m-a"), pod("m-b"), pod("m-c"), pod("m-a", ready=False), pod("m-c", ip=None),
              pod("m-c", going=True), pod("m-unbound"), pod("m-unref"), pod(None)]
    for p in events:
        await gateconfig.model_pod_changed_rollout(body=p, namespace="ns", sparsegate_model_views=index)
    assert gateconfig._pod_changes == {("ns", "gate-1"): 2, ("ns", "gate-2"): 1}


async def test_a_serving_pod_brings_its_resting_gates_next_tick_within_the_interval(monkeypatch) -> None:
    import asyncio

    from localcluster.health import wait_for_async
    from sparsegate.handlers.periodic import ObjectLoops

    loops = ObjectLoops(kind="GateConfig", interval_s=0.05)
    monkeypatch.setattr(gateconfig, "_loops", loops)
    monkeypatch.setattr(gateconfig, "_pod_changes", {})
    index = {("ns", "m-a"): [model_view({"metadata": {"name": "m-a", "namespace": "ns"},
                                         "spec": {"gateConfigRef": {"name": "gate-1"}}})]}
    rounds: list[int] = []
    at: list[float] = []
    clock = asyncio.get_running_loop().time

    async def tick(_: Any) -> float:
        rounds.append(gateconfig._pod_changes.get(("ns", "gate-1"), 0))
        at.append(clock())
        return 300.0  # resting

    loops.seen(key=("ns", "gate-1"), event_type=None, body={"metadata": {"name": "gate-1"}}, tick=tick)
    await wait_for_async(lambda: rounds, what="the first tick", timeout_s=10, interval_s=0.005)
    event_at = clock()
    await gateconfig.model_pod_changed_rollout(body=pod("m-a"), namespace="ns", sparsegate_model_views=index)
    await gateconfig.model_pod_changed_rollout(body=pod("m-a"), namespace="ns", sparsegate_model_views=index)
    # Within the 0.05 s interval; a loaded machine may run it late.
    await wait_for_async(lambda: len(rounds) > 1, what="the nudged tick", timeout_s=10, interval_s=0.005)
    await asyncio.sleep(0.1)
    await loops.stop()
    assert rounds == [0, 2]  # one more tick (not two), which sees both events
    assert at[1] - event_at < 2.0, at[1] - event_at  # loosely bounded, far under the 300 s rest


async def test_a_model_moved_to_another_gateconfig_brings_that_ones_pod_check(monkeypatch) -> None:
    """A model's gateConfigRef edited from gate-1 (mid-rollout: its pods hold the canary) to gate-2,
    which rests: no pod of the model becomes Ready again, so without a nudge gate-2 would leave them
    on gate-1's gate until its safety-net check, minutes away. The model's update handler counts a
    change for gate-2 (its next tick checks the pods) and nudges its loop; a spec change that keeps
    the reference, or a first handling (old None: every GateConfig checks at its first tick), does not."""
    import concurrent.futures
    import logging
    from types import SimpleNamespace

    import kopf

    from sparsegate.handlers import sparsemodel

    nudged: list[list[tuple[str, str]]] = []
    monkeypatch.setattr(gateconfig, "_pod_changes", {})
    monkeypatch.setattr(gateconfig._loops, "nudge", lambda keys: nudged.append(list(keys)) or len(keys))
    monkeypatch.setattr(sparsemodel, "reconcile", lambda memo, m, **_: SimpleNamespace(service=None))
    memo = kopf.Memo()
    memo.model_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def model(gate: str | None, replicas: int = 1) -> dict[str, Any]:
        spec: dict[str, Any] = {"replicas": replicas, "model": {"experts": 8}}
        if gate:
            spec["gateConfigRef"] = {"name": gate}
        return {"metadata": {"name": "m", "namespace": "ns", "generation": 2}, "spec": spec}

    async def update(old: dict | None, new: dict) -> None:
        await sparsemodel.reconcile_model(
            body=kopf.Body(new), namespace="ns", name="m", memo=memo, logger=logging.getLogger("test"),
            old=old, sparsegate_model_views={}, sparsegate_model_pod_views={}, sparsegate_model_deployment_views={},
            sparsegate_model_replicaset_views={}, sparsegate_gate_views={})

    await update(model("gate-1"), model("gate-1", replicas=2))  # the same GateConfig
    await update(None, model("gate-2"))  # created, or first handled after a restart
    await update(model("gate-1"), model(None))  # back to the built-in gate: no GateConfig to check
    assert gateconfig._pod_changes == {} and nudged == []
    await update(model("gate-1"), model("gate-2"))
    assert gateconfig._pod_changes == {("ns", "gate-2"): 1} and nudged == [[("ns", "gate-2")]]
    await update(model(None), model("gate-1"))  # from the built-in gate to a GateConfig
    assert gateconfig._pod_changes == {("ns", "gate-2"): 1, ("ns", "gate-1"): 1}
    memo.model_pool.shutdown()


async def test_an_earlier_gateconfigs_deleted_event_leaves_the_re_created_ones_loop_running(monkeypatch) -> None:
    """Deleted and created again under its name (``kubectl replace --force``): Kopf handles each uid
    apart, so the old object's DELETED may come after the new one's first event. The loop keeps
    the object as ``RolloutLoop.quiet_view``, which must carry the uid the loops tell objects by, or
    that DELETED ends the new GateConfig's rollout loop (no tick until its next event)."""
    from types import SimpleNamespace

    from sparsegate.handlers.periodic import ObjectLoops

    loops = ObjectLoops(kind="GateConfig", interval_s=300)
    monkeypatch.setattr(gateconfig, "_loops", loops)
    monkeypatch.setattr(gateconfig, "_pod_changes", {})
    indexes = {k: {} for k in ("sparsegate_model_views", "sparsegate_model_pod_views",
                               "sparsegate_model_deployment_views", "sparsegate_model_replicaset_views",
                               "sparsegate_gate_views")}

    def gate(uid: str) -> dict[str, Any]:
        return {"metadata": {"name": "gate-1", "namespace": "ns", "uid": uid, "generation": 1},
                "spec": {"params": {"version": "v1"}}}

    async def event(type_: str, body: dict[str, Any]) -> None:
        await gateconfig.gateconfig_rollout_loop(type=type_, body=body, namespace="ns", name="gate-1",
                                                 memo=SimpleNamespace(), models_by_gate={},
                                                 logger=logging.getLogger("test"), **indexes)

    monkeypatch.setattr(gateconfig, "rollout_tick", _no_tick)
    try:
        await event("ADDED", gate("uid-new"))
        await event("DELETED", gate("uid-old"))
        assert ("ns", "gate-1") in loops, "the re-created GateConfig's rollout loop was ended"
        await event("DELETED", gate("uid-new"))
        assert ("ns", "gate-1") not in loops
    finally:
        await loops.stop()


async def _no_tick(**_: Any) -> float:
    return 300.0


async def test_counts_of_gateconfigs_without_a_loop_do_not_pile_up(monkeypatch) -> None:
    """A GateConfig's DELETED event drops its count, but its models' pods still name it: each Ready
    pod event counted for it again, and nothing ever dropped that (one entry per GateConfig name
    ever deleted or mistyped in a gateConfigRef, for the operator's life). A running loop's count
    is kept."""
    from sparsegate.handlers.periodic import ObjectLoops

    loops = ObjectLoops(kind="GateConfig", interval_s=300)
    monkeypatch.setattr(gateconfig, "_loops", loops)
    monkeypatch.setattr(gateconfig, "_pod_changes", {})

    def index(gate: str) -> dict:
        return {("ns", "m"): [model_view({"metadata": {"name": "m", "namespace": "ns"},
                                          "spec": {"gateConfigRef": {"name": gate}}})]}

    loops.seen(key=("ns", "live"), event_type=None, body={"metadata": {"name": "live"}}, tick=_no_tick)
    try:
        await gateconfig.model_pod_changed_rollout(body=pod("m"), namespace="ns", sparsegate_model_views=index("live"))
        for n in range(1000):
            await gateconfig.model_pod_changed_rollout(body=pod("m"), namespace="ns",
                                                       sparsegate_model_views=index(f"deleted-{n}"))
        assert len(gateconfig._pod_changes) <= 2 * len(loops) + 65
        assert gateconfig._pod_changes[("ns", "live")] == 1
    finally:
        await loops.stop()


async def test_a_tick_that_keeps_failing_is_warned_about_once_not_every_tick(caplog) -> None:
    """A status write refused every tick (an admission policy, a quota, RBAC): one WARNING when it
    starts and one when its error changes, not one per GateConfig every TICK_S for as long as it lasts."""
    import kopf

    from sparsegate.clients.kube import KubeError

    class Failing:
        error: KubeError | None = KubeError(403, "Forbidden", "admission webhook denied the request")

        async def tick(self, **_: Any) -> None:
            if self.error is not None:
                raise self.error

        def next_tick_in(self, *_: Any, **__: Any) -> None:
            return None

    loop = Failing()
    memo = kopf.Memo(rollout_loop=loop)  # a GateConfig's memo is a kopf.Memo (a dict)
    caplog.set_level(logging.DEBUG, logger="test.failing-tick")
    logger = logging.getLogger("test.failing-tick")

    async def ticks(n: int) -> list[str]:
        caplog.clear()
        for _ in range(n):
            await gateconfig.rollout_tick(seen={}, namespace="ns", name="gate-1", memo=memo,  # type: ignore[arg-type]
                                          models_by_gate={}, inventory=None, logger=logger)  # type: ignore[arg-type]
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert len(await ticks(12)) == 1
    loop.error = KubeError(500, "InternalError", "etcdserver: request timed out")
    assert len(await ticks(3)) == 1
    loop.error = None
    assert await ticks(1) == []
    loop.error = KubeError(500, "InternalError", "etcdserver: request timed out")
    assert len(await ticks(2)) == 1  # back after a tick that succeeded: news again
