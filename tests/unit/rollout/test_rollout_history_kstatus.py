"""Revision history, retry, step promote and the kstatus view of every status the rollout writes.

kstatus is run as Flux runs it (``kstatus_port.compute``, a port of cli-utils' ``Compute``) over
the whole object the handler persists: the state machine's status plus ``observedGeneration``.
SparseModel and RoutingPolicy statuses, built by their pure status functions, get the same check.
"""

from __future__ import annotations

import math
from typing import Any

import kstatus_port
from kstatus_port import CURRENT, FAILED, IN_PROGRESS

from sparsegate.domain import model_status, policy_status
from sparsegate.domain.analysis import GroupMetrics
from sparsegate.domain.gate import GateResolution
from sparsegate.domain.rollout_codec import epoch_time
from sparsegate.domain.rollout import (
    ABORT_ANNOTATION,
    HISTORY_LIMIT,
    PROMOTE_ANNOTATION,
    PROMOTE_STEP_VALUE,
    RETRY_ANNOTATION,
    ClearAnnotation,
    EmitEvent,
    GateVersion,
    Observations,
    Phase,
    PodObservation,
    PushGate,
    RolloutStatus,
    annotation_requests,
    declared_requests,
    invalid_spec,
    kstatus_conditions,
    next_action,
    parse_spec,
    record_stable,
    request_values,
)

V1 = {"toolGateThreshold": 0.85, "entropyBeta": 0.1}
V2 = {"toolGateThreshold": 0.8, "entropyBeta": 0.1}
V3 = {"toolGateThreshold": 0.75, "entropyBeta": 0.1}


def v(params: dict) -> str:
    return GateVersion.from_params(params).version


def healthy(requests: float = 100, errors: float = 0) -> GroupMetrics:
    buckets = {0.1: requests, 1.0: requests, 2.5: requests, math.inf: requests}
    return GroupMetrics(pods=1, seconds=10, requests=requests, errors=errors, duration_buckets=buckets,
                        mean_active_experts=1.3)


class Gate:
    """A GateConfig as the API server holds it: spec edits bump generation; each tick persists the
    decision's status with ``observedGeneration`` as controllers/rollout.py ``_persist`` does;
    pods apply pushed gates."""

    def __init__(self, params: dict, *, pods: int = 20, **rollout: Any) -> None:
        self.spec: dict[str, Any] = {"params": params,
                                     "rollout": {"analysisInterval": "10s", "strategy": "instances", **rollout}}
        self.generation = 1
        self.status: dict[str, Any] = {}
        self.pods = {f"m-{i:02d}": v(params) for i in range(pods)}
        self.now = 1000.0
        self.actions: list[object] = []

    def edit(self, params: dict | None = None, **rollout: Any) -> None:
        if params is not None:
            self.spec["params"] = params
        self.spec["rollout"].update(rollout)
        self.generation += 1

    def obj(self) -> dict[str, Any]:
        return {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig",
                "metadata": {"name": "g", "namespace": "ns", "generation": self.generation},
                "spec": self.spec, "status": self.status}

    def kstatus(self) -> str:
        return kstatus_port.compute(self.obj())[0]

    def tick(self, *, dt: float = 1.0, canary: GroupMetrics | None = None, stable: GroupMetrics | None = None,
             annotations: dict[str, str] | None = None, declared: frozenset[str] = frozenset()) -> RolloutStatus:
        self.now += dt
        obs = Observations(
            pods=tuple(PodObservation(n, True, ver) for n, ver in sorted(self.pods.items())),
            canary_metrics=canary, stable_metrics=stable, fleet_qps=20.0, stable_error_rate=0.0,
            **annotation_requests(annotations), request_values=request_values(annotations), declared=declared)
        status = RolloutStatus.from_status(self.status)
        try:
            parsed = parse_spec(self.spec)
        except ValueError as e:
            decision = invalid_spec(status=status, error=str(e), now=self.now)
            steps: tuple[int, ...] = (100,)
        else:
            decision = next_action(spec=parsed, status=status, obs=obs, now=self.now)
            steps = parsed.steps
        self.status = {**self.status, **decision.status.to_status(steps=steps), "observedGeneration": self.generation}
        for a in decision.actions:
            if isinstance(a, PushGate):
                self.pods[a.pod] = a.gate.version
        self.actions += decision.actions
        return RolloutStatus.from_status(self.status)

    def until(self, phase: Phase, *, limit: int = 50, **kw: Any) -> RolloutStatus:
        for _ in range(limit):
            if self.tick(**kw).phase == phase:
                return RolloutStatus.from_status(self.status)
        raise AssertionError(f"never reached {phase}: {self.status['rollout']}")

    def promote_through(self) -> RolloutStatus:
        """Pass every step's analysis until the canary is promoted."""
        for _ in range(10):
            st = self.until(Phase.ANALYSING)
            st = self.tick(dt=11, canary=healthy(), stable=healthy(1000))
            if st.phase == Phase.SUCCEEDED:
                return st
        raise AssertionError("never promoted")

    def conditions(self) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for c in self.status["conditions"]}


# ---------------------------------------------------------------- history


def test_history_records_each_promoted_stable_version_with_its_params() -> None:
    g = Gate(V1)
    g.tick()
    assert [(r["revision"], r["version"], r["reason"]) for r in g.status["history"]] == [(1, v(V1), "Initialized")]
    g.edit(V2)
    g.promote_through()
    history = g.status["history"]
    assert [(r["revision"], r["version"], r["reason"]) for r in history] == [
        (1, v(V1), "Initialized"), (2, v(V2), "Promoted")]
    # Enough to restore a version: its params hash to the recorded version and checksum.
    assert GateVersion.from_params(history[0]["params"]).document() == {
        k: history[0][k] for k in ("version", "checksum", "params")}
    assert history[-1]["version"] == g.status["stable"]["version"] and history[-1]["promotedAt"].endswith("Z")
    # Unchanged while resting.
    g.tick()
    assert g.status["history"] == history


def test_rolled_back_and_aborted_versions_never_enter_history() -> None:
    g = Gate(V1)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    g.tick(canary=healthy(errors=50), stable=healthy(1000))
    assert g.until(Phase.ROLLED_BACK).stable.version == v(V1)
    g.edit(V3)
    g.until(Phase.PROGRESSING)
    g.tick(annotations={ABORT_ANNOTATION: "x"})
    g.until(Phase.ABORTED)
    assert [r["version"] for r in g.status["history"]] == [v(V1)]


def test_undo_promotes_an_old_version_under_a_new_revision_and_history_is_bounded() -> None:
    g = Gate(V1)
    g.tick()
    g.edit(V2)
    g.promote_through()
    g.edit(dict(g.status["history"][0]["params"]))  # what `kubectl sparsegate undo` writes
    st = g.promote_through()
    assert st.stable.version == v(V1)
    assert [(r["revision"], r["version"]) for r in g.status["history"]] == [(2, v(V2)), (3, v(V1))]

    history = RolloutStatus.from_status(g.status).history
    for i in range(HISTORY_LIMIT + 5):
        history = record_stable(history, stable=GateVersion.from_params({**V1, "entropyBeta": i / 100}),
                                now=float(i), reason="Promoted")
    assert len(history) == HISTORY_LIMIT
    assert [r.revision for r in history] == list(range(9, 9 + HISTORY_LIMIT))


def test_history_round_trips_and_ignores_malformed_entries() -> None:
    g = Gate(V1)
    g.tick()
    raw = {**g.status, "history": [*g.status["history"], {"version": "g-bad"}, {"revision": "x"}]}
    st = RolloutStatus.from_status(raw)
    assert [r.gate.version for r in st.history] == [v(V1)]
    assert st.to_status(steps=(5, 20, 100))["history"] == g.status["history"]


# ---------------------------------------------------------------- one-shot requests


NO_REQUESTS = {"abort": False, "promote": False, "promote_step": False, "promote_refused": False, "retry": False}


def test_annotation_requests() -> None:
    assert annotation_requests(None) == NO_REQUESTS
    assert annotation_requests({PROMOTE_ANNOTATION: "now"})["promote"] is True  # the documented form
    assert annotation_requests({PROMOTE_ANNOTATION: PROMOTE_STEP_VALUE}) == {**NO_REQUESTS, "promote_step": True}
    assert annotation_requests({RETRY_ANNOTATION: "", ABORT_ANNOTATION: "x"}) == {
        **NO_REQUESTS, "abort": True, "retry": True}


def test_a_step_promote_typed_loosely_is_still_one_step() -> None:
    """A full promote skips every remaining analysis: "Step", "STEP" or a YAML block value
    ("step\\n") must not be read as that."""
    for value in ("Step", "STEP", " step", "step\n", "step-2"):
        assert annotation_requests({PROMOTE_ANNOTATION: value}) == {**NO_REQUESTS, "promote_step": True}, value
    for value in ("now", "full", "all", "Full", " now\n", "now-g-1234", "full-2026-12-07"):
        assert annotation_requests({PROMOTE_ANNOTATION: value}) == {**NO_REQUESTS, "promote": True}, value


def test_a_promote_value_not_accepted_is_refused_not_a_full_promote() -> None:
    """A GitOps `promote: "false"` (or "no", "", a typo) once promoted to every instance, skipping
    every remaining analysis. Such a value is refused: the rollout goes on being analysed, the
    annotation is cleared (answered) and a Warning Event names the value and the accepted ones."""
    for value in ("false", "False", "no", "", "0", "steps", "nope", "fully", "-now"):
        assert annotation_requests({PROMOTE_ANNOTATION: value}) == {**NO_REQUESTS, "promote_refused": True}, value
        g = Gate(V1, pods=10)
        g.tick()
        g.edit(V2)
        before = g.until(Phase.ANALYSING)
        g.actions.clear()
        st = g.tick(annotations={PROMOTE_ANNOTATION: value})
        assert (st.phase, st.step, st.promote) == (Phase.ANALYSING, before.step, False), value
        assert st.stable.version == v(V1) and sum(ver == v(V2) for ver in g.pods.values()) == 1, value
        assert ClearAnnotation(PROMOTE_ANNOTATION) in g.actions, value
        warnings = [a for a in g.actions if isinstance(a, EmitEvent) and a.reason == "PromoteRefused"]
        assert len(warnings) == 1 and warnings[0].type == "Warning", (value, g.actions)
        assert f"{PROMOTE_ANNOTATION}={value!r} refused" in warnings[0].message
        assert "'step'" in warnings[0].message and "'full'" in warnings[0].message
        # Its clear not seen yet (the status names it consumed): cleared again, not warned again.
        g.actions.clear()
        g.tick(annotations={PROMOTE_ANNOTATION: value})
        assert ClearAnnotation(PROMOTE_ANNOTATION) in g.actions
        assert not any(isinstance(a, EmitEvent) and a.reason == "PromoteRefused" for a in g.actions), value
        # The step is still judged: a passing window moves it on as usual, not to 100 %.
        assert g.tick(dt=11, canary=healthy(), stable=healthy(1000)).step == before.step + 1


def test_a_refused_promote_held_in_git_is_warned_once_per_value_and_left_in_place() -> None:
    g = Gate(V1, pods=10)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    held, declared = {PROMOTE_ANNOTATION: "false"}, frozenset({PROMOTE_ANNOTATION})
    g.actions.clear()
    for _ in range(3):
        st = g.tick(annotations=held, declared=declared)
        assert st.phase == Phase.ANALYSING and st.step == 0 and st.stable.version == v(V1)
    assert ClearAnnotation(PROMOTE_ANNOTATION) not in g.actions
    assert sum(isinstance(a, EmitEvent) and a.reason == "PromoteRefused" for a in g.actions) == 1
    assert g.status["rollout"]["handledRequests"] == held
    # Git changed to an accepted value: a new request, acted on.
    assert g.tick(annotations={PROMOTE_ANNOTATION: "full-1"}, declared=declared).promote


def test_declared_requests_are_those_an_applier_owns() -> None:
    """kubectl's last-applied copy (Argo CD's default sync) or a server-side apply's managedFields
    (Flux, Argo CD ServerSideApply) name the request annotations Git holds; kubectl annotate's do not."""
    last = '{"metadata":{"annotations":{"sparsegate.dev/abort":"1","other":"x"}}}'
    assert declared_requests({"annotations": {"kubectl.kubernetes.io/last-applied-configuration": last,
                                              ABORT_ANNOTATION: "1"}}) == {ABORT_ANNOTATION}
    ssa = {"manager": "kustomize-controller", "operation": "Apply", "fieldsV1": {"f:metadata": {"f:annotations": {
        f"f:{PROMOTE_ANNOTATION}": {}, "f:other": {}}}}}
    annotate = {"manager": "kubectl-annotate", "operation": "Update", "fieldsV1": {"f:metadata": {"f:annotations": {
        f"f:{RETRY_ANNOTATION}": {}}}}}
    assert declared_requests({"managedFields": [ssa, annotate]}) == {PROMOTE_ANNOTATION}
    for junk in (None, {}, {"annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{"}},
                 {"annotations": {"kubectl.kubernetes.io/last-applied-configuration": "[1]"}},
                 {"managedFields": [None, {"operation": "Apply", "fieldsV1": {"f:metadata": []}}]}):
        assert declared_requests(junk) == frozenset()


def test_a_retry_held_in_git_retries_once_per_value() -> None:
    """Argo CD self-heal puts a cleared retry back: a version that fails again was retried again and
    again. Declared by an applier, the request acts once per value and stays (no clear)."""
    g = Gate(V1, pods=10)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    g.tick(dt=11, canary=healthy(errors=50), stable=healthy(1000))
    g.until(Phase.ROLLED_BACK)
    retry, declared = {RETRY_ANNOTATION: "1"}, frozenset({RETRY_ANNOTATION})
    g.actions.clear()
    assert g.tick(annotations=retry, declared=declared).phase != Phase.ROLLED_BACK
    assert ClearAnnotation(RETRY_ANNOTATION) not in g.actions
    g.until(Phase.ANALYSING, annotations=retry, declared=declared)
    g.tick(dt=11, canary=healthy(errors=50), stable=healthy(1000), annotations=retry, declared=declared)
    g.until(Phase.ROLLED_BACK, annotations=retry, declared=declared)
    for _ in range(5):
        assert g.tick(annotations=retry, declared=declared).phase == Phase.ROLLED_BACK, "retried again"
    assert g.status["rollout"]["handledRequests"] == retry
    # A new value is a new request.
    assert g.tick(annotations={RETRY_ANNOTATION: "2"}, declared=declared).phase != Phase.ROLLED_BACK


def test_step_promote_skips_one_analysis_and_the_next_step_is_analysed() -> None:
    g = Gate(V1)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    st = g.tick(annotations={PROMOTE_ANNOTATION: PROMOTE_STEP_VALUE})
    assert ClearAnnotation(PROMOTE_ANNOTATION) in g.actions
    assert st.step == 1 and st.step_percent == 20 and not st.promote
    assert sum(1 for ver in g.pods.values() if ver == v(V2)) == 4
    st = g.until(Phase.ANALYSING)
    assert st.step == 1  # judged as usual: no promotion without a passing window
    g.tick(annotations={PROMOTE_ANNOTATION: PROMOTE_STEP_VALUE})
    assert g.until(Phase.ANALYSING).step == 2
    # At the last step a step promote is a full promote (every pod already runs it: at once).
    st = g.tick(annotations={PROMOTE_ANNOTATION: PROMOTE_STEP_VALUE})
    assert st.phase == Phase.SUCCEEDED and st.stable.version == v(V2) and st.reason == "Promoted"


def test_step_promote_while_paused_moves_the_held_step_and_stays_paused() -> None:
    g = Gate(V1)
    g.tick()
    g.edit(V2, paused=True)
    assert g.tick().phase == Phase.PAUSED
    st = g.tick(annotations={PROMOTE_ANNOTATION: PROMOTE_STEP_VALUE})
    assert st.phase == Phase.PAUSED and st.step == 1
    assert all(ver == v(V1) for ver in g.pods.values())  # nothing pushed while paused


def test_retry_reruns_the_rejected_version_from_step_one() -> None:
    g = Gate(V1)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    g.tick(canary=healthy(errors=50), stable=healthy(1000))
    g.until(Phase.ROLLED_BACK)
    assert g.tick().phase == Phase.ROLLED_BACK  # not retried on its own
    st = g.tick(annotations={RETRY_ANNOTATION: "now"})
    assert ClearAnnotation(RETRY_ANNOTATION) in g.actions
    assert st.phase == Phase.PROGRESSING and st.step == 0 and st.reason == "Retried"
    assert st.canary.version == v(V2) and st.rejected_version is None
    assert g.promote_through().stable.version == v(V2)


def test_retry_is_ignored_when_nothing_was_rejected() -> None:
    g = Gate(V1)
    g.tick()
    before = g.tick().phase
    assert g.tick(annotations={RETRY_ANNOTATION: "x"}).phase == before == Phase.SUCCEEDED
    assert ClearAnnotation(RETRY_ANNOTATION) in g.actions  # consumed all the same


def test_retry_after_failed_analysis_with_auto_rollback_off_reanalyses_the_step() -> None:
    g = Gate(V1, autoRollback=False)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    assert g.tick(canary=healthy(errors=50), stable=healthy(1000)).phase == Phase.FAILED
    st = g.tick(annotations={RETRY_ANNOTATION: "x"})
    assert st.phase == Phase.ANALYSING and st.step == 0  # pods already run it: straight to analysis


# ---------------------------------------------------------------- kstatus, GateConfig


def test_kstatus_follows_a_rollout_through_every_phase() -> None:
    g = Gate(V1)
    g.tick()
    assert g.kstatus() == CURRENT
    g.edit(V2)
    assert g.kstatus() == IN_PROGRESS  # generation not yet observed
    seen = set()
    st = g.tick()
    while st.phase != Phase.SUCCEEDED:
        assert g.kstatus() == IN_PROGRESS, st.phase
        assert g.conditions()["Reconciling"]["status"] == "True"
        seen.add(st.phase)
        st = g.tick(dt=11, canary=healthy(), stable=healthy(1000))
    assert {Phase.PROGRESSING, Phase.ANALYSING} <= seen
    assert g.kstatus() == CURRENT and g.conditions()["Ready"]["status"] == "True"


def test_kstatus_after_rollback_is_failed_until_the_spec_changes() -> None:
    g = Gate(V1)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    g.tick(canary=healthy(errors=50), stable=healthy(1000))
    assert g.kstatus() == IN_PROGRESS  # RollingBack: Reconciling
    g.until(Phase.ROLLED_BACK)
    # The spec still asks for the rejected version: never Current.
    assert g.kstatus() == FAILED
    stalled = g.conditions()["Stalled"]
    assert stalled["reason"] == "AnalysisFailed" and v(V2) in stalled["message"]
    # Spec reverted to the stable version: Current again (the phase stays RolledBack).
    g.edit(V1)
    st = g.tick()
    assert st.phase == Phase.ROLLED_BACK and g.kstatus() == CURRENT


def test_kstatus_after_abort_is_failed_and_retry_makes_it_progress() -> None:
    g = Gate(V1)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    g.tick(annotations={ABORT_ANNOTATION: "x"})
    g.until(Phase.ABORTED)
    assert g.kstatus() == FAILED
    g.tick(annotations={RETRY_ANNOTATION: "x"})
    assert g.kstatus() == IN_PROGRESS


def test_kstatus_paused_is_in_progress_not_reconciling() -> None:
    g = Gate(V1)
    g.tick()
    g.edit(V2, paused=True)
    assert g.tick().phase == Phase.PAUSED
    cond = g.conditions()
    assert g.kstatus() == IN_PROGRESS
    assert (cond["Ready"]["status"], cond["Reconciling"]["status"], cond["Stalled"]["status"]) == (
        "False", "False", "False")
    assert cond["Ready"]["reason"] == "Paused"


def test_kstatus_invalid_spec_and_auto_rollback_off_are_failed() -> None:
    g = Gate(V1)
    g.tick()
    g.edit(**{"steps": [5, 50]})
    assert g.tick().phase == Phase.FAILED and g.kstatus() == FAILED
    g.edit(**{"steps": [5, 20, 100]})
    assert g.tick().phase == Phase.SUCCEEDED and g.kstatus() == CURRENT

    g = Gate(V1, autoRollback=False)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    g.tick(canary=healthy(errors=50), stable=healthy(1000))
    assert g.kstatus() == FAILED and g.conditions()["Stalled"]["reason"] == "AnalysisFailed"


def test_reconciling_and_stalled_are_never_both_true() -> None:
    # kstatus takes the first of the two in list order; both True would make the answer depend on it.
    for status in (RolloutStatus(phase=p, rejected_version="g-x") for p in Phase):
        st = RolloutStatus.from_status(status.to_status(steps=(100,)))
        for target in (None, "g-x", "g-y"):
            cond = {c["type"]: c["status"] for c in kstatus_conditions(status=st, target_version=target)}
            assert not (cond["Reconciling"] == "True" and cond["Stalled"] == "True"), (st.phase, target)
            assert not (cond["Ready"] == "True" and "True" in (cond["Reconciling"], cond["Stalled"]))


# ---------------------------------------------------------------- kstatus, SparseModel and RoutingPolicy


def _model(status: dict[str, Any] | None = None, generation: int = 3) -> dict[str, Any]:
    return {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel",
            "metadata": {"name": "m", "generation": generation}, "spec": {"replicas": 2},
            "status": status or {}}


def _deployment(ready: int, updated: int, replicas: int = 2) -> dict[str, Any]:
    return {"metadata": {"generation": 1},
            "status": {"observedGeneration": 1, "readyReplicas": ready, "updatedReplicas": updated,
                       "replicas": replicas}}


GATE_OK = GateResolution(document=None, source="default", error=None)
NOW = "2026-01-01T00:00:00Z"


def test_sparsemodel_kstatus_rolling_ready_and_stalled() -> None:
    rolling = model_status.after_reconcile(model=_model(), generation=3, gate=GATE_OK,
                                           deployment=_deployment(0, 0), apply_error=None, now=NOW)
    assert kstatus_port.compute(_model(rolling))[0] == IN_PROGRESS
    assert {c["type"]: c["status"] for c in rolling["conditions"]}["Reconciling"] == "True"
    assert all(c["observedGeneration"] == 3 for c in rolling["conditions"])

    ready = model_status.after_deployment_event(model=_model(rolling), deployment=_deployment(2, 2), now=NOW)
    merged = {**rolling, **ready}
    assert kstatus_port.compute(_model(merged)) == (CURRENT, "Resource is Ready")

    missing = GateResolution(document=None, source="missing", error="GateConfig ns/g not found")
    stalled = model_status.after_reconcile(model=_model(merged), generation=3, gate=missing,
                                           deployment=_deployment(2, 2), apply_error=None, now=NOW)
    assert kstatus_port.compute(_model(stalled)) == (FAILED, "GateConfig ns/g not found")
    # The Deployment watcher does not clear Stalled (only the reconcile decides Degraded) and
    # does not call a stalled model Reconciling.
    later = model_status.after_deployment_event(model=_model(stalled), deployment=_deployment(1, 2), now=NOW)
    assert later is not None
    assert kstatus_port.compute(_model({**stalled, **later}))[0] == FAILED
    assert {c["type"]: c["status"] for c in later["conditions"]}["Reconciling"] == "False"
    # A newer spec not rendered yet reads InProgress whatever the conditions say.
    assert kstatus_port.compute(_model(merged, generation=4))[0] == IN_PROGRESS


def test_sparsemodel_kstatus_is_in_progress_while_a_failed_apply_is_retried_failed_when_refused() -> None:
    """An apply the API server failed in passing (5xx, 429, 409 conflict, no answer in time) is
    retried by the operator: kstatus (Flux) reads InProgress, not Failed, whether the Deployment of
    the previous spec is ready or not, and the Deployment watcher keeps it so. A refusal that needs a
    person (422 invalid, 403 forbidden, someone else's object of the name) stays Failed."""
    for error in ("503 Service Unavailable: etcdserver: leader changed",
                  "500 Internal Server Error: Internal error occurred: resource quota evaluation timed out",
                  "429 Too Many Requests: the server has received too many requests",
                  "409 Conflict: Operation cannot be fulfilled: the object has been modified",
                  "504 Gateway Timeout: the server was unable to return a response in the time allotted",
                  "ReadTimeoutError: HTTPSConnectionPool(host='10.96.0.1', port=443): Read timed out.",
                  "MaxRetryError: HTTPSConnectionPool(host='10.96.0.1', port=443): Max retries exceeded"):
        for ready in (0, 2):
            st = model_status.after_reconcile(model=_model(), generation=3, gate=GATE_OK,
                                              deployment=_deployment(ready, ready), apply_error=error, now=NOW)
            conds = {c["type"]: c for c in st["conditions"]}
            assert kstatus_port.compute(_model(st))[0] == IN_PROGRESS, (error, ready)
            assert (conds["Stalled"]["status"], conds["Reconciling"]["status"]) == ("False", "True"), (error, ready)
            assert conds["Reconciling"]["reason"] == "ApplyRetrying" and conds["Reconciling"]["message"] == error
            assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "ApplyRetrying")
            later = model_status.after_deployment_event(model=_model(st), deployment=_deployment(1, 2), now=NOW)
            merged = {**st, **(later or {})}
            assert kstatus_port.compute(_model(merged))[0] == IN_PROGRESS, (error, ready)
    for error in ("422 Unprocessable Entity: Deployment.apps \"m\" is invalid",
                  "403 Forbidden: deployments.apps \"m\" is forbidden: exceeded quota",
                  "409 AlreadyExists: Service m already exists and is not this model's"):
        st = model_status.after_reconcile(model=_model(), generation=3, gate=GATE_OK,
                                          deployment=_deployment(2, 2), apply_error=error, now=NOW)
        assert kstatus_port.compute(_model(st)) == (FAILED, error)
        assert {c["type"]: c["reason"] for c in st["conditions"]}["Stalled"] == "ApplyFailed"


def test_sparsemodel_kstatus_is_failed_while_pods_cannot_run_or_the_deployment_is_past_its_deadline() -> None:
    """kstatus computes Failed for a Deployment past its progress deadline and for a pod in a
    crash loop; a model whose pods cannot run reads Failed too, so Flux stops waiting."""
    rolling = model_status.after_reconcile(model=_model(), generation=3, gate=GATE_OK,
                                           deployment=_deployment(0, 2), apply_error=None, now=NOW)
    assert kstatus_port.compute(_model(rolling))[0] == IN_PROGRESS
    crash = "m-abc/server: CrashLoopBackOff: back-off 10s restarting failed container"
    failing = {**rolling, **model_status.after_deployment_event(model=_model(rolling), deployment=_deployment(0, 2),
                                                               now=NOW, problems=[crash])}
    assert kstatus_port.compute(_model(failing)) == (FAILED, f"0/2 ready, 2 updated; {crash}")
    deadline = _deployment(1, 2)
    deadline["status"]["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                         "message": 'ReplicaSet "m-7d9f" has timed out progressing.'}]
    past = {**failing, **model_status.after_deployment_event(model=_model(failing), deployment=deadline, now=NOW)}
    assert kstatus_port.compute(_model(past)) == (FAILED, '1/2 ready, 2 updated; ReplicaSet "m-7d9f" has timed out progressing.')
    recovered = {**past, **model_status.after_deployment_event(model=_model(past), deployment=_deployment(2, 2), now=NOW)}
    assert kstatus_port.compute(_model(recovered)) == (CURRENT, "Resource is Ready")


def test_routingpolicy_kstatus() -> None:
    def rp(outcome: policy_status.SyncOutcome, previous: dict[str, Any] | None = None) -> dict[str, Any]:
        status = policy_status.status_patch(outcome=outcome, previous=previous, now=NOW)
        return {"kind": "RoutingPolicy", "metadata": {"generation": 2}, "status": status}

    loading = rp(policy_status.SyncOutcome(generation=2, loaded_generation=1, decision_count=None, revision="r1"))
    assert kstatus_port.compute(loading)[0] == IN_PROGRESS
    loaded = rp(policy_status.SyncOutcome(generation=2, loaded_generation=2, decision_count=3, revision="r2"))
    assert kstatus_port.compute(loaded) == (CURRENT, "Resource is Ready")
    down = rp(policy_status.SyncOutcome(generation=2, loaded_generation=None, decision_count=None, revision=None,
                                        error="connection refused"), previous=loaded["status"])
    assert kstatus_port.compute(down)[0] == IN_PROGRESS  # retried on its own
    refused = rp(policy_status.SyncOutcome(generation=2, loaded_generation=None, decision_count=None, revision=None,
                                           error="rego_parse_error", rejected=True))
    assert kstatus_port.compute(refused) == (FAILED, "rego_parse_error")
    assert all(c["observedGeneration"] == 2 for c in refused["status"]["conditions"])


def test_a_time_a_hand_edit_made_unreadable_reads_as_missing_and_the_rollout_goes_on() -> None:
    """status.rollout keeps unknown fields and history[].promotedAt is free text: "yesterday" or a
    number there raised ValueError on every tick (and in every plugin command reading the status)."""
    assert epoch_time("2026-12-07T06:00:00Z") == 1796623200.0
    assert epoch_time("2026-12-07T06:00:00") == epoch_time("2026-12-07T06:00:00Z")  # written with Z: UTC
    for bad in ("yesterday", "2026-13-40T00:00:00Z", 42, [], {"a": 1}, None, ""):
        assert epoch_time(bad) is None
    g = Gate(V1)
    g.tick()
    g.edit(V2)
    g.tick()
    g.status["history"][0]["promotedAt"] = "yesterday"
    g.status["rollout"]["stepStartedAt"] = 42
    g.promote_through()
    assert g.status["stable"]["version"] == v(V2)
