"""Progressive GateConfig rollout end to end, with real model servers under load.

Given 10 real model-server containers (the chart's model-server image, one per kwok pod, on
the pod's IP) serving ~50 qps, and the operator running in-cluster from its image (installed with
helm) with a 1 s tick and a 4 s analysis window, when spec.params changes:
a good version goes 5 → 20 → 100 % and is promoted; a bad one (injected errors or latency
over the SLA) is rolled back at the first step with the reason and numbers in status; a
crashed operator (its container SIGKILLed, restarted by the pod runner) resumes from the same
step without re-pushing; pause holds, resume continues,
abort rolls back, promote skips ahead. The tests share one fleet and run in order.
"""

from __future__ import annotations

import json
import time

import pytest
from localcluster.health import wait_for

from rollout_e2e_support import ADDED_LATENCY_MS, GATE, MODEL, REPLICAS, Fleet

pytestmark = pytest.mark.slow


def analysing_steps(seen: list[dict]) -> set[tuple[int, str]]:
    return {(s["step"], s["canaryInstances"]) for s in seen if s["phase"] == "Analysing"}


def reasons(fleet: Fleet) -> set[str]:
    return {e["reason"] for e in fleet.events()}


def test_good_change_goes_5_20_100_and_succeeds(fleet: Fleet) -> None:
    old = fleet.stable_version()
    new = fleet.set_params(toolGateThreshold=0.8)

    seen = fleet.watch("promotion", lambda ro: ro.get("phase") == "Succeeded" and ro.get("reason") == "Promoted"
                       and fleet.stable_version() == new)

    # Each step was analysed with the right number of instances: 5 % → 1, 20 % → 2, 100 % → all.
    assert {(1, f"1/{REPLICAS}"), (2, f"2/{REPLICAS}"), (3, f"{REPLICAS}/{REPLICAS}")} <= analysing_steps(seen), seen
    assert all(s["canaryVersion"] in (None, new) for s in seen)
    # Every pod now runs the new version (hot reload: same pods, no restart) and status says so.
    assert set(fleet.pod_versions().values()) == {new}
    ro = fleet.rollout()
    assert set(ro["podVersions"].values()) == {new} and len(ro["podVersions"]) == REPLICAS
    assert ro["analysis"]["verdict"] == "Pass"
    assert old != new
    assert {"RolloutStarted", "StepPromoted", "Promoted"} <= reasons(fleet)
    assert fleet.operator.metric("sparsegate_rollouts_total", outcome="succeeded") >= 1
    assert fleet.operator.metric("sparsegate_rollout_step_duration_seconds_count", percent="20") >= 1
    # Printer columns show the rollout.
    table = fleet.cluster.kubectl("get", "gateconfig", "gate", "-n", fleet.namespace).stdout
    assert "PHASE" in table and "STABLE" in table and "Succeeded" in table and new in table


@pytest.mark.parametrize(
    ("fault", "check"),
    [({"errorRate": 0.6}, "errorRate"), ({"addedLatencyMs": ADDED_LATENCY_MS}, "p99LatencyMs")],
    ids=["errors", "latency"],
)
def test_bad_change_is_rolled_back_at_the_first_step(fleet: Fleet, fault: dict, check: str) -> None:
    stable = fleet.stable_version()
    bad = fleet.set_params(toolGateThreshold=0.8, faultInjection=fault)

    seen = fleet.watch("automatic rollback", lambda ro: ro.get("phase") == "RolledBack"
                       and ro.get("rejectedVersion") == bad)
    seen = [s for s in seen if s["canaryVersion"] == bad or s["phase"] == "RolledBack"]

    assert max(s["step"] or 0 for s in seen) == 1, seen  # never went past 5 %
    ro = fleet.rollout()
    assert ro["reason"] == "AnalysisFailed" and check in ro["message"], ro["message"]
    assert ro["rejectedVersion"] == bad
    failed = [c for c in ro["analysis"]["checks"] if c["passed"] is False]
    assert [c["name"] for c in failed] == [check] and failed[0]["value"] > failed[0]["threshold"]
    assert fleet.stable_version() == stable
    assert set(fleet.pod_versions().values()) == {stable}
    conditions = {c["type"]: c for c in fleet.gateconfig()["status"]["conditions"]}
    assert conditions["Degraded"]["status"] == "True" and conditions["Degraded"]["reason"] == "AnalysisFailed"
    warnings = [e for e in fleet.events() if e["type"] == "Warning" and e["reason"] == "AnalysisFailed"]
    assert any(bad in e["message"] and check in e["message"] for e in warnings), warnings


def test_operator_crash_mid_rollout_resumes_without_repushing(fleet: Fleet) -> None:
    stable = fleet.stable_version()
    fleet.set_rollout(analysisInterval="8s")  # room to crash inside step 2
    new = fleet.set_params(toolGateThreshold=0.75)
    fleet.watch("step 2 analysing", lambda ro: ro.get("phase") == "Analysing" and ro.get("step") == 2
                and ro.get("canaryVersion") == new)

    fleet.operator.kill()
    frozen = fleet.rollout()
    on_new = sorted(n for n, v in fleet.pod_versions().items() if v == new)
    assert len(on_new) == 2 and frozen["step"] == 2 and fleet.stable_version() == stable
    fleet.operator.wait_restarted()  # a fresh process: no memory of the rollout but what status holds

    seen = fleet.watch("promotion after restart", lambda ro: ro.get("phase") == "Succeeded"
                       and fleet.stable_version() == new)
    fleet.set_rollout(analysisInterval="4s")
    assert min(s["step"] or 99 for s in seen if s["phase"] in ("Progressing", "Analysing")) == 2, seen
    # The new process pushed only to the pods that did not run the new version yet.
    assert fleet.operator.metric("sparsegate_rollout_gate_pushes_total", result="ok") == REPLICAS - len(on_new)
    assert set(fleet.pod_versions().values()) == {new}


def test_pause_holds_resume_continues_abort_rolls_back(fleet: Fleet) -> None:
    stable = fleet.stable_version()
    new = fleet.set_params(toolGateThreshold=0.7)
    fleet.watch("step 1 analysing", lambda ro: ro.get("phase") == "Analysing" and ro.get("step") == 1
                and ro.get("canaryVersion") == new)

    fleet.set_rollout(paused=True)
    fleet.watch("paused", lambda ro: ro.get("phase") == "Paused")
    held = fleet.pod_versions()
    time.sleep(6)  # longer than the analysis window: nothing may move while paused
    ro = fleet.rollout()
    assert ro["phase"] == "Paused" and ro["step"] == 1
    assert fleet.pod_versions() == held and list(held.values()).count(new) == 1

    fleet.set_rollout(paused=False)
    fleet.watch("step 2 after resume", lambda ro: ro.get("step") == 2 and ro.get("phase") == "Analysing")

    fleet.annotate("sparsegate.dev/abort")
    fleet.watch("aborted", lambda ro: ro.get("phase") == "Aborted" and ro.get("rejectedVersion") == new)
    ro = fleet.rollout()
    assert ro["rejectedVersion"] == new and fleet.stable_version() == stable
    assert set(fleet.pod_versions().values()) == {stable}
    assert "sparsegate.dev/abort" not in (fleet.gateconfig()["metadata"].get("annotations") or {})
    assert {"Paused", "Resumed", "Aborted"} <= reasons(fleet)
    assert fleet.operator.metric("sparsegate_rollouts_total", outcome="aborted") >= 1


def test_promote_annotation_skips_remaining_analysis(fleet: Fleet) -> None:
    new = fleet.set_params(toolGateThreshold=0.65)
    fleet.watch("step 1 analysing", lambda ro: ro.get("phase") == "Analysing" and ro.get("step") == 1
                and ro.get("canaryVersion") == new)
    fleet.annotate("sparsegate.dev/promote")
    seen = fleet.watch("promoted", lambda ro: ro.get("phase") == "Succeeded" and fleet.stable_version() == new)
    assert not any(s["phase"] == "Analysing" and s["step"] == 3 for s in seen), seen
    assert set(fleet.pod_versions().values()) == {new}
    assert "sparsegate.dev/promote" not in (fleet.gateconfig()["metadata"].get("annotations") or {})


def test_a_model_whose_gateconfig_ref_is_removed_mid_rollout_serves_the_default_gate(fleet: Fleet) -> None:
    """Its pods held the GateConfig's gates (one the canary) while the ConfigMap, status.gateVersion
    and every new pod had the built-in default: the default is pushed to them all
    (condition DefaultGateApplied), and the ref back hands them to the GateConfig's rollout again."""
    from sparsegate_workload import gateparams

    default = gateparams.DEFAULT_DOCUMENT.version
    stable = fleet.stable_version()
    new = fleet.set_params(toolGateThreshold=0.55)
    fleet.watch("step 1 analysing", lambda ro: ro.get("phase") == "Analysing" and ro.get("step") == 1
                and ro.get("canaryVersion") == new)
    assert new in fleet.pod_versions().values()

    fleet.cluster.kubectl("patch", "sparsemodel", MODEL, "-n", fleet.namespace, "--type=json", "-p",
                          json.dumps([{"op": "remove", "path": "/spec/gateConfigRef"}]))

    def on_default() -> bool:
        status = fleet.get("sparsemodel", MODEL).get("status") or {}
        applied = {c["type"]: c for c in status.get("conditions") or []}.get("DefaultGateApplied") or {}
        return status.get("gateVersion") == default and applied.get("status") == "True" \
            and set(fleet.pod_versions().values()) == {default}

    wait_for(on_default, what="every pod on the default gate", timeout_s=60, interval_s=1.0)
    # The GateConfig's rollout, still in flight, no longer counts the model (its index entry went
    # with the ref): two analysis windows later no pod holds one of its versions again.
    time.sleep(8)
    assert set(fleet.pod_versions().values()) == {default}

    fleet.cluster.kubectl("patch", "sparsemodel", MODEL, "-n", fleet.namespace, "--type=merge", "-p",
                          json.dumps({"spec": {"gateConfigRef": {"name": GATE}}}))
    # Without instances the GateConfig promoted its canary directly (NoInstances): that is what the
    # model's pods get back.
    fleet.watch("promoted without instances", lambda ro: ro.get("phase") == "Succeeded")
    assert fleet.stable_version() in (new, stable)
    wait_for(lambda: set(fleet.pod_versions().values()) == {fleet.stable_version()},
             what="the GateConfig's stable back on every pod", timeout_s=60, interval_s=1.0)
    conditions = fleet.get("sparsemodel", MODEL)["status"].get("conditions") or []
    assert "DefaultGateApplied" not in {c["type"] for c in conditions}
