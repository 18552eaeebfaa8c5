"""The rollout tick's cheap skip: only a resting, recently checked GateConfig is left alone."""

from __future__ import annotations

import time

from sparsegate.domain.rollout import GateVersion
from sparsegate.controllers.rollout import RESTING_CHECK_S, RolloutLoop, RolloutCache

V1 = {"toolGateThreshold": 0.85}
V2 = {"toolGateThreshold": 0.8}


def body(*, spec_params: dict, phase: str = "Succeeded", stable: dict = V1, annotations: dict | None = None,
         rejected: str | None = None) -> dict:
    rollout = {"phase": phase}
    if rejected:
        rollout["rejectedVersion"] = rejected
    return {"metadata": {"annotations": annotations or {}},
            "spec": {"params": spec_params},
            "status": {"stable": GateVersion.from_params(stable).document(), "rollout": rollout}}


def test_resting_and_recent_is_quiet() -> None:
    now = time.time()
    cache = RolloutCache(last_full_check=now - 1)
    assert RolloutLoop._quiet(body(spec_params=V1), cache=cache, now=now)


def test_stale_check_spec_change_annotation_or_active_phase_is_not_quiet() -> None:
    now = time.time()
    recent = RolloutCache(last_full_check=now - 1)
    assert not RolloutLoop._quiet(body(spec_params=V1), cache=RolloutCache(last_full_check=now - RESTING_CHECK_S), now=now)
    assert not RolloutLoop._quiet(body(spec_params=V2), cache=recent, now=now)
    assert not RolloutLoop._quiet(body(spec_params=V1, annotations={"sparsegate.dev/abort": "x"}), cache=recent, now=now)
    assert not RolloutLoop._quiet(body(spec_params=V1, phase="Analysing"), cache=recent, now=now)
    assert not RolloutLoop._quiet(body(spec_params={"bogus": 1}), cache=recent, now=now)


def test_rejected_version_stays_quiet() -> None:
    now = time.time()
    bad = GateVersion.from_params(V2).version
    assert RolloutLoop._quiet(body(spec_params=V2, phase="RolledBack", rejected=bad),
                              cache=RolloutCache(last_full_check=now - 1), now=now)


def test_the_view_kept_between_ticks_decides_as_the_object_does() -> None:
    now = time.time()
    bad = GateVersion.from_params(V2).version
    bodies = [body(spec_params=V1), body(spec_params=V2), body(spec_params={"bogus": 1}),
              body(spec_params=V1, annotations={"sparsegate.dev/abort": "x"}),
              body(spec_params=V1, annotations={"sparsegate.dev/promote": "step"}),
              body(spec_params=V1, phase="Analysing"), body(spec_params=V2, phase="RolledBack", rejected=bad)]
    generation_edit = body(spec_params=V1)
    generation_edit["metadata"]["generation"] = 3
    generation_edit["status"]["observedGeneration"] = 2
    bodies.append(generation_edit)
    for cache in (RolloutCache(last_full_check=now - 1), RolloutCache(last_full_check=now - RESTING_CHECK_S)):
        for b in bodies:
            assert RolloutLoop._quiet(RolloutLoop.quiet_view(b), cache=cache, now=now) == \
                RolloutLoop._quiet(b, cache=cache, now=now), b
    # What it keeps: the metadata the loop's bookkeeping reads, and the decision.
    full = body(spec_params=V1, annotations={"kubectl.kubernetes.io/last-applied-configuration": "{...}" * 100})
    full["metadata"].update(name="g", namespace="ns", generation=1, deletionTimestamp="2026-12-04T00:00:00Z")
    full["status"].update(history=[{"revision": i} for i in range(10)], conditions=[{"type": "Ready"}] * 4)
    view = RolloutLoop.quiet_view(full)
    assert view == {"metadata": {"name": "g", "namespace": "ns", "deletionTimestamp": "2026-12-04T00:00:00Z"},
                    "resting": False}  # observedGeneration not recorded yet


def test_a_model_pod_change_since_the_last_check_is_not_quiet() -> None:
    now = time.time()
    checked = RolloutCache(last_full_check=now - 1, checked_pod_changes=4)
    assert RolloutLoop._quiet(body(spec_params=V1), cache=checked, now=now, pod_changes=4)
    assert not RolloutLoop._quiet(body(spec_params=V1), cache=checked, now=now, pod_changes=5)
    assert not RolloutLoop._quiet(RolloutLoop.quiet_view(body(spec_params=V1)), cache=checked, now=now, pod_changes=5)



def test_a_resting_view_keeps_the_object_as_compact_json_without_what_no_tick_reads() -> None:
    import json

    import kopf

    full = body(spec_params=V1, annotations={"kubectl.kubernetes.io/last-applied-configuration": "{...}" * 100,
                                              "team": "a"})
    full["metadata"].update(name="g", namespace="ns", resourceVersion="7",
                            managedFields=[{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}])
    view = RolloutLoop.quiet_view(kopf.Body(full))  # as the Kopf handler passes it
    assert view["resting"] is True
    kept = json.loads(view["snapshot"])
    assert kept["metadata"] == {"name": "g", "namespace": "ns", "resourceVersion": "7", "annotations": {"team": "a"}}
    assert (kept["spec"], kept["status"]) == (full["spec"], full["status"])
    assert "managedFields" in full["metadata"]  # the delivered body is left as it was


def test_a_resting_loop_sleeps_until_its_safety_net_check() -> None:
    now = [1000.0]
    loop = RolloutLoop(kube=None, clock=lambda: now[0])  # type: ignore[arg-type]  (no API call here)
    resting = RolloutLoop.quiet_view(body(spec_params=V1))
    checked = RolloutCache(last_full_check=now[0] - 10)
    assert loop.next_tick_in(resting, cache=checked, interval_s=5) == RESTING_CHECK_S - 10
    # Overdue (a failed check never recorded one): the next tick comes after the interval, not at once.
    assert loop.next_tick_in(resting, cache=RolloutCache(last_full_check=0.0), interval_s=5) == 5
    # Anything else ticks at the interval: a rollout in flight, a spec edit, a lost race (409).
    assert loop.next_tick_in(RolloutLoop.quiet_view(body(spec_params=V2)), cache=checked, interval_s=5) is None
    assert loop.next_tick_in(RolloutLoop.quiet_view(body(spec_params=V1, phase="Analysing")), cache=checked,
                             interval_s=5) is None
    assert loop.next_tick_in(resting, cache=RolloutCache(last_full_check=now[0] - 10, read_fresh=True),
                             interval_s=5) is None


def test_a_clock_moved_back_past_the_last_check_does_not_postpone_the_safety_net() -> None:
    """The loop's clock is the wall clock: stepped back an hour after a full check, a resting
    GateConfig slept RESTING_CHECK_S plus the hour, and its tick skipped the check all that time."""
    now = [1000.0]
    loop = RolloutLoop(kube=None, clock=lambda: now[0])  # type: ignore[arg-type]  (no API call here)
    resting = RolloutLoop.quiet_view(body(spec_params=V1))
    checked = RolloutCache(last_full_check=now[0])
    now[0] -= 3600
    assert loop.next_tick_in(resting, cache=checked, interval_s=5) is None
    assert not RolloutLoop._quiet(resting, cache=checked, now=now[0])
