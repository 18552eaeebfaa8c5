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
    assert (ready.status, ready.reason) == (c.Status.FALSE, c.Reason.CONTAINERS_FAILING)
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


def pod(name, *, waiting=None, terminated=None, restarts=0, deleting=False):
    state = {"waiting": waiting} if waiting else {"terminated": terminated} if terminated else {"running": {}}
    meta = {"name": name, **({"deletionTimestamp": T0} if deleting else {})}
    return {"metadata": meta, "status": {"containerStatuses": [{"name": "server", "restartCount": restarts,
                                                                "state": state}]}}


def past_deadline(*, ready=1, updated=2, replicas=2, generation=1, observed=1):
    dep = deployment(ready=ready, updated=updated, replicas=replicas, generation=generation, observed=observed)
    dep["status"]["conditions"] = [
        {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable"},
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": 'ReplicaSet "m-7d9f" has timed out progressing.'}]
    return dep


OK_GATE = gate.resolve(None, referenced=False, num_experts=8)


def test_pods_that_cannot_run_stall_the_model_instead_of_reconciling_it():
    problems = c.container_problems([pod("m-abc", waiting={"reason": "CrashLoopBackOff",
                                                          "message": "back-off 10s restarting failed container"})])
    workload = c.workload_conditions(desired=2, deployment=deployment(ready=1, updated=2), gate_unavailable=False,
                                     problems=problems)
    ready, progressing = workload
    assert (ready.status, ready.reason) == (c.Status.FALSE, c.Reason.CONTAINERS_FAILING)
    assert ready.message == \
        "1/2 ready, 2 updated; m-abc/server: CrashLoopBackOff: back-off 10s restarting failed container"
    assert progressing.status is c.Status.TRUE  # the Deployment controller has not given up (yet)
    ok = c.degraded_condition(gate_error=None, gate_source="default", apply_error=None)
    reconciling, stalled = c.kstatus_conditions(workload, degraded=ok)
    assert (stalled.status, stalled.reason, stalled.message) == (c.Status.TRUE, c.Reason.CONTAINERS_FAILING, ready.message)
    assert reconciling.status is c.Status.FALSE
    # A missing gate still says why first.
    missing = c.degraded_condition(gate_error="GateConfig ns/g not found", gate_source="missing", apply_error=None)
    assert c.kstatus_conditions(workload, degraded=missing)[1].reason is c.Reason.GATE_CONFIG_NOT_FOUND


def test_a_deployment_past_its_progress_deadline_stalls_the_model():
    ready, progressing = c.workload_conditions(desired=2, deployment=past_deadline(), gate_unavailable=False)
    assert (ready.status, ready.reason) == (c.Status.FALSE, c.Reason.PROGRESS_DEADLINE_EXCEEDED)
    assert ready.message == '1/2 ready, 2 updated; ReplicaSet "m-7d9f" has timed out progressing.'
    assert (progressing.status, progressing.reason) == (c.Status.FALSE, c.Reason.PROGRESS_DEADLINE_EXCEEDED)
    assert c.kstatus_conditions([ready, progressing], degraded=None)[1].status is c.Status.TRUE
    # With failing pods too, they name the cause; the deadline is added to the message.
    ready, _ = c.workload_conditions(desired=2, deployment=past_deadline(), gate_unavailable=False,
                                     problems=["m-abc/server: ImagePullBackOff"])
    assert ready.reason is c.Reason.CONTAINERS_FAILING and ready.message.endswith("has timed out progressing.")
    # The deadline of a spec the controller has not observed is not this spec's; a done one is over.
    for dep in (past_deadline(generation=2, observed=1), past_deadline(ready=2, updated=2)):
        ready, _ = c.workload_conditions(desired=2, deployment=dep, gate_unavailable=False)
        assert ready.reason not in c.WORKLOAD_STALLS


def test_failing_containers_are_stuck_waits_and_repeated_non_zero_exits_not_transient_ones():
    pods = [pod("a", waiting={"reason": "CreateContainerConfigError", "message": 'secret "s" not found'}),
            pod("b", terminated={"exitCode": 137, "reason": "OOMKilled"}, restarts=2),
            pod("c", waiting={"reason": "ContainerCreating"}), pod("d", waiting={"reason": "PodInitializing"}),
            pod("e", terminated={"exitCode": 1, "reason": "Error"}),  # the first exit: not repeated yet
            pod("f", terminated={"exitCode": 0, "reason": "Completed"}, restarts=3),
            pod("g", restarts=5),  # running again between two crashes
            pod("h", waiting={"reason": "InvalidImageName"}, deleting=True)]  # going: stalls nothing
    assert c.container_problems(pods) == ['a/server: CreateContainerConfigError: secret "s" not found',
                                          "b/server: OOMKilled: exit code 137"]
    assert [p["metadata"]["name"] for p in pods if c.is_stuck(p)] == ["a", "b", "h"]  # h's events still refresh


def test_an_apply_error_that_passes_is_retrying_not_a_refusal():
    """5xx, 429, a 409 conflict, 408 or no HTTP answer: the operator's retry may get past it
    (Degraded ApplyRetrying, not Stalled); a 4xx refusal or someone else's object needs a person."""
    for error in ("500 Internal Server Error: x", "503 Service Unavailable: x", "429 Too Many Requests: x",
                  "409 Conflict: the object has been modified", "408 Request Timeout: x",
                  "ReadTimeoutError: HTTPSConnectionPool: Read timed out.", "MaxRetryError: x",
                  "ProtocolError: ('Connection aborted.', RemoteDisconnected())", "ConnectionResetError: x"):
        assert c.apply_error_passes(error), error
        degraded = c.degraded_condition(gate_error=None, gate_source="default", apply_error=error)
        assert (degraded.status, degraded.reason) == (c.Status.TRUE, c.Reason.APPLY_RETRYING)
        workload = c.workload_conditions(desired=2, deployment=deployment(ready=2), gate_unavailable=False)
        reconciling, stalled = c.kstatus_conditions(workload, degraded=degraded)
        assert (reconciling.status, stalled.status) == (c.Status.TRUE, c.Status.FALSE), error
        assert (reconciling.reason, reconciling.message) == (c.Reason.APPLY_RETRYING, error)
    for error in ("422 Invalid: x", "400 Bad Request: x", "403 Forbidden: x", "401 Unauthorized: x", "404 Not Found: x",
                  "409 AlreadyExists: Service m already exists and is not this model's", "ValueError: x"):
        assert not c.apply_error_passes(error), error
        degraded = c.degraded_condition(gate_error=None, gate_source="default", apply_error=error)
        assert degraded.reason is c.Reason.APPLY_FAILED
        workload = c.workload_conditions(desired=2, deployment=deployment(ready=2), gate_unavailable=False)
        assert [x.status for x in c.kstatus_conditions(workload, degraded=degraded)] == [c.Status.FALSE, c.Status.TRUE]
    # Pods that cannot run still stall the model while an apply is retried.
    crash = ["m-abc/server: CrashLoopBackOff: back-off"]
    workload = c.workload_conditions(desired=2, deployment=deployment(ready=1), gate_unavailable=False, problems=crash)
    retrying = c.degraded_condition(gate_error=None, gate_source="default", apply_error="503 Service Unavailable: x")
    reconciling, stalled = c.kstatus_conditions(workload, degraded=retrying)
    assert (reconciling.status, stalled.status, stalled.reason) == (c.Status.FALSE, c.Status.TRUE,
                                                                    c.Reason.CONTAINERS_FAILING)


def test_the_deployment_watcher_stalls_the_model_on_failing_pods_and_clears_it_once_they_run():
    st = model_status.after_reconcile(model=model(), generation=4, gate=OK_GATE, deployment=deployment(ready=0),
                                      apply_error=None, now=T0)
    assert {k: v["status"] for k, v in by_type(st["conditions"]).items() if k in ("Reconciling", "Stalled")} == \
        {"Reconciling": "True", "Stalled": "False"}
    crash = ["m-abc/server: CrashLoopBackOff: back-off 10s restarting failed container"]
    stalled = model_status.after_deployment_event(model=model(status=st), deployment=deployment(ready=1, updated=2),
                                                  now=T1, problems=crash)
    conds = by_type(stalled["conditions"])
    assert (conds["Stalled"]["status"], conds["Stalled"]["reason"]) == ("True", "ContainersFailing")
    assert crash[0] in conds["Stalled"]["message"] and conds["Stalled"]["lastTransitionTime"] == T1
    assert (conds["Reconciling"]["status"], conds["Ready"]["status"]) == ("False", "False")
    assert conds["Degraded"]["status"] == "False"  # the reconcile's, carried over
    recovered = model_status.after_deployment_event(model=model(status={**st, **stalled}), deployment=deployment(ready=2),
                                                    now=T1)
    conds = by_type(recovered["conditions"])
    assert conds["Ready"]["status"] == "True" and conds["Reconciling"]["status"] == "False"
    # Back to the Degraded mirror the reconcile writes, so the next reconcile changes nothing.
    assert (conds["Stalled"]["status"], conds["Stalled"]["reason"], conds["Stalled"]["message"]) == \
        ("False", "AsExpected", "gate from default")
    again = model_status.after_reconcile(model=model(status={**st, **stalled, **recovered}), generation=4, gate=OK_GATE,
                                         deployment=deployment(ready=2), apply_error=None, now=T1)
    assert again["conditions"] == recovered["conditions"]


def test_a_workload_stall_is_posted_as_an_event_when_ready_does_not_change():
    starting = [{"type": "Ready", "status": "False", "reason": "ReplicasNotReady"},
                {"type": "Stalled", "status": "False", "reason": "AsExpected"}]
    failing = [{"type": "Ready", "status": "False", "reason": "ContainersFailing"},
               {"type": "Stalled", "status": "True", "reason": "ContainersFailing"}]
    assert [t["type"] for t in c.transitions(starting, failing)] == ["Stalled"]
    was_ready = [{**starting[0], "status": "True"}, starting[1]]
    assert [t["type"] for t in c.transitions(was_ready, failing)] == ["Ready"]  # said once, by Ready
    degraded = [{"type": "Degraded", "status": "True", "reason": "GateConfigNotFound"},
                {"type": "Stalled", "status": "True", "reason": "GateConfigNotFound"}]
    assert [t["type"] for t in c.transitions(starting, degraded)] == ["Degraded"]


def test_reconcile_status_carries_the_pod_selector_the_scale_subresource_serves():
    """An HPA targeting the SparseModel reads the scale's selector (CRD labelSelectorPath
    .status.selector); without one it refuses to scale (InvalidSelector, "selector is required")."""
    import yaml
    from pathlib import Path

    from sparsegate.domain import render

    crd = yaml.safe_load((Path(__file__).resolve().parents[3] / "charts/sparsegate/crds/sparsemodels.yaml").read_text())
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"].get("labelSelectorPath") == ".status.selector"
    assert version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["selector"]["type"] == "string"
    res = gate.resolve(None, referenced=False, num_experts=8)
    st = model_status.after_reconcile(model=model(), generation=4, gate=res, deployment=None, apply_error=None, now=T0)
    dep = render.render_deployment(model(), res.document)
    assert dict(kv.split("=", 1) for kv in st["selector"].split(",")) == dep["spec"]["selector"]["matchLabels"]
