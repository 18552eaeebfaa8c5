"""The rollout state machine with declared analysis checks, and the builtin window after a restart.

Pods stand in at our own boundary as in test_rollout.py (observations in, PushGate out); declared
checks' answers come in as ``Observations.measurements`` only when ``due_checks`` says they are
due, as the handler asks the providers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from sparsegate.domain.analysis import GroupMetrics
from sparsegate.domain.analysis_run import Measured, RunPhase, due_checks
from sparsegate.domain.rollout import (
    EmitEvent,
    GateVersion,
    Observations,
    Phase,
    PodObservation,
    PushGate,
    RolloutStatus,
    SpecError,
    next_action,
    parse_spec,
)

V1 = {"toolGateThreshold": 0.85, "entropyBeta": 0.1}
V2 = {"toolGateThreshold": 0.8, "entropyBeta": 0.1}


def v(params: dict) -> str:
    return GateVersion.from_params(params).version


def prom(name: str = "errors", **fields: object) -> dict:
    return {"name": name, "provider": {"prometheus": {"query": "q", "address": "http://prom:9090"}},
            "successCondition": "result < 0.05", "interval": "5s", **fields}


def web(name: str = "quality", **fields: object) -> dict:
    return {"name": name, "provider": {"web": {"url": "http://judge/score", "jsonPath": "$.score"}},
            "successCondition": "result >= 0.9", "failureCondition": "result < 0.5", "interval": "5s", **fields}


def gc(params: dict, checks: list[dict] | None, **rollout: object) -> dict:
    ro: dict = {"analysisInterval": "10s", "minRequests": 20, "steps": [50, 100], **rollout}
    if checks is not None:
        ro["analysis"] = {"checks": checks}
    return {"params": params, "rollout": ro}


def healthy(requests: float = 100) -> GroupMetrics:
    buckets = {0.1: requests, 1.0: requests, math.inf: requests}
    return GroupMetrics(pods=1, seconds=10, requests=requests, errors=0, duration_buckets=buckets,
                        mean_active_experts=1.3)


@dataclass
class Sim:
    """Four pods, a spec, and per-check answers (a value, None for no data, or an error string)."""

    raw: dict
    answers: dict[str, object] = field(default_factory=dict)
    now: float = 1000.0
    status: RolloutStatus = field(default_factory=RolloutStatus)
    versions: dict[str, str] = field(default_factory=lambda: {f"m-{i}": v(V1) for i in range(4)})
    events: list[EmitEvent] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)

    def tick(self, dt: float = 1.0, *, canary: GroupMetrics | None = None, window_from: float | None = None,
             **flags: bool) -> RolloutStatus:
        self.now += dt
        spec = parse_spec(self.raw)
        run = self.status.analysis_runs[-1] if self.status.analysis_runs else None
        measured = {}
        if self.status.phase == Phase.ANALYSING:
            for c in due_checks(spec.checks, run, now=self.now, default_interval_s=spec.analysis_interval_s):
                self.asked.append(c.name)
                a = self.answers.get(c.name)
                measured[c.name] = Measured(error=a, at=self.now) if isinstance(a, str) else Measured(value=a, at=self.now)
        pods = tuple(PodObservation(name=n, reachable=True, version=ver) for n, ver in sorted(self.versions.items()))
        obs = Observations(pods=pods, measurements=measured, canary_metrics=canary, stable_metrics=healthy(1000)
                           if canary else None, fleet_qps=20.0, stable_error_rate=0.0, window_from=window_from, **flags)
        d = next_action(spec=spec, status=self.status, obs=obs, now=self.now)
        self.status = RolloutStatus.from_status(d.status.to_status(steps=spec.steps))  # persisted round trip
        for a in d.actions:
            if isinstance(a, PushGate):
                self.versions[a.pod] = a.gate.version
            if isinstance(a, EmitEvent):
                self.events.append(a)
        return self.status

    def start(self, params: dict = V2) -> RolloutStatus:
        self.tick()  # initialised on V1
        self.raw = {**self.raw, "params": params}
        self.tick()  # step 1 pushed
        return self.tick()  # pods report it: analysing

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]


def test_declared_checks_decide_each_step_after_count_times_interval() -> None:
    sim = Sim(gc(V1, [prom(count=2), web()]), answers={"errors": 0.01, "quality": 0.95})
    st = sim.start()
    assert st.phase == Phase.ANALYSING and st.step == 0
    (run,) = st.analysis_runs
    assert run.step == 1 and run.percent == 50 and run.phase == RunPhase.RUNNING
    st = sim.tick(4)
    assert st.phase == Phase.ANALYSING and sim.asked == []  # nothing due before one interval
    st = sim.tick(1)
    assert sim.asked == ["errors", "quality"] and st.phase == Phase.ANALYSING  # errors wants a 2nd
    assert st.analysis_runs[-1].check("quality").phase == RunPhase.SUCCESSFUL
    st = sim.tick(5)
    assert st.phase == Phase.PROGRESSING and st.step == 1 and st.reason == "StepPromoted"
    first = st.analysis_runs[0]
    assert first.phase == RunPhase.SUCCESSFUL and first.check("errors").taken == 2
    assert [m.value for m in first.check("errors").measurements] == [0.01, 0.01]
    sim.tick()
    st = sim.tick(5)
    st = sim.tick(5)
    assert st.phase == Phase.SUCCEEDED and st.stable.version == v(V2)
    assert [r.step for r in st.analysis_runs] == [1, 2] and all(r.phase == RunPhase.SUCCESSFUL for r in st.analysis_runs)
    # No builtin check declared: no builtin analysis block written.
    assert st.last_analysis is None


def test_a_failed_check_rolls_back_naming_it() -> None:
    sim = Sim(gc(V1, [prom(), web()]), answers={"errors": 0.01, "quality": 0.2})
    sim.start()
    st = sim.tick(5)
    assert st.phase == Phase.ROLLING_BACK and st.reason == "AnalysisFailed"
    assert "check quality failed" in st.message and "failureCondition 'result < 0.5' is true" in st.message
    run = st.analysis_runs[-1]
    assert run.phase == RunPhase.FAILED and run.check("quality").measurements[-1].value == 0.2
    st = sim.tick()
    assert st.phase == Phase.ROLLED_BACK and st.rejected_version == v(V2)
    assert set(sim.versions.values()) == {v(V1)}


def test_inconclusive_pauses_and_promote_continues() -> None:
    sim = Sim(gc(V1, [web(inconclusiveLimit=0)]), answers={"quality": 0.7})  # between the two conditions
    sim.start()
    st = sim.tick(5)
    assert st.phase == Phase.PAUSED and st.analysis_paused and st.reason == "AnalysisInconclusive"
    assert "check quality inconclusive" in st.message and "neither condition" in st.message
    assert sim.reasons()[-1] == "AnalysisInconclusive" and sim.events[-1].type == "Warning"
    conds = {c["type"]: c for c in st.conditions}
    assert conds["Ready"]["status"] == "False" and conds["Stalled"]["status"] == "False"
    assert conds["Progressing"]["reason"] == "AnalysisInconclusive" and "quality" in conds["Progressing"]["message"]
    assert st.analysis_runs[-1].phase == RunPhase.INCONCLUSIVE
    held = dict(sim.versions)
    # Held: nothing pushed, not resumed by an unpaused spec, nor by toggling spec.rollout.paused.
    for _ in range(3):
        assert sim.tick(10).phase == Phase.PAUSED
    sim.raw["rollout"]["paused"] = True
    assert sim.tick().phase == Phase.PAUSED
    sim.raw["rollout"]["paused"] = False
    assert sim.tick().phase == Phase.PAUSED and sim.versions == held
    # Promote (one step): on to the next step, analysed as usual.
    sim.answers["quality"] = 0.95
    st = sim.tick(promote_step=True)
    assert st.phase == Phase.PROGRESSING and st.step == 1 and not st.analysis_paused
    sim.tick()
    assert sim.tick(5).phase == Phase.SUCCEEDED


def test_retry_analyses_an_inconclusive_step_again() -> None:
    sim = Sim(gc(V1, [prom()]), answers={"errors": None})  # no data → inconclusive
    sim.start()
    assert sim.tick(5).phase == Phase.PAUSED
    sim.answers["errors"] = 0.01
    st = sim.tick(retry=True)
    assert st.phase in (Phase.PROGRESSING, Phase.ANALYSING) and st.step == 0 and st.reason in ("Retried", "Analysing")
    st = sim.tick()
    st = sim.tick(5)
    assert st.phase == Phase.PROGRESSING and st.step == 1
    assert [r.phase for r in st.analysis_runs] == [RunPhase.INCONCLUSIVE, RunPhase.SUCCESSFUL]


def test_provider_errors_up_to_the_limit_then_pause() -> None:
    sim = Sim(gc(V1, [prom(consecutiveErrorLimit=1)]), answers={"errors": "HTTP 503"})
    sim.start()
    assert sim.tick(5).phase == Phase.ANALYSING  # one error tolerated, measured again next interval
    st = sim.tick(5)
    assert st.phase == Phase.PAUSED and "2 provider errors in a row > consecutiveErrorLimit 1" in st.message


def test_failing_dry_run_check_does_not_roll_back() -> None:
    sim = Sim(gc(V1, [prom(), web(dryRun=True)]), answers={"errors": 0.01, "quality": 0.1})
    sim.start()
    st = sim.tick(5)
    assert st.phase == Phase.PROGRESSING and st.step == 1, st.message
    run = st.analysis_runs[0]
    shadow = run.check("quality")
    assert run.phase == RunPhase.SUCCESSFUL and shadow.dry_run and shadow.phase == RunPhase.FAILED
    assert shadow.measurements[-1].value == 0.1 and "dry-run" in run.message


BUILTIN = {"name": "builtin", "provider": {"builtin": {}}}


def test_a_dry_run_builtin_check_without_data_does_not_hold_the_step() -> None:
    """Recorded only, the builtin check gets no data (e.g. Prometheus down): at the end of the step's
    analysisInterval it is recorded Inconclusive (no data) and the step goes on. It once kept the
    step analysing forever, as a step waits until every check, dry-run ones too, has finished."""
    sim = Sim(gc(V1, [prom(), {**BUILTIN, "dryRun": True}]), answers={"errors": 0.01})
    sim.start()
    st = sim.tick(5, builtin_error="ClientConnectorError: prometheus down")
    assert st.phase == Phase.ANALYSING  # errors passed; the interval (10 s) is not over
    assert st.analysis_runs[-1].check("builtin").phase == RunPhase.RUNNING
    st = sim.tick(5, builtin_error="ClientConnectorError: prometheus down")
    assert st.phase == Phase.PROGRESSING and st.step == 1, st.message
    run = st.analysis_runs[0]
    builtin = run.check("builtin")
    assert run.phase == RunPhase.SUCCESSFUL and builtin.phase == RunPhase.INCONCLUSIVE and builtin.dry_run
    assert builtin.measurements[-1].message == "no data by the end of the analysis interval " \
                                               "(ClientConnectorError: prometheus down)"


def test_a_dry_run_check_whose_provider_fails_does_not_hold_the_step() -> None:
    """The judge behind a dry-run web check is down: the step goes on when the deciding check
    passes, not after consecutiveErrorLimit (4) more intervals of errors."""
    sim = Sim(gc(V1, [prom(), web(dryRun=True)]), answers={"errors": 0.01, "quality": "HTTP 503"})
    sim.start()
    st = sim.tick(5)
    assert st.phase == Phase.PROGRESSING and st.step == 1, st.message
    shadow = st.analysis_runs[0].check("quality")
    assert shadow.phase == RunPhase.INCONCLUSIVE and shadow.errors == 1 and "HTTP 503" in shadow.message


def test_a_deciding_builtin_check_without_data_still_waits() -> None:
    """Only a dry-run check is let go: a deciding one is never passed on missing data."""
    sim = Sim(gc(V1, [prom(), BUILTIN]), answers={"errors": 0.01})
    sim.start()
    for _ in range(10):
        st = sim.tick(10)
    assert st.phase == Phase.ANALYSING and st.analysis_runs[-1].check("builtin").phase == RunPhase.RUNNING


def test_builtin_declared_beside_a_query() -> None:
    sim = Sim(gc(V1, [{"name": "builtin", "provider": {"builtin": {}}}, prom()]), answers={"errors": 0.01})
    sim.start()
    st = sim.tick(5, canary=healthy())
    assert st.phase == Phase.ANALYSING  # builtin needs its 10 s window
    st = sim.tick(6, canary=healthy())
    assert st.phase == Phase.PROGRESSING and st.step == 1
    builtin = st.analysis_runs[0].check("builtin")
    assert builtin.phase == RunPhase.SUCCESSFUL and builtin.measurements[-1].values["errorRate"] == 0.0


def test_abort_terminates_the_open_run() -> None:
    sim = Sim(gc(V1, [prom(count=5)]), answers={"errors": 0.01})
    sim.start()
    sim.tick(5)
    st = sim.tick(abort=True)
    run = st.analysis_runs[-1]
    assert run.phase == RunPhase.TERMINATED and run.message.startswith("Aborted")
    assert run.check("errors").phase == RunPhase.TERMINATED and run.check("errors").taken == 1


def test_runs_are_bounded_in_status() -> None:
    sim = Sim(gc(V1, [web(count=1)]), answers={"quality": 0.7})
    sim.start()
    for _ in range(14):
        assert sim.tick(5).phase == Phase.PAUSED
        sim.tick(retry=True)
        sim.tick()
    raw = sim.status.to_status(steps=(50, 100))["analysisRuns"]
    assert len(raw) == 10 and all(r["step"] == 1 for r in raw)


# ---------------------------------------------------------------- the restart rule (issue 13 item 5)


def test_restart_does_not_promote_on_a_few_seconds_of_data() -> None:
    """The builtin's direct scrape loses its window start snapshots when the operator restarts and
    begins a new window at its first scrape (window_from). Elapsed time since the analysis began
    must not count: the step wants a full analysisInterval of data from the new window on."""
    sim = Sim(gc(V1, None))  # the implicit builtin check only
    st = sim.start()
    t0 = sim.now
    st = sim.tick(1, window_from=t0)  # the window's first scrape
    assert st.window_from == t0 and st.window_samples == 0
    st = sim.tick(4, canary=healthy(), window_from=t0)
    assert st.phase == Phase.ANALYSING and st.window_samples == 1
    # The operator restarts 8 s into the 10 s window and stays down 30 s; the new process's
    # first tick scrapes the window start again (no data yet), its next tick has 1 s of data.
    st = sim.tick(30, window_from=sim.now + 30)
    restarted = st.window_from
    assert restarted == sim.now and st.window_samples == 0 and "analysis window restarted" in st.message
    st = sim.tick(1, canary=healthy(), window_from=restarted)
    assert st.phase == Phase.ANALYSING, "promoted on 1 s of fresh data after a restart"
    assert "analysing 1/10s" in st.message
    st = sim.tick(8, canary=healthy(), window_from=restarted)
    assert st.phase == Phase.ANALYSING and st.window_samples == 2
    st = sim.tick(1, canary=healthy(), window_from=restarted)
    assert st.phase == Phase.PROGRESSING and st.step == 1  # a full 10 s of fresh data


def test_window_state_persists_in_status() -> None:
    sim = Sim(gc(V1, None))
    sim.start()
    sim.tick(1, window_from=sim.now + 1)
    raw = sim.status.to_status(steps=(50, 100))["rollout"]["analysisWindow"]
    assert raw["from"].endswith("Z") and raw["samples"] == 0
    assert RolloutStatus.from_status({"rollout": {"analysisWindow": raw}}).window_from == sim.status.window_from


def test_first_window_without_a_restart_passes_as_before() -> None:
    sim = Sim(gc(V1, None))
    sim.start()
    t0 = sim.now + 1
    sim.tick(1, window_from=t0)
    st = sim.tick(9, canary=healthy(), window_from=t0)
    assert st.phase == Phase.ANALYSING
    st = sim.tick(1, canary=healthy(), window_from=t0)
    assert st.phase == Phase.PROGRESSING and "analysis window restarted" not in st.message


def test_full_promote_or_abort_end_an_inconclusive_pause() -> None:
    for flag, phase in (("promote", Phase.SUCCEEDED), ("abort", Phase.ABORTED)):
        sim = Sim(gc(V1, [web()]), answers={"quality": 0.7})
        sim.start()
        assert sim.tick(5).phase == Phase.PAUSED
        st = sim.tick(**{flag: True})
        for _ in range(3):
            st = sim.tick()
        assert st.phase == phase and not st.analysis_paused, (flag, st.message)
        assert set(sim.versions.values()) == {v(V2) if flag == "promote" else v(V1)}


def test_invalid_check_is_an_invalid_spec_not_a_crash() -> None:
    with pytest.raises(SpecError, match=r"spec.rollout.analysis.checks\[0\].successCondition 'result <<< 1'"):
        parse_spec(gc(V1, [prom(successCondition="result <<< 1")]))
