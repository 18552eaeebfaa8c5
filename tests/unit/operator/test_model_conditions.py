"""Conditions and the SparseModel status derived from them."""

from __future__ import annotations

from sparsegate.domain import conditions as c
from sparsegate.domain import gate, model_status
from sparsegate_workload import gateparams

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def deployment(*, ready, updated=None, replicas=None, generation=1, observed=1):
    updated = ready if updated is None else updated
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "readyReplicas": ready,
                       "updatedReplicas": updated, "replicas": ready if replicas is None else replicas}}


def model(*, replicas=2, status=None):
    return {"metadata": {"name": "m", "namespace": "ns", "generation": 4, "uid": "u"},
            "spec": {"replicas": replicas, "model": {"experts": 8}}, "status": status or {}}


def by_type(conds):
    return {x["type"]: x for x in conds}


def test_enums_are_strings():
    assert c.ConditionType.READY == "Ready" and c.Reason.GATE_CONFIG_NOT_FOUND == "GateConfigNotFound"


def test_ready_when_all_replicas_ready_and_updated():
    ready, progressing = c.workload_conditions(desired=2, deployment=deployment(ready=2), gate_unavailable=False)
    assert (ready.status, ready.reason) == (c.Status.TRUE, c.Reason.ALL_REPLICAS_READY)
    assert progressing.status is c.Status.FALSE


def test_not_ready_while_rolling_or_deployment_not_observed():
    for dep in (deployment(ready=1), deployment(ready=2, updated=1),
                deployment(ready=2, generation=2, observed=1)):
        ready, progressing = c.workload_conditions(desired=2, deployment=dep, gate_unavailable=False)
        assert ready.status is c.Status.FALSE and progressing.status is c.Status.TRUE


def test_scaled_to_zero_is_ready():
    ready, _ = c.workload_conditions(desired=0, deployment=deployment(ready=0), gate_unavailable=False)
    assert ready.reason is c.Reason.SCALED_TO_ZERO and ready.status is c.Status.TRUE


def test_transition_time_kept_while_status_unchanged():
    first = c.set_conditions([], [c.Condition(c.ConditionType.READY, c.Status.FALSE,
                                              c.Reason.REPLICAS_NOT_READY, "0/2")],
                             now=T0, observed_generation=1)
    same = c.set_conditions(first, [c.Condition(c.ConditionType.READY, c.Status.FALSE,
                                                c.Reason.REPLICAS_NOT_READY, "1/2")],
                            now=T1, observed_generation=1)
    flipped = c.set_conditions(same, [c.Condition(c.ConditionType.READY, c.Status.TRUE,
                                                  c.Reason.ALL_REPLICAS_READY, "2/2")],
                               now=T1, observed_generation=1)
    assert same[0]["lastTransitionTime"] == T0 and same[0]["message"] == "1/2"
    assert flipped[0]["lastTransitionTime"] == T1
    assert [t["status"] for t in c.transitions(same, flipped)] == ["True"]
    assert c.transitions(first, same) == []


def test_reconcile_status_missing_gate_is_degraded_with_reason():
    res = gate.resolve(None, referenced=True, num_experts=8)
    st = model_status.after_reconcile(model=model(), generation=4, gate=res, deployment=None, apply_error=None, now=T0)
    conds = by_type(st["conditions"])
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "GateConfigNotFound"
    assert conds["Ready"]["reason"] == "GateUnavailable"
    assert st["observedGeneration"] == 4 and "gateVersion" not in st


def test_reconcile_status_ok():
    res = gate.resolve(None, referenced=False, num_experts=8)
    st = model_status.after_reconcile(model=model(), generation=4, gate=res, deployment=deployment(ready=2),
                                      apply_error=None, now=T0)
    conds = by_type(st["conditions"])
    assert conds["Ready"]["status"] == "True" and conds["Degraded"]["status"] == "False"
    assert st["gateVersion"] == gateparams.DEFAULT_DOCUMENT.version
    assert st["readyReplicas"] == 2 and all(x["observedGeneration"] == 4 for x in st["conditions"])


def test_deployment_event_keeps_degraded_and_skips_noop_writes():
    res = gate.resolve(None, referenced=True, num_experts=8)
    st = model_status.after_reconcile(model=model(), generation=4, gate=res, deployment=deployment(ready=1),
                                      apply_error=None, now=T0)
    m = model(status=st)
    assert model_status.after_deployment_event(model=m, deployment=deployment(ready=1), now=T1) is None
    patch = model_status.after_deployment_event(model=m, deployment=deployment(ready=2), now=T1)
    conds = by_type(patch["conditions"])
    assert conds["Ready"]["status"] == "True" and conds["Degraded"]["status"] == "True"
    assert patch["readyReplicas"] == 2


def test_container_problems_name_stuck_containers_only():
    pods = [{"metadata": {"name": f"p{i}"}, "status": {"containerStatuses": [
        {"name": "server", "state": {"waiting": {"reason": reason, "message": "m" * 500}}}]}}
        for i, reason in enumerate(["CrashLoopBackOff", "ContainerCreating", "ErrImagePull"])]
    problems = c.container_problems(pods)
    assert [p.split(":")[0] for p in problems] == ["p0/server", "p2/server"]
    assert all(len(p) < 260 for p in problems)  # messages are cut
    assert c.is_stuck(pods[0]) and not c.is_stuck(pods[1])
    ready, progressing = c.workload_conditions(desired=2, deployment=deployment(ready=0), gate_unavailable=False,
                                               problems=problems)
    assert (ready.status, ready.reason) == (c.Status.FALSE, c.Reason.CONTAINERS_WAITING)
    assert "p0/server: CrashLoopBackOff" in ready.message and progressing.status is c.Status.TRUE
    # Problems do not matter once every replica is ready.
    ready, _ = c.workload_conditions(desired=2, deployment=deployment(ready=2), gate_unavailable=False, problems=problems)
    assert ready.status is c.Status.TRUE


def test_a_ready_deployment_is_not_ready_while_the_service_is_not_applied():
    ready, progressing = c.workload_conditions(desired=2, deployment=deployment(ready=2), gate_unavailable=False,
                                               service_applied=False)
    assert (ready.status, ready.reason) == (c.Status.FALSE, c.Reason.SERVICE_NOT_APPLIED)
    assert (progressing.status, progressing.reason) == (c.Status.TRUE, c.Reason.SERVICE_NOT_APPLIED)
    assert "2/2 ready" in ready.message and "Service is not applied yet" in ready.message
    # Not done yet: the replicas are what Ready waits for, as before.
    ready, _ = c.workload_conditions(desired=2, deployment=deployment(ready=1), gate_unavailable=False, service_applied=False)
    assert ready.reason == c.Reason.REPLICAS_NOT_READY
