"""The rollout state machine, driven tick by tick against a simulated fleet.

The fleet stands in for the pods at our own boundary (observations in, PushGate
actions out): the real admin endpoint and /healthz are exercised by the e2e tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import pytest
from sparsegate_workload import gateparams

from sparsegate.domain.analysis import GroupMetrics
from sparsegate.domain.rollout import (
    ABORT_ANNOTATION,
    PROMOTE_ANNOTATION,
    ClearAnnotation,
    EmitEvent,
    GateVersion,
    Observations,
    Phase,
    PodObservation,
    PushGate,
    RecordOutcome,
    RecordStep,
    RolloutStatus,
    SpecError,
    canary_gate,
    desired_versions,
    instances_for,
    invalid_spec,
    next_action,
    parse_spec,
    select_canary_pods,
)

V1 = {"toolGateThreshold": 0.85, "entropyBeta": 0.1}
V2 = {"toolGateThreshold": 0.8, "entropyBeta": 0.1}
V3 = {"toolGateThreshold": 0.75, "entropyBeta": 0.1}


def spec(params: dict, **rollout: object) -> dict:
    return {"params": params, "rollout": {"analysisInterval": "10s", "minRequests": 20, "strategy": "instances",
                                          **rollout}}


def healthy(requests: float = 100, errors: float = 0, latency_s: float = 0.05, experts: float = 1.3) -> GroupMetrics:
    buckets = {0.1: requests if latency_s <= 0.1 else 0.0, 1.0: requests if latency_s <= 1 else 0.0, 2.5: requests,
               math.inf: requests}
    return GroupMetrics(pods=1, seconds=10, requests=requests, errors=errors, duration_buckets=buckets,
                        mean_active_experts=experts)


@dataclass
class Fleet:
    """Pods that apply pushed gates (unless unreachable) and report them as /healthz would."""

    versions: dict[str, str]
    unreachable: set[str] = field(default_factory=set)
    pushes: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def of(cls, n: int, version: str) -> Fleet:
        return cls(versions={f"m-{i:02d}": version for i in range(n)})

    def observe(self) -> tuple[PodObservation, ...]:
        return tuple(
            PodObservation(name=n, reachable=n not in self.unreachable, version=None if n in self.unreachable else v)
            for n, v in sorted(self.versions.items())
        )

    def apply(self, actions: Iterable[object]) -> None:
        for a in actions:
            if isinstance(a, PushGate) and a.pod not in self.unreachable:
                self.versions[a.pod] = a.gate.version
                self.pushes.append((a.pod, a.gate.version))

    def count(self, version: str) -> int:
        return sum(1 for v in self.versions.values() if v == version)


class Driver:
    """Runs next_action tick by tick, applying pushes, as the handler does."""

    def __init__(self, fleet: Fleet, raw_spec: dict, *, now: float = 1000.0) -> None:
        self.fleet, self.raw_spec, self.now = fleet, raw_spec, now
        self.status = RolloutStatus()
        self.actions: list[object] = []

    def tick(self, *, dt: float = 1.0, canary: GroupMetrics | None = None, stable: GroupMetrics | None = None,
             abort: bool = False, promote: bool = False, models: int = 0) -> RolloutStatus:
        self.now += dt
        obs = Observations(pods=self.fleet.observe(), abort=abort, promote=promote, canary_metrics=canary,
                           stable_metrics=stable, fleet_qps=20.0, stable_error_rate=0.0, models=models)
        d = next_action(spec=parse_spec(self.raw_spec), status=self.status, obs=obs, now=self.now)
        # The handler persists status (round trip through the status dict) before acting.
        self.status = RolloutStatus.from_status(d.status.to_status(steps=parse_spec(self.raw_spec).steps))
        self.fleet.apply(d.actions)
        self.actions += d.actions
        return self.status

    def until(self, phase: Phase, *, limit: int = 50, **kw: object) -> RolloutStatus:
        for _ in range(limit):
            if self.tick(**kw).phase == phase:
                return self.status
        raise AssertionError(f"never reached {phase}: {self.status.phase} {self.status.message}")

    def events(self) -> list[str]:
        return [a.reason for a in self.actions if isinstance(a, EmitEvent)]


def v(params: dict) -> str:
    return GateVersion.from_params(params).version


def started(n: int = 20, **rollout: object) -> Driver:
    d = Driver(Fleet.of(n, v(V1)), spec(V1, **rollout))
    assert d.tick().phase == Phase.SUCCEEDED
    d.raw_spec = spec(V2, **rollout)
    return d


# ---------------------------------------------------------------- helpers


def test_version_is_content_addressed() -> None:
    g = GateVersion.from_params({"entropyBeta": 0.2, "toolGateThreshold": 0.8})
    assert g == GateVersion.from_params({"toolGateThreshold": 0.8, "entropyBeta": 0.2})
    # Same rules as the model server and the rendered ConfigMap.
    assert g.version == gateparams.version_of(g.params) and g.checksum == gateparams.checksum_of(g.params)
    with pytest.raises(SpecError, match="unknown gate params"):
        parse_spec({"params": {"bogus": 1}})
    assert g.version.startswith("g-") and len(g.version) == 14
    assert g.checksum.startswith("sha256:") and g.checksum[7:19] == g.version[2:]


@pytest.mark.parametrize(("percent", "total", "n"), [(5, 20, 1), (20, 20, 4), (100, 20, 20), (5, 3, 1), (50, 3, 2), (5, 0, 0)])
def test_instances_for(percent: int, total: int, n: int) -> None:
    assert instances_for(percent=percent, total=total) == n


def test_selection_is_deterministic_and_sticky() -> None:
    pods = Fleet.of(20, "a").observe()
    first = select_canary_pods(pods=pods, percent=5, previous=(), canary_version="b")
    assert first == ("m-00",)
    assert select_canary_pods(pods=tuple(reversed(pods)), percent=5, previous=(), canary_version="b") == first
    grown = select_canary_pods(pods=pods, percent=20, previous=("m-07",), canary_version="b")
    assert "m-07" in grown and len(grown) == 4
    # A pod already running the canary (e.g. pushed before a crash) is preferred.
    running = tuple(replace(p, version="b") if p.name == "m-13" else p for p in pods)
    assert select_canary_pods(pods=running, percent=5, previous=(), canary_version="b") == ("m-13",)


def test_parse_spec_defaults_and_errors() -> None:
    s = parse_spec({"params": V1})
    assert s.steps == (5, 20, 100) and s.sla_p99_ms == 800 and s.analysis_interval_s == 30 and s.auto_rollback
    for bad in ([5, 20], [20, 5, 100], [0, 100], ["x", 100]):
        with pytest.raises(SpecError):
            parse_spec({"params": V1, "rollout": {"steps": bad}})
    with pytest.raises(SpecError):
        parse_spec({"params": V1, "rollout": {"analysisInterval": "soon"}})


# ---------------------------------------------------------------- flows


def test_first_reconcile_records_stable_without_pushing() -> None:
    d = Driver(Fleet.of(20, v(V1)), spec(V1))
    st = d.tick()
    assert st.phase == Phase.SUCCEEDED and st.stable.version == v(V1) and st.reason == "Initialized"
    assert d.fleet.pushes == []


def test_good_change_goes_5_20_100_and_succeeds() -> None:
    d = started()
    st = d.tick()
    assert st.phase == Phase.PROGRESSING and st.step == 0 and st.step_percent == 5
    assert d.fleet.count(v(V2)) == 1 and st.canary_pods == ("m-00",)
    st = d.tick()
    assert st.phase == Phase.ANALYSING
    # The window (10 s) must elapse with passing analysis before the step is promoted.
    st = d.tick(dt=5, canary=healthy(), stable=healthy(1000))
    assert st.phase == Phase.ANALYSING and st.last_analysis["verdict"] == "Pass"
    st = d.tick(dt=6, canary=healthy(), stable=healthy(1000))
    assert st.phase == Phase.PROGRESSING and st.step == 1 and st.step_percent == 20
    assert d.fleet.count(v(V2)) == 4 and "m-00" in st.canary_pods
    d.until(Phase.ANALYSING)
    st = d.tick(dt=11, canary=healthy(), stable=healthy(1000))
    assert st.step == 2 and d.fleet.count(v(V2)) == 20
    d.until(Phase.ANALYSING)
    st = d.tick(dt=11, canary=healthy(2000), stable=None)
    assert st.phase == Phase.SUCCEEDED and st.reason == "Promoted"
    assert st.stable.version == v(V2) and st.canary is None
    assert RecordOutcome("succeeded") in d.actions
    assert [a.percent for a in d.actions if isinstance(a, RecordStep)] == [5, 20, 100]
    assert d.events() == ["Initialized", "RolloutStarted", "StepPromoted", "StepPromoted", "Promoted"]
    assert st.pod_versions == {p: v(V2) for p in d.fleet.versions}


def test_failing_analysis_rolls_back_at_first_step_with_reason_and_numbers() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    st = d.tick(canary=healthy(errors=50), stable=healthy(1000))
    assert st.phase == Phase.ROLLING_BACK and st.reason == "AnalysisFailed"
    assert "errorRate 0.5 > 0.02" in st.message
    assert d.fleet.count(v(V1)) == 20  # the push back happened in the same tick
    st = d.tick()
    assert st.phase == Phase.ROLLED_BACK and st.stable.version == v(V1) and st.rejected_version == v(V2)
    assert RecordOutcome("rolled_back") in d.actions
    cond = {c["type"]: c for c in st.conditions}
    assert cond["Degraded"]["status"] == "True" and "errorRate" in cond["Degraded"]["message"]
    # The rejected version is not retried while the spec still asks for it.
    pushes = len(d.fleet.pushes)
    assert d.tick().phase == Phase.ROLLED_BACK and len(d.fleet.pushes) == pushes
    # A new version starts a fresh rollout.
    d.raw_spec = spec(V3)
    assert d.tick().phase == Phase.PROGRESSING


def test_a_rejection_is_forgotten_once_the_spec_names_another_version() -> None:
    """V2 rolled back, then V3 promoted, then the spec names V2 again: a new request, rolled out
    (the rejection held only while the spec still asked for V2; it once outlived V3 and left the
    spec ignored while Ready said the spec's version was served)."""
    d = started()
    d.until(Phase.ANALYSING)
    d.tick(canary=healthy(errors=50), stable=healthy(1000))
    assert d.until(Phase.ROLLED_BACK).rejected_version == v(V2)
    d.raw_spec = spec(V3)
    st = d.tick()
    assert st.phase == Phase.PROGRESSING and st.rejected_version is None
    st = d.until(Phase.SUCCEEDED, promote=True)
    assert st.stable.version == v(V3) and d.fleet.count(v(V3)) == 20
    d.raw_spec = spec(V2)
    st = d.tick()
    assert st.phase == Phase.PROGRESSING and st.canary.version == v(V2) and d.fleet.count(v(V2)) == 1


def test_a_stale_rejection_left_by_an_older_operator_does_not_hold_the_spec() -> None:
    """A status written before rejections were forgotten: Succeeded on V3 with V2 still recorded as
    rejected. The spec naming V2 is ticked (not resting) and rolled out."""
    from sparsegate.controllers.rollout import RolloutLoop

    d = Driver(Fleet.of(20, v(V3)), spec(V2))
    d.status = replace(RolloutStatus(), phase=Phase.SUCCEEDED, stable=GateVersion.from_params(V3),
                       rejected_version=v(V2))
    body = {"metadata": {"generation": 3}, "spec": spec(V2),
            "status": {**d.status.to_status(steps=(5, 20, 100)), "observedGeneration": 3}}
    assert not RolloutLoop.resting(body)
    st = d.tick()
    assert st.phase == Phase.PROGRESSING and st.canary.version == v(V2)
    # A rejection the rollout rests on still holds, and rests.
    held = replace(d.status, phase=Phase.ROLLED_BACK, canary=None, step=None, stable=GateVersion.from_params(V3),
                   rejected_version=v(V2))
    assert RolloutLoop.resting({**body, "status": {**held.to_status(steps=(5, 20, 100)), "observedGeneration": 3}})


@pytest.mark.parametrize("strategy", ["instances", "requests"])
def test_steps_edited_mid_step_retarget_the_current_step_and_verify_it_again(strategy: str) -> None:
    """At step 2 of [5, 20, 100] (20 %, analysing), the steps become [5, 50, 100]: step 2 is now 50 %:
    status says so, the canary share follows (10 of 20 instances, or weight 0.5 on every pod), and
    the analysis that judged 20 % starts again."""
    d = started(strategy=strategy)
    d.until(Phase.ANALYSING)
    d.tick(dt=11, canary=healthy(), stable=healthy(1000))
    st = d.until(Phase.ANALYSING)
    assert (st.step, st.step_percent) == (1, 20)
    d.raw_spec = spec(V2, strategy=strategy, steps=[5, 50, 100])
    st = d.tick()
    assert (st.phase, st.step, st.step_percent, st.reason) == (Phase.PROGRESSING, 1, 50, "StepsEdited")
    assert "StepsEdited" in d.events()
    st = d.until(Phase.ANALYSING)
    assert st.step_percent == 50
    if strategy == "instances":
        assert d.fleet.count(v(V2)) == 10
    else:
        target = canary_gate(st)
        assert target is not None and target.weight == 0.5
        assert set(d.fleet.versions.values()) == {target.version}  # every pod holds the 0.5 set


def test_latency_over_sla_rolls_back() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    st = d.tick(canary=healthy(latency_s=2.0), stable=healthy(1000))
    assert st.phase == Phase.ROLLING_BACK and "p99LatencyMs" in st.message
    assert d.fleet.count(v(V1)) == 20 and d.fleet.count(v(V2)) == 0  # every pod back on stable
    st = d.tick()
    assert st.phase == Phase.ROLLED_BACK and st.stable.version == v(V1) and st.rejected_version == v(V2)


def test_auto_rollback_off_leaves_canary_and_fails() -> None:
    d = started(autoRollback=False)
    d.until(Phase.ANALYSING)
    st = d.tick(canary=healthy(errors=50), stable=healthy(1000))
    assert st.phase == Phase.FAILED and d.fleet.count(v(V2)) == 1
    assert d.tick().phase == Phase.FAILED and d.fleet.count(v(V2)) == 1
    st = d.tick(abort=True)
    assert st.phase == Phase.ROLLING_BACK and d.fleet.count(v(V2)) == 0
    assert d.tick().phase == Phase.ABORTED


def test_inconclusive_analysis_keeps_observing() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    st = d.tick(dt=30, canary=healthy(requests=3, errors=3), stable=healthy(1000))
    assert st.phase == Phase.ANALYSING and "inconclusive" in st.message
    st = d.tick(dt=1, canary=healthy(requests=100), stable=healthy(1000))
    assert st.phase == Phase.PROGRESSING and st.step == 1


def test_abort_rolls_back_and_rests_in_aborted() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    d.tick(dt=11, canary=healthy(), stable=healthy(1000))  # now at 20 %
    assert d.fleet.count(v(V2)) == 4
    st = d.tick(abort=True)
    assert st.phase == Phase.ROLLING_BACK and ClearAnnotation(ABORT_ANNOTATION) in d.actions
    assert d.fleet.count(v(V2)) == 0
    st = d.tick()
    assert st.phase == Phase.ABORTED and st.stable.version == v(V1) and st.rejected_version == v(V2)
    assert RecordOutcome("aborted") in d.actions


def test_promote_annotation_goes_to_all_instances_without_analysis() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    st = d.tick(promote=True)
    assert ClearAnnotation(PROMOTE_ANNOTATION) in d.actions
    assert st.step == 2 and d.fleet.count(v(V2)) == 20
    st = d.tick()
    assert st.phase == Phase.SUCCEEDED and st.stable.version == v(V2)


def test_pause_holds_the_step_and_resume_restarts_its_window() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    d.raw_spec = spec(V2, paused=True)
    st = d.tick(dt=100, canary=healthy(), stable=healthy(1000))
    assert st.phase == Phase.PAUSED and st.step == 0
    pushes = len(d.fleet.pushes)
    for _ in range(3):
        assert d.tick(dt=30, canary=healthy(), stable=healthy(1000)).phase == Phase.PAUSED
    assert len(d.fleet.pushes) == pushes
    d.raw_spec = spec(V2, paused=False)
    st = d.tick()
    assert st.phase in (Phase.PROGRESSING, Phase.ANALYSING) and st.step == 0
    st = d.until(Phase.ANALYSING)
    # The window restarts after a resume: a passing result right away does not promote the step.
    st = d.tick(dt=1, canary=healthy(), stable=healthy(1000))
    assert st.phase == Phase.ANALYSING and st.step == 0


def test_new_version_while_paused_waits_paused() -> None:
    d = Driver(Fleet.of(20, v(V1)), spec(V1))
    d.tick()
    d.raw_spec = spec(V2, paused=True)
    st = d.tick()
    assert st.phase == Phase.PAUSED and st.canary.version == v(V2) and d.fleet.pushes == []


def test_newer_spec_mid_rollout_supersedes_from_step_one_keeping_stable() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    d.tick(dt=11, canary=healthy(), stable=healthy(1000))  # 20 %: 4 pods on V2
    before = set(d.status.canary_pods)
    d.raw_spec = spec(V3)
    st = d.tick()
    assert st.reason == "Superseded" and st.step == 0 and st.canary.version == v(V3)
    assert st.stable.version == v(V1)
    # The new canary reuses a previous canary pod; the others go back to stable.
    assert set(st.canary_pods) <= before
    assert d.fleet.count(v(V3)) == 1 and d.fleet.count(v(V2)) == 0 and d.fleet.count(v(V1)) == 19
    assert RecordOutcome("superseded") in d.actions


def test_spec_reverted_to_stable_rolls_canary_back_and_succeeds() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    d.raw_spec = spec(V1)
    st = d.tick()
    assert st.phase == Phase.ROLLING_BACK and st.reason == "Reverted"
    st = d.tick()
    assert st.phase == Phase.SUCCEEDED and st.stable.version == v(V1) and st.rejected_version is None


def test_restart_mid_step_resumes_without_repushing() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    d.tick(dt=11, canary=healthy(), stable=healthy(1000))  # step 2 pushed (4 pods)
    persisted = d.status.to_status(steps=(5, 20, 100))
    pushes = list(d.fleet.pushes)
    # A new operator process: only the persisted status survives.
    d2 = Driver(d.fleet, d.raw_spec, now=d.now)
    d2.status = RolloutStatus.from_status(persisted)
    st = d2.tick()
    assert st.step == 1 and st.stable.version == v(V1) and st.canary.version == v(V2)
    assert d.fleet.pushes == pushes  # nothing pushed again: every pod already reports its version
    assert st.phase == Phase.ANALYSING


def test_crash_between_push_and_persist_is_observed_not_repeated() -> None:
    d = started()
    st = d.tick()  # step 1 pushed
    assert st.phase == Phase.PROGRESSING
    # The operator died after pushing step 2 to 2 of its 4 pods but before persisting anything.
    lost_status = d.status.to_status(steps=(5, 20, 100))
    d.fleet.versions["m-01"] = v(V2)
    d.fleet.versions["m-02"] = v(V2)
    d2 = Driver(d.fleet, d.raw_spec, now=d.now)
    d2.status = RolloutStatus.from_status(lost_status)
    st = d2.tick()
    # Step 1's set is rebuilt around the pods already running V2; the extra ones go back to stable.
    assert st.step == 0 and len(st.canary_pods) == 1
    assert d.fleet.count(v(V2)) == 1


def test_unreachable_canary_pod_hits_progress_deadline_and_rolls_back() -> None:
    d = started(progressDeadline="30s")
    d.fleet.unreachable = {f"m-{i:02d}" for i in range(20)}
    st = d.tick()
    assert st.phase == Phase.PROGRESSING and d.fleet.pushes == []
    st = d.tick(dt=31)
    assert st.phase == Phase.ROLLING_BACK and st.reason == "ProgressDeadlineExceeded"


def test_progress_deadline_counts_from_now_when_the_clock_moved_back_past_the_step_start() -> None:
    """status keeps wall-clock times: a clock stepped back an hour (or a new leader whose clock lags
    the old one's) must not hold a stuck step for the hour plus progressDeadline."""
    d = started(progressDeadline="30s")
    d.fleet.unreachable = {f"m-{i:02d}" for i in range(20)}
    assert d.tick().phase == Phase.PROGRESSING
    st = d.tick(dt=-3600)
    assert st.phase == Phase.PROGRESSING
    st = d.tick(dt=29)
    assert st.phase == Phase.PROGRESSING
    st = d.tick(dt=2)
    assert st.phase == Phase.ROLLING_BACK and st.reason == "ProgressDeadlineExceeded"


def test_no_instances_promotes_directly() -> None:
    d = started(n=0)
    st = d.tick()
    assert st.phase == Phase.SUCCEEDED and st.stable.version == v(V2) and st.reason == "NoInstances"


@pytest.mark.parametrize("strategy", ["instances", "requests"])
def test_pods_gone_mid_step_while_models_remain_wait_instead_of_promoting(strategy: str) -> None:
    # The model's Deployment replaced (or scaled to 0) mid-step: for a tick or more the GateConfig's
    # models have no pods (the old ones going or no longer owned, the new ones not listed yet). The
    # canary was never judged on them: it must not become stable as if no instance used the gate.
    d = started(progressDeadline="30s", strategy=strategy)
    d.until(Phase.ANALYSING, models=1)
    pods = dict(d.fleet.versions)
    d.fleet.versions.clear()
    for _ in range(3):
        st = d.tick(dt=20, models=1)
        assert st.phase == Phase.PROGRESSING and st.stable.version == v(V1) and st.canary.version == v(V2), st
    assert st.reason == "WaitingForInstances" and "Promoted" not in d.events()
    # A step promote meanwhile moves one step on, still waiting (not a full promotion for want of pods).
    stepped = next_action(spec=parse_spec(d.raw_spec), status=st, now=d.now + 1,
                          obs=Observations(pods=(), promote_step=True, models=1)).status
    assert stepped.phase == Phase.PROGRESSING and stepped.step == 1 and stepped.canary_pods
    # New pods come up from the gate ConfigMap (stable): the step goes on with them, its deadline
    # counted from their return (not from the step's start, long past).
    d.fleet.versions.update({f"n-{p}": v(V1) for p in pods})
    st = d.until(Phase.ANALYSING, models=1)
    assert st.stable.version == v(V1) and st.canary.version == v(V2)
    assert d.fleet.count(canary_gate(st).version) >= 1  # the new pods were pushed the step's gate
    # Models gone for good (or never any pods in the step): no instances use it, promoted directly.
    d.fleet.versions.clear()
    d.tick(models=0)
    st = d.tick(models=0)
    assert st.phase == Phase.SUCCEEDED and st.reason == "NoInstances"


def test_instance_lost_during_analysis_reverifies() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    del d.fleet.versions["m-00"]  # the canary pod disappeared
    st = d.tick(canary=healthy(), stable=healthy(1000))
    assert st.phase == Phase.PROGRESSING and st.reason == "Reverifying"
    st = d.tick()
    assert st.phase == Phase.ANALYSING and st.canary_pods == ("m-01",)


def test_invalid_spec_fails_then_recovers() -> None:
    d = started()
    d.tick()
    bad = invalid_spec(status=d.status, error="steps must end at 100", now=d.now)
    assert bad.status.phase == Phase.FAILED and bad.actions[0].reason == "InvalidSpec"
    d.status = bad.status
    st = d.tick()
    assert st.phase in (Phase.PROGRESSING, Phase.ANALYSING) and st.step == 0


def _invalid_then_valid(d: Driver) -> RolloutStatus:
    """The spec made invalid (the handler calls invalid_spec), then valid again: one tick each."""
    bad = invalid_spec(status=d.status, error="steps must end at 100", now=d.now)
    d.status = RolloutStatus.from_status(bad.status.to_status(steps=(100,)))
    assert d.status.phase == Phase.FAILED and d.status.reason == "InvalidSpec"
    return d.tick()


def test_an_invalid_spec_fixed_after_an_abort_keeps_the_abort() -> None:
    """Abort, then a spec invalid for a while and fixed: the rollback goes on and rests in Aborted;
    the aborted version is not pushed again (it once resumed the rollout of it)."""
    d = started()
    d.until(Phase.ANALYSING)
    assert d.tick(abort=True).phase == Phase.ROLLING_BACK
    pushes = [p for p in d.fleet.pushes if p[1] == v(V2)]
    st = _invalid_then_valid(d)
    assert st.phase in (Phase.ROLLING_BACK, Phase.ABORTED) and st.rejected_version == v(V2)
    assert d.until(Phase.ABORTED).rejected_version == v(V2)
    for _ in range(5):
        d.tick()
    assert d.status.phase == Phase.ABORTED and [p for p in d.fleet.pushes if p[1] == v(V2)] == pushes


def test_an_invalid_spec_fixed_after_a_rollback_or_a_failed_analysis_keeps_them() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    d.tick(canary=healthy(errors=50), stable=healthy(1000))
    d.until(Phase.ROLLED_BACK)
    st = _invalid_then_valid(d)
    assert st.phase == Phase.ROLLED_BACK and st.reason == "AnalysisFailed" and st.rejected_version == v(V2)
    assert {c["type"]: c["status"] for c in st.conditions}["Stalled"] == "True"  # still asks for V2
    kept = started(autoRollback=False)
    kept.until(Phase.ANALYSING)
    assert kept.tick(canary=healthy(errors=50), stable=healthy(1000)).phase == Phase.FAILED
    st = _invalid_then_valid(kept)
    assert (st.phase, st.reason) == (Phase.FAILED, "AnalysisFailed")  # not analysed again without a retry


def _hand_edited(d: Driver, *, drop: str, **rollout: object) -> None:
    """d's status as persisted, with `status.rollout.<drop>` removed and other fields overwritten."""
    raw = d.status.to_status(steps=(5, 20, 100))
    raw["rollout"].pop(drop)
    raw["rollout"].update(rollout)
    d.status = RolloutStatus.from_status(raw)


@pytest.mark.parametrize(("phase", "drop", "field_name"), [
    ("Analysing", "canary", "status.rollout.canary"),
    ("Progressing", "canary", "status.rollout.canary"),
    ("Paused", "canary", "status.rollout.canary"),
    ("Analysing", "stepIndex", "status.rollout.stepIndex"),
])
def test_an_in_flight_status_without_its_canary_starts_over_from_stable(phase: str, drop: str,
                                                                        field_name: str) -> None:
    """A hand-edited status (an active phase, no canary or step recorded) once hit an assert: now a
    Warning and a condition name the field, and the rollout starts over from step 1 over stable."""
    d = started()
    d.until(Phase.ANALYSING)
    d.tick(dt=11, canary=healthy(), stable=healthy(1000))  # step 2: 4 pods run V2
    _hand_edited(d, drop=drop, phase=phase, analysisPaused=phase == "Paused")
    st = d.tick()
    warning = [a for a in d.actions if isinstance(a, EmitEvent) and a.reason == "InvalidStatus"]
    assert len(warning) == 1 and warning[0].type == "Warning" and field_name in warning[0].message
    assert st.phase == Phase.PROGRESSING and st.step == 0 and st.canary.version == v(V2)
    assert st.stable.version == v(V1) and d.fleet.count(v(V2)) == 1  # step 1 again; the others back on stable
    ready = {c["type"]: c for c in st.conditions}["Ready"]
    assert ready["reason"] == "InvalidStatus" and field_name in ready["message"]
    d.until(Phase.ANALYSING)
    assert d.tick(dt=11, canary=healthy(), stable=healthy(1000)).step == 1  # and it goes on as usual


def test_an_in_flight_status_without_its_canary_rests_on_stable_when_the_spec_names_it() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    d.raw_spec = spec(V1)
    _hand_edited(d, drop="canary")
    st = d.tick()
    assert st.phase == Phase.SUCCEEDED and st.reason == "InvalidStatus" and "status.rollout.canary" in st.message
    assert d.fleet.count(v(V1)) == 20 and st.canary is None and st.step is None
    assert {c["type"]: c for c in st.conditions}["Progressing"]["reason"] == "InvalidStatus"


def test_a_step_restored_after_an_invalid_spec_without_its_canary_starts_over() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    d.status = invalid_spec(status=d.status, error="steps must end at 100", now=d.now).status
    _hand_edited(d, drop="canary")  # Failed (InvalidSpec), the step it interrupted kept, no canary
    st = d.tick()
    assert "InvalidStatus" in d.events() and st.step == 0 and st.canary.version == v(V2)
    assert st.reason == "InvalidStatus" and "status.rollout.canary" in st.message


def test_a_rollback_without_its_canary_comes_to_rest_and_keeps_the_rejection() -> None:
    """RollingBack needs no canary (every pod goes to stable): it comes to rest where it was headed,
    and an aborted version the spec still names is not rolled out again."""
    d = started()
    d.until(Phase.ANALYSING)
    d.tick(dt=11, canary=healthy(), stable=healthy(1000))
    _hand_edited(d, drop="canary", phase="RollingBack", afterRollback="Aborted", rejectedVersion=v(V2))
    pushed = [p for p in d.fleet.pushes if p[1] == v(V2)]
    st = d.tick()
    assert (st.phase, st.rejected_version) == (Phase.ABORTED, v(V2)) and "status.rollout.canary" in st.message
    assert d.fleet.count(v(V1)) == 20
    for _ in range(3):
        assert d.tick().phase == Phase.ABORTED
    assert [p for p in d.fleet.pushes if p[1] == v(V2)] == pushed


@pytest.mark.parametrize(("edit", "field_name"), [
    ({"stepIndex": "1"}, "status.rollout.stepIndex"),
    ({"stepIndex": 1.5}, "status.rollout.stepIndex"),
    ({"stepIndex": [1]}, "status.rollout.stepIndex"),
    ({"stepIndex": -1}, "status.rollout.stepIndex"),
    ({"canary": "g-fdcabf993e9c"}, "status.rollout.canary"),
    ({"canary": {"version": 7}}, "status.rollout.canary"),
    ({"canaryPods": [["m-00"]]}, None),
    ({"instances": "twenty"}, None),
    ({"calibration": [1, 2]}, None),
    ({"calibration": {"qps": [1, 2]}}, None),
    ({"analysis": "passed"}, None),
    ({"consumedRequests": 1}, None),
])
def test_a_free_form_status_field_of_the_wrong_type_is_reported_not_raised(edit: dict, field_name: str | None) -> None:
    """status.rollout keeps unknown fields (the CRD types only some), so `kubectl edit
    --subresource=status` can store any type in stepIndex, canary, canaryPods, instances, calibration...
    Reading one raised (TypeError, ValueError, AttributeError) on every tick, forever, with no condition;
    a stepIndex of -1 indexed the steps from the end (100 %: the canary pushed to every instance).
    Now such a field reads as missing: a step or canary the phase needs is reported (InvalidStatus) and
    the rollout starts over from step 1; anything else is rebuilt from the pods."""
    d = started()
    d.until(Phase.ANALYSING)
    d.tick(dt=11, canary=healthy(), stable=healthy(1000))  # step 2: 4 pods run V2
    raw = d.status.to_status(steps=(5, 20, 100))
    raw["rollout"].update(edit)
    from sparsegate.controllers.rollout import RolloutLoop

    # The watch handler decides whether the object rests (it raised there too: the loop missed the event).
    assert RolloutLoop.quiet_view({"metadata": {"name": "g", "generation": 1}, "spec": d.raw_spec,
                                   "status": raw})["resting"] is False
    d.status = RolloutStatus.from_status(raw)
    st = d.tick()
    assert d.fleet.count(v(V2)) <= 4 and st.canary.version == v(V2) and st.stable.version == v(V1)
    if field_name is not None:
        assert "InvalidStatus" in d.events() and field_name in st.message and st.step == 0
        assert {c["type"]: c for c in st.conditions}["Ready"]["reason"] == "InvalidStatus"
    else:
        assert "InvalidStatus" not in d.events() and st.step == 1
    d.until(Phase.ANALYSING)
    d.tick(dt=11, canary=healthy(), stable=healthy(1000))
    assert d.status.step in (1, 2)  # and it goes on as usual


def test_a_status_that_lost_its_stable_version_mid_rollout_restores_it_from_history() -> None:
    """status.stable removed by a hand edit while V2 is analysed at step 1: the spec's version (the
    canary) was adopted as stable ("Initialized") and pushed to all 20 instances, unanalysed. The last
    entry of status.history is the stable version: restored, reported, and the rollout goes on."""
    d = started()
    d.until(Phase.ANALYSING)
    raw = d.status.to_status(steps=(5, 20, 100))
    del raw["stable"]
    d.status = RolloutStatus.from_status(raw)
    st = d.tick()
    assert st.stable.version == v(V1) and st.canary.version == v(V2) and st.phase == Phase.ANALYSING
    assert d.fleet.count(v(V2)) == 1 and "InvalidStatus" in d.events() and "Initialized" not in d.events()[2:]
    assert "status.stable is missing" in st.message
    assert {c["type"]: c for c in st.conditions}["Ready"]["reason"] == "InvalidStatus"
    st = d.tick(dt=11, canary=healthy(), stable=healthy(1000))
    assert (st.phase, st.step, st.stable.version) == (Phase.PROGRESSING, 1, v(V1))


def test_an_analysis_window_starting_in_the_future_does_not_hold_the_step_forever() -> None:
    """status.rollout.analysisWindow.from after now (a hand edit, a clock moved back): with a provider
    that names no window of its own (Prometheus; the Driver's observations) the step stayed Analysing
    forever ("analysing -32472142667/10s"). It is ignored, said so, and the step passes its window."""
    d = started()
    d.until(Phase.ANALYSING)
    raw = d.status.to_status(steps=(5, 20, 100))
    raw["rollout"]["analysisWindow"] = {"from": "2999-01-01T00:00:00Z", "samples": 3}
    d.status = RolloutStatus.from_status(raw)
    st = d.tick(dt=1, canary=healthy(), stable=healthy(1000))
    assert st.phase == Phase.ANALYSING and "is in the future: ignored" in st.message
    st = d.tick(dt=11, canary=healthy(), stable=healthy(1000))
    assert (st.phase, st.step) == (Phase.PROGRESSING, 1)


def test_a_promote_flag_that_is_not_true_does_not_promote() -> None:
    """status.rollout.promote is free-form: a hand edit writing the string "false" read as
    bool("false") == True and promoted the canary to every instance, skipping every analysis."""
    d = started()
    d.until(Phase.ANALYSING)
    raw = d.status.to_status(steps=(5, 20, 100))
    raw["rollout"]["promote"] = "false"
    d.status = RolloutStatus.from_status(raw)
    st = d.tick()
    assert not st.promote and d.fleet.count(v(V2)) == 1 and st.phase == Phase.ANALYSING


def test_desired_versions_hold_when_paused() -> None:
    d = started()
    d.tick()
    assert desired_versions(status=replace(d.status, phase=Phase.PAUSED), pods=d.fleet.observe()) == {}


def test_status_round_trip() -> None:
    d = started()
    d.until(Phase.ANALYSING)
    raw = d.status.to_status(steps=(5, 20, 100))
    ro = raw["rollout"]
    assert (ro["phase"], ro["step"], ro["steps"], ro["canaryPercent"]) == ("Analysing", 1, 3, 5)
    assert ro["canaryVersion"] == v(V2) and ro["canaryInstances"] == "1/20"
    assert ro["versionCounts"] == {v(V1): 19, v(V2): 1}
    assert raw["stable"]["version"] == v(V1)
    assert RolloutStatus.from_status(raw) == d.status
