"""Progressive rollout of GateConfig changes, as pure state transitions.

``next_action(spec=, status=, obs=, now=) -> Decision(status, actions)`` is the
whole controller logic (after Argo Rollouts' ``CalculateRolloutPhase``): it reads
the parsed spec, the persisted status and what the handler just observed (pod
versions from ``/healthz``, one-shot annotations, windowed metrics) and returns
the next status plus side effects for the handler to perform. No I/O here.

Why it is crash-safe: every bit of rollout state lives in ``status``, and pushes
are *level-based*: each tick derives the version every pod should run from
``status`` (:func:`desired_versions`) and pushes only to pods whose reported
version differs. A restarted operator observes the pods again, so work already
done is never repeated and the stable version is never lost (it only changes on
promotion). The handler persists the returned status before performing the
returned actions.

Flow for a new spec version (``steps`` default 5 → 20 → 100 % of requests, or of instances)::

    Succeeded ─new version─▶ Progressing ─step pods report it─▶ Analysing
        ▲                        ▲                                  │ window passed
        │                        └──────── next step ◀──────────────┤
        └──────────── promoted (last step passed) ◀─────────────────┘
    Analysing ─analysis fails─▶ RollingBack ─all pods stable─▶ RolledBack
    Analysing ─a check inconclusive─▶ Paused (analysisPaused) ─promote / retry / abort─▶ on / again / back
    any active ─abort annotation─▶ RollingBack ─▶ Aborted
    any active ─spec.rollout.paused─▶ Paused ─unpaused─▶ Progressing (same step)
    any active ─newer spec─▶ Progressing at step 1 (canary pods, stable unchanged)
    any active ─promote annotation "step"─▶ Progressing at the next step (analysis skipped)
    RolledBack/Aborted ─retry annotation (spec still on the rejected version)─▶ Progressing at step 1
    Failed (analysis, autoRollback off) ─retry annotation─▶ Progressing (same step, analysed again)

``spec.rollout.strategy: requests`` (:mod:`sparsegate.domain.request_canary`) keeps this flow and
changes what a step's pods hold: every pod is a step pod and holds the stable and the canary
version with the step's weight (a :class:`~sparsegate.domain.request_canary.GateSetTarget`, whose
set key is the "version" such a pod reports), so a step's percent is a share of requests.

What judges a step is ``spec.rollout.analysis.checks`` (:mod:`sparsegate.domain.analysis_run`;
the builtin check alone when none are declared). Declared checks' answers arrive as
``Observations.measurements`` when ``analysis_run.due_checks`` says they are due; each step's
measurements are kept in ``status.analysisRuns``. The builtin check passes only on a full
``analysisInterval`` of data from where its provider's window begins (``Observations.window_from``,
kept in ``status.rollout.analysisWindow``): a restarted operator's direct scrape begins a new
window, and the time the step spent analysing before the restart does not count.

Every version that becomes ``status.stable`` is appended to ``status.history`` (the last
:data:`HISTORY_LIMIT`, numbered revisions), so ``kubectl sparsegate undo`` can write an earlier
version's params back into the spec. :func:`gateconfig_conditions` adds the kstatus conditions
(``Ready``, ``Reconciling``, ``Stalled``) that Flux and kpt read.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sparsegate_contracts import gate as gatedoc
from sparsegate_contracts.names import ABORT_ANNOTATION, GROUP, PROMOTE_ANNOTATION, RETRY_ANNOTATION

from sparsegate.domain import analysis_run as runs
from sparsegate.domain import request_canary
from sparsegate.domain.request_canary import GateSetTarget, Strategy
from sparsegate.domain.analysis import AnalysisResult, GroupMetrics, Verdict, analyse
from sparsegate.domain.analysis_run import (
    BUILTIN_CHECK,
    AnalysisRun,
    CheckSpec,
    Measured,
    Measurement,
    MeasurementPhase,
    Provider,
    RunPhase,
)
from sparsegate.domain.conditions import merge_conditions
from sparsegate.domain.calibration import (
    Calibration,
    add_sample,
    parse_calibration,
    parse_duration,
    thresholds,
)

DEFAULT_STEPS = (5, 20, 100)
DEFAULT_ANALYSIS_INTERVAL_S = 30.0
DEFAULT_SLA_P99_MS = 800.0
DEFAULT_MAX_DRIFT = 0.1
# Canary perplexity may exceed stable's by at most 2 % (analysis.quality_check). On the demo
# model that sparsegate-train writes, benign threshold moves change the probe perplexity by
# < 0.2 % and top-1 routing or a tight capacity cap raise it by > 10 % (README).
DEFAULT_MAX_QUALITY_DROP = 0.02
DEFAULT_MIN_REQUESTS = 20
DEFAULT_PROGRESS_DEADLINE_S = 120.0
HISTORY_LIMIT = 10  # promoted stable versions kept in status.history (undo targets)

# PROMOTE_ANNOTATION's value "step" promotes one step; any other value (the documented
# `sparsegate.dev/promote=now`) promotes to all instances, as it always has.
PROMOTE_STEP_VALUE = "step"


class Phase(str, enum.Enum):
    PENDING = "Pending"
    # Spec seen, nothing recorded yet (before the first reconcile writes status.stable).
    PROGRESSING = "Progressing"
    # Pushing the current step's version to its pods; waiting until each reports it.
    ANALYSING = "Analysing"
    # Every pod of the step runs the canary version; live metrics are judged for the window.
    PAUSED = "Paused"
    # spec.rollout.paused: the current step is held as is, nothing pushed or promoted.
    SUCCEEDED = "Succeeded"
    # Resting: every pod runs status.stable (the new version was promoted, or the first one).
    ROLLING_BACK = "RollingBack"
    # Pushing the stable version back to canary pods (analysis failed, abort or spec reverted).
    ROLLED_BACK = "RolledBack"
    # Resting after an automatic rollback; the failed version is not retried until spec changes.
    ABORTED = "Aborted"
    # Resting after a user abort (annotation); like RolledBack but requested.
    FAILED = "Failed"
    # Cannot proceed: invalid spec, or analysis failed with autoRollback false (canary kept
    # in place for a human; the abort annotation rolls it back, a new spec supersedes it).


# Phases in which a canary version is in flight.
ACTIVE_PHASES = frozenset({Phase.PROGRESSING, Phase.ANALYSING, Phase.PAUSED})
RESTING_PHASES = frozenset({Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.ABORTED})


class SpecError(ValueError):
    """The GateConfig spec cannot be rolled out (reported as phase Failed)."""


# ---------------------------------------------------------------- gate versions


@dataclass(frozen=True)
class GateVersion:
    """A content-addressed gate document, as pushed to ``PUT /admin/gate``.

    Hashing and validation are ``sparsegate_contracts.gate``'s, so the operator, the
    rendered ConfigMap and the model server agree on every version id.
    """

    version: str
    checksum: str
    params: Mapping[str, Any]

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> GateVersion:
        """Raises ``gatedoc.GateParamsError`` (a ValueError) for invalid params."""
        doc = gatedoc.make_document(params)
        return cls(version=doc.version, checksum=doc.checksum, params=dict(doc.raw_params))

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> GateVersion | None:
        if not raw or not raw.get("version"):
            return None
        return cls(version=raw["version"], checksum=raw.get("checksum", ""), params=dict(raw.get("params") or {}))

    def document(self) -> dict[str, Any]:
        return {"version": self.version, "checksum": self.checksum, "params": dict(self.params)}


# ---------------------------------------------------------------- spec


@dataclass(frozen=True)
class RolloutSpec:
    target: GateVersion
    steps: tuple[int, ...] = DEFAULT_STEPS
    analysis_interval_s: float = DEFAULT_ANALYSIS_INTERVAL_S
    sla_p99_ms: float = DEFAULT_SLA_P99_MS
    max_drift: float = DEFAULT_MAX_DRIFT
    max_quality_drop: float = DEFAULT_MAX_QUALITY_DROP
    auto_rollback: bool = True
    paused: bool = False
    min_requests: int = DEFAULT_MIN_REQUESTS
    progress_deadline_s: float = DEFAULT_PROGRESS_DEADLINE_S
    calibration: Calibration = field(default_factory=lambda: parse_calibration(None))
    # spec.rollout.analysis.checks (domain.analysis_run); the implicit builtin check when none are declared.
    checks: tuple[CheckSpec, ...] = (BUILTIN_CHECK,)
    # What a step's percent applies to: pods (instances) or requests on every pod (requests,
    # domain.request_canary); sticky_header keys a session's requests under the latter.
    strategy: Strategy = request_canary.DEFAULT_STRATEGY
    sticky_header: str = request_canary.contract.DEFAULT_STICKY_HEADER

    @property
    def builtin(self) -> CheckSpec | None:
        return next((c for c in self.checks if c.provider == Provider.BUILTIN), None)


def parse_spec(spec: Mapping[str, Any], *, target: GateVersion | None = None) -> RolloutSpec:
    """GateConfig ``spec`` → :class:`RolloutSpec`; raises :class:`SpecError`.

    ``target`` lets the caller supply the gate document rendered elsewhere
    (defaults filled in); by default it is derived from ``spec.params`` as is.
    """
    try:
        params = spec.get("params") or {}
        if not isinstance(params, Mapping):
            raise SpecError("spec.params must be an object")
        ro = spec.get("rollout") or {}
        steps = tuple(int(s) for s in ro.get("steps", DEFAULT_STEPS))
        if not steps or steps[-1] != 100 or any(s <= 0 for s in steps):
            raise SpecError(f"spec.rollout.steps must be positive percentages ending at 100, got {list(steps)}")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise SpecError(f"spec.rollout.steps must be strictly increasing, got {list(steps)}")
        try:
            target = target or GateVersion.from_params(params)
        except gatedoc.GateParamsError as e:
            raise SpecError(f"spec.params: {e}") from e
        return RolloutSpec(
            target=target,
            steps=steps,
            analysis_interval_s=parse_duration(
                ro.get("analysisInterval", DEFAULT_ANALYSIS_INTERVAL_S), field="analysisInterval"
            ),
            sla_p99_ms=float(ro.get("slaP99LatencyMs", DEFAULT_SLA_P99_MS)),
            max_drift=float(ro.get("maxDrift", DEFAULT_MAX_DRIFT)),
            max_quality_drop=float(ro.get("maxQualityDrop", DEFAULT_MAX_QUALITY_DROP)),
            auto_rollback=bool(ro.get("autoRollback", True)),
            paused=bool(ro.get("paused", False)),
            min_requests=int(ro.get("minRequests", DEFAULT_MIN_REQUESTS)),
            progress_deadline_s=parse_duration(
                ro.get("progressDeadline", DEFAULT_PROGRESS_DEADLINE_S), field="progressDeadline"
            ),
            calibration=parse_calibration(spec.get("calibration")),
            checks=runs.parse_checks(ro.get("analysis")),
            strategy=request_canary.parse_strategy(ro.get("strategy")),
            sticky_header=request_canary.parse_sticky_header(ro.get("stickyHeader")),
        )
    except SpecError:
        raise
    except (TypeError, ValueError) as e:
        raise SpecError(str(e)) from e


# ---------------------------------------------------------------- status


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _epoch(s: str | None) -> float | None:
    if not s:
        return None
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class Revision:
    """One version that became stable: enough to write its params back into the spec (undo)."""

    revision: int  # 1, 2, ... in promotion order; a version promoted again gets a new number
    gate: GateVersion
    promoted_at: float | None
    reason: str = ""  # why it became stable: Initialized, Promoted, NoInstances, ...

    @classmethod
    def from_status(cls, raw: Mapping[str, Any]) -> Revision | None:
        gate = GateVersion.from_status(raw)
        if gate is None or not isinstance(raw.get("revision"), int):
            return None
        return cls(revision=raw["revision"], gate=gate, promoted_at=_epoch(raw.get("promotedAt")),
                   reason=raw.get("reason") or "")

    def to_status(self) -> dict[str, Any]:
        out = {"revision": self.revision, **self.gate.document(), "promotedAt": _iso(self.promoted_at),
               "reason": self.reason}
        return {k: v for k, v in out.items() if v is not None}


def record_stable(history: Sequence[Revision], *, stable: GateVersion | None, now: float, reason: str,
                  limit: int = HISTORY_LIMIT) -> tuple[Revision, ...]:
    """``history`` with ``stable`` as its newest revision (unchanged when it already is).

    A version promoted again (an undo) moves to the end under a new number, as Argo Rollouts
    renumbers a ReplicaSet it rolls back to, so the list holds distinct versions, oldest first.
    """
    if stable is None or (history and history[-1].gate.version == stable.version):
        return tuple(history)
    number = max((r.revision for r in history), default=0) + 1
    kept = [r for r in history if r.gate.version != stable.version]
    kept.append(Revision(revision=number, gate=stable, promoted_at=now, reason=reason))
    return tuple(kept[-limit:])


@dataclass(frozen=True)
class RolloutStatus:
    """Everything the rollout controller persists in GateConfig ``status``."""

    phase: Phase = Phase.PENDING
    stable: GateVersion | None = None
    canary: GateVersion | None = None
    step: int | None = None  # index into spec steps while a canary is in flight
    step_percent: int | None = None
    canary_pods: tuple[str, ...] = ()
    pod_versions: Mapping[str, str] = field(default_factory=dict)  # last observed, per pod
    instances: int = 0  # pods seen at the last check, answering or not
    step_started_at: float | None = None  # when the current step began pushing
    analysis_started_at: float | None = None  # when every pod of the step reported the canary
    after_rollback: Phase | None = None  # where RollingBack comes to rest
    rejected_version: str | None = None  # rolled back / aborted; not retried while spec equals it
    promote: bool = False  # promote annotation accepted: straight to 100 %, no analysis
    reason: str = ""
    message: str = ""
    last_analysis: Mapping[str, Any] | None = None
    qps_samples: tuple[tuple[float, float], ...] = ()
    error_samples: tuple[tuple[float, float], ...] = ()
    conditions: tuple[Mapping[str, Any], ...] = ()
    history: tuple[Revision, ...] = ()  # promoted stable versions, oldest first; last == stable
    analysis_runs: tuple[AnalysisRun, ...] = ()  # the last RUN_HISTORY steps' analyses, oldest first
    analysis_paused: bool = False  # Paused because a check was inconclusive (not by spec.rollout.paused)
    # The builtin check's data window: where the data the provider holds begins (a restarted operator's
    # direct scrape begins a new one) and how many ticks brought data. A step passes only on a full
    # analysisInterval of data from window_from on, not on time since analysis_started_at.
    window_from: float | None = None
    window_samples: int = 0
    # spec.rollout.strategy when the rollout in flight started (None: instances, e.g. status
    # written before strategies existed); under requests status shows canaryWeight = percent / 100.
    strategy: Strategy | None = None

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> RolloutStatus:
        """Read GateConfig ``status`` (``stable``, ``history``, ``conditions``, the ``rollout`` block)."""
        raw = raw or {}
        ro = raw.get("rollout") or {}
        phase = ro.get("phase")
        after = ro.get("afterRollback")
        calibration = ro.get("calibration") or {}
        return cls(
            phase=Phase(phase) if phase in Phase._value2member_map_ else Phase.PENDING,
            stable=GateVersion.from_status(raw.get("stable")),
            canary=GateVersion.from_status(ro.get("canary")),
            step=ro.get("stepIndex"),
            step_percent=ro.get("canaryPercent"),
            canary_pods=tuple(ro.get("canaryPods") or ()),
            pod_versions=dict(ro.get("podVersions") or {}),
            instances=int(ro.get("instances") or 0),
            step_started_at=_epoch(ro.get("stepStartedAt")),
            analysis_started_at=_epoch(ro.get("analysisStartedAt")),
            after_rollback=Phase(after) if after in Phase._value2member_map_ else None,
            rejected_version=ro.get("rejectedVersion"),
            promote=bool(ro.get("promote", False)),
            reason=ro.get("reason") or "",
            message=ro.get("message") or "",
            last_analysis=ro.get("analysis"),
            qps_samples=tuple(tuple(x) for x in calibration.get("qps", ())),
            error_samples=tuple(tuple(x) for x in calibration.get("errorRate", ())),
            conditions=tuple(raw.get("conditions") or ()),
            history=tuple(r for r in (Revision.from_status(x) for x in raw.get("history") or ()) if r),
            analysis_runs=tuple(r for r in (AnalysisRun.from_status(x) for x in raw.get("analysisRuns") or ()) if r),
            analysis_paused=bool(ro.get("analysisPaused", False)),
            window_from=_epoch((ro.get("analysisWindow") or {}).get("from")),
            window_samples=int((ro.get("analysisWindow") or {}).get("samples") or 0),
            strategy=Strategy(ro["strategy"]) if ro.get("strategy") in Strategy._value2member_map_ else None,
        )

    def to_status(self, *, steps: Sequence[int]) -> dict[str, Any]:
        """``stable``, ``history``, ``conditions`` and ``rollout`` for GateConfig status (None values left out).

        Written as a whole (JSON patch ``add /status``): merge patches would merge the params
        maps of successive versions and corrupt their checksums.
        """
        counts: dict[str, int] = {}
        for version in self.pod_versions.values():
            counts[version] = counts.get(version, 0) + 1
        rollout = {
            # Printer columns read phase, step, canaryPercent and canaryVersion.
            "phase": self.phase.value,
            "reason": self.reason,
            "message": self.message,
            "step": self.step + 1 if self.step is not None else None,
            "steps": len(steps),
            "canaryPercent": self.step_percent,
            "canaryWeight": request_canary.weight_of(self.step_percent)
            if self.canary and self.strategy == Strategy.REQUESTS and self.step_percent is not None else None,
            "strategy": self.strategy.value if self.canary and self.strategy else None,
            "canaryVersion": self.canary.version if self.canary else None,
            "canary": self.canary.document() if self.canary else None,
            "canaryInstances": f"{len(self.canary_pods)}/{self.instances}" if self.canary else None,
            "instances": self.instances,
            "podVersions": dict(self.pod_versions),
            "versionCounts": counts,
            "analysis": dict(self.last_analysis) if self.last_analysis else None,
            "stepIndex": self.step,
            "canaryPods": list(self.canary_pods),
            "stepStartedAt": _iso(self.step_started_at),
            "analysisStartedAt": _iso(self.analysis_started_at),
            "afterRollback": self.after_rollback.value if self.after_rollback else None,
            "rejectedVersion": self.rejected_version,
            "promote": self.promote,
            "analysisPaused": self.analysis_paused or None,
            "analysisWindow": {"from": _iso(self.window_from), "samples": self.window_samples}
            if self.window_from is not None else None,
            "calibration": {
                "qps": [list(x) for x in self.qps_samples],
                "errorRate": [list(x) for x in self.error_samples],
            },
        }
        out: dict[str, Any] = {
            "rollout": {k: v for k, v in rollout.items() if v is not None},
            "conditions": list(self.conditions),
        }
        if self.stable:
            out["stable"] = self.stable.document()
        if self.history:
            out["history"] = [r.to_status() for r in self.history]
        if self.analysis_runs:
            out["analysisRuns"] = [r.to_status() for r in self.analysis_runs]
        return out


# ---------------------------------------------------------------- observations and actions


@dataclass(frozen=True)
class PodObservation:
    name: str
    reachable: bool  # has an IP and answered /healthz
    version: str | None  # gateVersion reported by /healthz (None when unreachable)


@dataclass(frozen=True)
class Observations:
    pods: tuple[PodObservation, ...] = ()
    abort: bool = False
    promote: bool = False  # to all instances at once
    promote_step: bool = False  # to the next step, skipping the current step's analysis
    retry: bool = False  # re-run the rejected version the spec still names, or a Failed step
    # Canary and stable groups since status.analysis_started_at (None: no data yet).
    canary_metrics: GroupMetrics | None = None
    stable_metrics: GroupMetrics | None = None
    # Calibration samples for this tick: fleet qps and the stable pods' error rate.
    fleet_qps: float | None = None
    stable_error_rate: float | None = None
    # Where the builtin provider's window data begins (None: the provider does not say; then
    # status.analysis_started_at is taken, as Prometheus keeps the data across restarts).
    window_from: float | None = None
    # Declared checks measured this tick (check name → provider answer), see analysis_run.due_checks.
    measurements: Mapping[str, Measured] = field(default_factory=dict)


def annotation_requests(annotations: Mapping[str, str] | None) -> dict[str, bool]:
    """The one-shot requests in a GateConfig's annotations, as :class:`Observations` fields."""
    annotations = annotations or {}
    promote = annotations.get(PROMOTE_ANNOTATION)
    return {
        "abort": ABORT_ANNOTATION in annotations,
        "promote": promote is not None and promote != PROMOTE_STEP_VALUE,
        "promote_step": promote == PROMOTE_STEP_VALUE,
        "retry": RETRY_ANNOTATION in annotations,
    }


@dataclass(frozen=True)
class PushGate:
    pod: str
    gate: GateVersion | GateSetTarget  # a set: stable + canary at a weight (strategy requests)


@dataclass(frozen=True)
class EmitEvent:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class ClearAnnotation:
    name: str


@dataclass(frozen=True)
class RecordOutcome:
    outcome: str  # succeeded | rolled_back | aborted | failed | superseded | reverted


@dataclass(frozen=True)
class RecordStep:
    percent: int
    seconds: float


Action = PushGate | EmitEvent | ClearAnnotation | RecordOutcome | RecordStep


@dataclass(frozen=True)
class Decision:
    status: RolloutStatus
    actions: tuple[Action, ...]

    @property
    def pushes(self) -> tuple[PushGate, ...]:
        return tuple(a for a in self.actions if isinstance(a, PushGate))


# ---------------------------------------------------------------- pure helpers


def instances_for(*, percent: int, total: int) -> int:
    """Instances a step covers: ceil(percent · total), at least one, at most all."""
    if total <= 0:
        return 0
    return min(total, max(1, math.ceil(percent * total / 100)))


def select_canary_pods(
    *, pods: Sequence[PodObservation], percent: int, previous: Sequence[str], canary_version: str | None
) -> tuple[str, ...]:
    """Deterministic canary set: sticky across ticks and restarts.

    Preference: pods already chosen (and reachable), then pods already running the
    canary, then reachable pods, then the rest; ties by name. So a restart picks the
    same pods, a step grows the previous set, and a superseding version reuses the
    previous canary pods (stable pods stay untouched).
    """
    prev = set(previous)

    def rank(p: PodObservation) -> tuple[int, str]:
        if p.name in prev and p.reachable:
            return (0, p.name)
        if canary_version is not None and p.version == canary_version:
            return (1, p.name)
        return (2 if p.reachable else 3, p.name)

    n = instances_for(percent=percent, total=len(pods))
    return tuple(sorted(p.name for p in sorted(pods, key=rank)[:n]))


def canary_gate(status: RolloutStatus, *, sticky_header: str = request_canary.contract.DEFAULT_STICKY_HEADER
                ) -> GateVersion | GateSetTarget | None:
    """What the step's canary pods hold: the canary version (strategy instances), or stable +
    canary at the step's weight (strategy requests, where every pod is a step pod)."""
    if status.canary is None:
        return None
    if status.strategy == Strategy.REQUESTS and status.stable is not None:
        return request_canary.step_target(stable=status.stable, canary=status.canary, percent=status.step_percent,
                                          sticky_header=sticky_header)
    return status.canary


def desired_versions(*, status: RolloutStatus, pods: Sequence[PodObservation],
                     sticky_header: str = request_canary.contract.DEFAULT_STICKY_HEADER
                     ) -> dict[str, GateVersion | GateSetTarget]:
    """Which gate each pod should run now; pods absent from the result are left alone."""
    if status.stable is None or status.phase in (Phase.PAUSED, Phase.FAILED, Phase.PENDING):
        return {}
    canary = canary_gate(status, sticky_header=sticky_header)
    if status.phase in (Phase.PROGRESSING, Phase.ANALYSING) and canary is not None:
        chosen = set(status.canary_pods)
        return {p.name: canary if p.name in chosen else status.stable for p in pods}
    return {p.name: status.stable for p in pods}


def _choose(strategy: Strategy | None, *, pods: Sequence[PodObservation], percent: int, previous: Sequence[str],
            canary_version: str | None) -> tuple[str, ...]:
    """The step's canary pods: a sticky subset (instances) or every pod (requests)."""
    if strategy == Strategy.REQUESTS:
        return request_canary.step_pods([p.name for p in pods])
    return select_canary_pods(pods=pods, percent=percent, previous=previous, canary_version=canary_version)


def _step_text(strategy: Strategy | None, *, percent: int, chosen: Sequence[str],
               pods: Sequence[PodObservation]) -> str:
    if strategy == Strategy.REQUESTS:
        return request_canary.step_text(percent=percent, pods=len(pods))
    return f"{percent}% = {len(chosen)} of {len(pods)} instances"


def kstatus_conditions(*, status: RolloutStatus, target_version: str | None) -> list[dict[str, Any]]:
    """``Ready``, ``Reconciling`` and ``Stalled`` as kstatus (Flux, kpt) reads them.

    Reconciling is True while versions are being pushed or judged; Stalled is True when nothing
    moves until a person acts: the spec is invalid, analysis failed with autoRollback off, or
    the spec still names the version that was rolled back or aborted. A paused rollout is
    neither (Ready False, so kstatus reads InProgress). ``target_version`` is the spec's version
    (None when the spec cannot be parsed).
    """
    phase, reason, message = status.phase, status.reason or status.phase.value, status.message
    if phase == Phase.PAUSED:
        reason = Phase.PAUSED.value  # whatever paused it (RolloutStarted while paused, Paused)
    rejected_wanted = (phase in (Phase.ROLLED_BACK, Phase.ABORTED)
                       and (target_version is None or target_version == status.rejected_version))
    stalled = phase == Phase.FAILED or rejected_wanted
    reconciling = phase in (Phase.PENDING, Phase.PROGRESSING, Phase.ANALYSING, Phase.ROLLING_BACK)
    ready = not stalled and not reconciling and phase != Phase.PAUSED
    if rejected_wanted:
        message = (f"{message}; spec still asks for rejected {status.rejected_version}: change spec.params, "
                   f"or annotate {RETRY_ANNOTATION} to try it again")
    stable = status.stable.version if status.stable else "-"

    def cond(ctype: str, value: bool, why: str, text: str) -> dict[str, Any]:
        return {"type": ctype, "status": "True" if value else "False", "reason": why, "message": text}

    return [
        cond("Ready", ready, reason if not ready else "StableVersionServed",
             message if not ready else f"every instance runs the version the spec asks for ({stable})"),
        cond("Reconciling", reconciling, reason if reconciling else phase.value,
             message if reconciling else f"phase {phase.value}"),
        cond("Stalled", stalled, reason if stalled else phase.value, message if stalled else f"phase {phase.value}"),
    ]


CONDITION_ORDER = ("Ready", "Reconciling", "Stalled", "Progressing", "Degraded")


def conditions(
    *, status: RolloutStatus, target_version: str | None, previous: Sequence[Mapping[str, Any]], now: float
) -> tuple[dict[str, Any], ...]:
    """All GateConfig conditions: kstatus' three plus ``Progressing`` and ``Degraded`` (the rollout's
    own view: a rollback leaves Degraded True until the next rollout); lastTransitionTime kept while
    a condition's status is unchanged."""
    phase, reason, message = status.phase, status.reason, status.message
    wanted = {
        "Progressing": phase in (Phase.PROGRESSING, Phase.ANALYSING, Phase.ROLLING_BACK),
        "Degraded": phase in (Phase.ROLLED_BACK, Phase.ABORTED, Phase.FAILED),
    }
    new = [*kstatus_conditions(status=status, target_version=target_version),
           *({"type": ctype, "status": "True" if value else "False", "reason": reason or phase.value,
              "message": message} for ctype, value in wanted.items())]
    merged = merge_conditions(previous, new, now=_iso(now) or "", order=CONDITION_ORDER)
    return tuple(c for c in merged if c["type"] in CONDITION_ORDER)


# ---------------------------------------------------------------- transitions


def _start(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float, reason: str) -> RolloutStatus:
    percent = spec.steps[0]
    chosen = _choose(spec.strategy, pods=obs.pods, percent=percent, previous=s.canary_pods,
                     canary_version=spec.target.version)
    return dataclasses.replace(
        s,
        phase=Phase.PAUSED if spec.paused else Phase.PROGRESSING,
        strategy=spec.strategy,
        canary=spec.target,
        step=0,
        step_percent=percent,
        canary_pods=chosen,
        step_started_at=now,
        analysis_started_at=None,
        after_rollback=None,
        promote=False,
        analysis_paused=False,
        window_from=None,
        window_samples=0,
        reason=reason,
        message=f"rolling out {spec.target.version} over {s.stable.version if s.stable else '-'}: "
        f"step 1/{len(spec.steps)} ({_step_text(spec.strategy, percent=percent, chosen=chosen, pods=obs.pods)})",
        last_analysis=None,
    )


def _rollback(s: RolloutStatus, *, after: Phase, reason: str, message: str, reject: bool) -> RolloutStatus:
    return dataclasses.replace(
        s,
        phase=Phase.ROLLING_BACK,
        after_rollback=after,
        rejected_version=s.canary.version if reject and s.canary else s.rejected_version,
        analysis_started_at=None,
        promote=False,
        analysis_paused=False,
        reason=reason,
        message=message,
    )


def _promote_fully(s: RolloutStatus, *, spec: RolloutSpec, reason: str, message: str) -> RolloutStatus:
    return dataclasses.replace(
        s,
        phase=Phase.SUCCEEDED,
        stable=s.canary,
        canary=None,
        strategy=None,
        step=None,
        step_percent=None,
        canary_pods=(),
        step_started_at=None,
        analysis_started_at=None,
        after_rollback=None,
        promote=False,
        analysis_paused=False,
        window_from=None,
        window_samples=0,
        reason=reason,
        message=message,
    )


def _advance_step(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, step: int, now: float) -> RolloutStatus:
    percent = spec.steps[step]
    chosen = _choose(s.strategy, pods=obs.pods, percent=percent, previous=s.canary_pods,
                     canary_version=s.canary.version if s.canary else None)
    return dataclasses.replace(
        s,
        phase=Phase.PROGRESSING,
        step=step,
        step_percent=percent,
        canary_pods=chosen,
        step_started_at=now,
        analysis_started_at=None,
        analysis_paused=False,
        window_from=None,
        window_samples=0,
        message=f"step {step + 1}/{len(spec.steps)}: "
        f"{_step_text(s.strategy, percent=percent, chosen=chosen, pods=obs.pods)}",
    )


def _fail(
    s: RolloutStatus, *, spec: RolloutSpec, reason: str, message: str, acts: list[Action]
) -> RolloutStatus:
    if spec.auto_rollback:
        acts.append(EmitEvent("Warning", reason, f"rolling back {s.canary.version if s.canary else ''}: {message}"))
        return _rollback(s, after=Phase.ROLLED_BACK, reason=reason, message=message, reject=True)
    acts.append(EmitEvent("Warning", reason, f"{message} (autoRollback off: canary kept, abort to roll back)"))
    acts.append(RecordOutcome("failed"))
    return dataclasses.replace(s, phase=Phase.FAILED, reason=reason, message=message, analysis_started_at=None,
                               analysis_paused=False)


def invalid_spec(*, status: RolloutStatus, error: str, now: float) -> Decision:
    """A spec that cannot be parsed: Failed, nothing pushed (pods keep what they run)."""
    s = dataclasses.replace(status, phase=Phase.FAILED, reason="InvalidSpec", message=error)
    s = dataclasses.replace(
        s, conditions=conditions(status=s, target_version=None, previous=status.conditions, now=now)
    )
    acts: tuple[Action, ...] = ()
    if status.reason != "InvalidSpec" or status.message != error:
        acts = (EmitEvent("Warning", "InvalidSpec", error),)
    return Decision(status=s, actions=acts)


def next_action(*, spec: RolloutSpec, status: RolloutStatus, obs: Observations, now: float) -> Decision:
    """One reconcile step: (spec, status, observations, now) → (new status, actions)."""
    acts: list[Action] = []
    s = status
    # One-shot annotations are consumed whatever the phase; their effect is recorded in status.
    if obs.abort:
        acts.append(ClearAnnotation(ABORT_ANNOTATION))
    if obs.promote or obs.promote_step:
        acts.append(ClearAnnotation(PROMOTE_ANNOTATION))
    if obs.retry:
        acts.append(ClearAnnotation(RETRY_ANNOTATION))
    target = spec.target

    # First reconcile: the spec's version becomes stable (what new pods start with), unless
    # the SparseModel side already recorded one (it writes status.stable on first sight too).
    if s.stable is None or s.phase == Phase.PENDING:
        stable = s.stable or target
        s = dataclasses.replace(
            s, phase=Phase.SUCCEEDED, stable=stable, reason="Initialized", message=f"stable version {stable.version}"
        )
        acts.append(EmitEvent("Normal", "Initialized", s.message))

    # Steps edited mid-rollout: stay within the new list.
    if s.step is not None and s.step >= len(spec.steps):
        s = dataclasses.replace(s, step=len(spec.steps) - 1, step_percent=spec.steps[-1])
    # A once-invalid spec that is valid again resumes the step it interrupted.
    if s.phase == Phase.FAILED and s.reason == "InvalidSpec":
        if s.canary is not None and s.step is not None:
            s = dataclasses.replace(s, phase=Phase.PROGRESSING, step_started_at=now, reason="SpecValid")
        else:
            s = dataclasses.replace(s, phase=Phase.SUCCEEDED, reason="SpecValid")

    # Retry: forget the rejection of the version the spec still names (the start below then rolls
    # it out from step 1), or send a step whose analysis failed (autoRollback off) back to work.
    retried = False
    if obs.retry and s.phase in (Phase.ROLLED_BACK, Phase.ABORTED) and s.rejected_version == target.version:
        s = dataclasses.replace(s, rejected_version=None)
        retried = True
    elif obs.retry and (s.phase == Phase.FAILED or (s.phase == Phase.PAUSED and s.analysis_paused)) \
            and s.canary is not None and s.step is not None:
        # A failed step (autoRollback off) or one paused as inconclusive: analysed again from the start.
        s = dataclasses.replace(s, phase=Phase.PROGRESSING, step_started_at=now, analysis_started_at=None,
                                analysis_paused=False, window_from=None, window_samples=0,
                                reason="Retried", message=f"retrying step {s.step + 1}/{len(spec.steps)}")
        acts.append(EmitEvent("Normal", "Retried", s.message))

    in_flight = s.canary is not None and (s.phase in ACTIVE_PHASES or s.phase == Phase.FAILED)

    # Spec changes.
    if in_flight or s.phase == Phase.ROLLING_BACK:
        assert s.canary is not None and s.stable is not None
        if target.version == s.stable.version and in_flight:
            msg = f"spec reverted to stable {s.stable.version}: rolling back {s.canary.version}"
            acts += [EmitEvent("Normal", "Reverted", msg), RecordOutcome("reverted")]
            s = _rollback(s, after=Phase.SUCCEEDED, reason="Reverted", message=msg, reject=False)
            in_flight = False
        elif target.version not in (s.canary.version, s.stable.version):
            old = s.canary.version
            s = _start(s, spec=spec, obs=obs, now=now, reason="Superseded")
            acts += [
                EmitEvent("Normal", "Superseded", f"{old} superseded by {target.version}; {s.message}"),
                RecordOutcome("superseded"),
            ]
            in_flight = True
    elif s.stable is not None and target.version not in (s.stable.version, s.rejected_version):
        s = _start(s, spec=spec, obs=obs, now=now, reason="Retried" if retried else "RolloutStarted")
        acts.append(EmitEvent("Normal", s.reason, s.message))
        in_flight = True

    # Abort / promote (one-shot annotations).
    if obs.abort and in_flight:
        msg = f"aborted by annotation: rolling back {s.canary.version} to {s.stable.version}"
        acts.append(EmitEvent("Warning", "Aborted", msg))
        s = _rollback(s, after=Phase.ABORTED, reason="Aborted", message=msg, reject=True)
        in_flight = False
    elif obs.promote and in_flight:
        last = len(spec.steps) - 1
        s = _advance_step(s, spec=spec, obs=obs, step=last, now=now)
        s = dataclasses.replace(s, promote=True, reason="PromoteRequested")
        acts.append(EmitEvent("Normal", "PromoteRequested", f"promoting {s.canary.version} to all instances"))
    elif obs.promote_step and in_flight and s.step is not None and s.step < len(spec.steps) - 1:
        # One step on, this step's analysis skipped; the next step is analysed as usual. Paused
        # stays paused (spec.rollout.paused is the spec's to change): the held step moves on.
        # An inconclusive-analysis pause is what promote answers: it ends (Argo's promote resumes too).
        paused = s.phase == Phase.PAUSED and (spec.paused or not s.analysis_paused)
        s = _advance_step(s, spec=spec, obs=obs, step=s.step + 1, now=now)
        s = dataclasses.replace(s, phase=Phase.PAUSED if paused else s.phase, reason="StepPromoteRequested")
        acts.append(EmitEvent("Normal", "StepPromoteRequested", s.message))
    elif obs.promote_step and in_flight:
        # Already at the last step: promoting it is promoting fully.
        last = len(spec.steps) - 1
        s = _advance_step(s, spec=spec, obs=obs, step=last, now=now)
        s = dataclasses.replace(s, promote=True, reason="PromoteRequested")
        acts.append(EmitEvent("Normal", "PromoteRequested", f"promoting {s.canary.version} to all instances"))

    # Pause / resume (spec.rollout.paused, GitOps friendly). An accepted promote wins.
    if s.phase in (Phase.PROGRESSING, Phase.ANALYSING) and spec.paused and not s.promote:
        s = dataclasses.replace(s, phase=Phase.PAUSED, analysis_started_at=None, reason="Paused",
                                message=f"paused at step {s.step + 1}/{len(spec.steps)}")
        acts.append(EmitEvent("Normal", "Paused", s.message))
    elif s.phase == Phase.PAUSED and not s.analysis_paused and (not spec.paused or s.promote):
        s = dataclasses.replace(s, phase=Phase.PROGRESSING, step_started_at=now, reason="Resumed",
                                message=f"resumed at step {s.step + 1}/{len(spec.steps)}")
        acts.append(EmitEvent("Normal", "Resumed", s.message))

    # Calibration samples (baseline traffic and stable error rate) while a canary is in flight.
    if s.phase in (Phase.PROGRESSING, Phase.ANALYSING):
        if obs.fleet_qps is not None:
            s = dataclasses.replace(s, qps_samples=tuple(map(tuple, add_sample(
                s.qps_samples, t=now, value=obs.fleet_qps, window_s=spec.calibration.qps.window_s))))
        if obs.stable_error_rate is not None:
            s = dataclasses.replace(s, error_samples=tuple(map(tuple, add_sample(
                s.error_samples, t=now, value=obs.stable_error_rate, window_s=spec.calibration.error_rate.window_s))))

    by_name = {p.name: p for p in obs.pods}

    if s.phase == Phase.PROGRESSING:
        assert s.canary is not None and s.stable is not None and s.step is not None
        if not obs.pods:
            msg = f"no instances use this GateConfig: {s.canary.version} promoted directly"
            s = _promote_fully(s, spec=spec, reason="NoInstances", message=msg)
            acts += [EmitEvent("Normal", "Promoted", msg), RecordOutcome("succeeded")]
        else:
            percent = spec.steps[s.step]
            chosen = _choose(s.strategy, pods=obs.pods, percent=percent, previous=s.canary_pods,
                             canary_version=s.canary.version)
            s = dataclasses.replace(s, canary_pods=chosen)
            waiting = _not_at_desired(s, obs.pods)
            if not waiting:
                if s.promote:
                    msg = f"{s.canary.version} promoted by annotation to all {len(obs.pods)} instances"
                    acts += [RecordStep(percent, now - (s.step_started_at or now)), EmitEvent("Normal", "Promoted", msg),
                             RecordOutcome("succeeded")]
                    s = _promote_fully(s, spec=spec, reason="Promoted", message=msg)
                else:
                    run = runs.new_run(spec.checks, step=s.step + 1, percent=percent, canary_version=s.canary.version,
                                       now=now)
                    s = dataclasses.replace(
                        s, phase=Phase.ANALYSING, analysis_started_at=now, reason="Analysing",
                        window_from=None, window_samples=0,
                        analysis_runs=(*s.analysis_runs, run)[-runs.RUN_HISTORY:],
                        message=f"step {s.step + 1}/{len(spec.steps)}: {_running_text(s, chosen, obs.pods)}; "
                        f"analysing for {spec.analysis_interval_s:g}s",
                    )
            elif s.step_started_at is not None and now - s.step_started_at > spec.progress_deadline_s:
                msg = (f"step {s.step + 1}: {len(waiting)} instance(s) did not report the expected version within "
                       f"{spec.progress_deadline_s:g}s: {', '.join(waiting[:5])}")
                s = _fail(s, spec=spec, reason="ProgressDeadlineExceeded", message=msg, acts=acts)
            else:
                s = dataclasses.replace(
                    s, message=f"step {s.step + 1}/{len(spec.steps)} ({percent}%): waiting for "
                    f"{len(waiting)} instance(s) to report their version"
                )

    elif s.phase == Phase.ANALYSING:
        assert s.canary is not None and s.step is not None
        percent = spec.steps[s.step]
        chosen = _choose(s.strategy, pods=obs.pods, percent=percent, previous=s.canary_pods,
                         canary_version=s.canary.version)
        if chosen != s.canary_pods or _not_at_desired(s, obs.pods):
            # An instance left, restarted or drifted: re-verify the step before judging it.
            s = dataclasses.replace(s, phase=Phase.PROGRESSING, canary_pods=chosen, step_started_at=now,
                                    analysis_started_at=None, reason="Reverifying",
                                    message="instances changed during analysis: re-verifying the step")
        else:
            s = _judge_step(s, spec=spec, obs=obs, now=now, percent=percent, acts=acts)

    elif s.phase == Phase.ROLLING_BACK:
        assert s.stable is not None
        waiting = [p.name for p in obs.pods if p.reachable and p.version != s.stable.version]
        if not waiting:
            after = s.after_rollback or Phase.ROLLED_BACK
            outcome = {Phase.ABORTED: "aborted", Phase.SUCCEEDED: None}.get(after, "rolled_back")
            msg = s.message if after != Phase.SUCCEEDED else f"every instance runs stable {s.stable.version}"
            if outcome:
                acts.append(RecordOutcome(outcome))
            acts.append(EmitEvent("Normal" if after == Phase.SUCCEEDED else "Warning",
                                  "RolledBack", f"every instance back on {s.stable.version}"))
            s = dataclasses.replace(
                s, phase=after, canary=None, strategy=None, step=None, step_percent=None, canary_pods=(),
                step_started_at=None, analysis_started_at=None, after_rollback=None, message=msg,
            )

    # Level-based pushes: every reachable pod not on its desired version.
    desired = desired_versions(status=s, pods=obs.pods, sticky_header=spec.sticky_header)
    for name, gate in sorted(desired.items()):
        p = by_name[name]
        if p.reachable and p.version != gate.version:
            acts.append(PushGate(pod=name, gate=gate))

    # A run still open when the step stopped being analysed (abort, pause, newer spec, promote,
    # re-verify) is closed as Terminated, with the reason.
    if s.analysis_runs and s.analysis_runs[-1].phase == RunPhase.RUNNING and s.phase != Phase.ANALYSING:
        closed = runs.finish(s.analysis_runs[-1], RunPhase.TERMINATED, f"{s.reason}: {s.message}", now=now)
        s = dataclasses.replace(s, analysis_runs=(*s.analysis_runs[:-1], closed))
    s = dataclasses.replace(
        s,
        pod_versions={p.name: p.version for p in obs.pods if p.version is not None},
        instances=len(obs.pods),
        history=record_stable(s.history, stable=s.stable, now=now, reason=s.reason),
    )
    s = dataclasses.replace(
        s, conditions=conditions(status=s, target_version=target.version, previous=status.conditions, now=now))
    return Decision(status=s, actions=tuple(acts))


def _not_at_desired(s: RolloutStatus, pods: Sequence[PodObservation]) -> list[str]:
    """Pods of the step that do not yet run their desired version (unreachable canary pods count)."""
    assert s.canary is not None and s.stable is not None
    canary = canary_gate(s)
    assert canary is not None
    chosen = set(s.canary_pods)
    waiting = []
    for p in pods:
        if p.name in chosen:
            if p.version != canary.version:
                waiting.append(p.name)
        elif p.reachable and p.version != s.stable.version:
            # A stable pod still on an older canary (superseded, or step shrank on restart).
            waiting.append(p.name)
    return waiting


def _running_text(s: RolloutStatus, chosen: Sequence[str], pods: Sequence[PodObservation]) -> str:
    assert s.canary is not None
    if s.strategy == Strategy.REQUESTS:
        return (f"all {len(pods)} instances hold {s.canary.version} for "
                f"{request_canary.weight_of(s.step_percent):g} of requests")
    return f"{len(chosen)} of {len(pods)} instances run {s.canary.version}"


def _current_run(s: RolloutStatus, *, spec: RolloutSpec, now: float) -> AnalysisRun:
    """The open run of the step under analysis (a new one when status has none, e.g. written by an
    operator that predates runs)."""
    assert s.canary is not None and s.step is not None
    last = s.analysis_runs[-1] if s.analysis_runs else None
    if last is not None and last.phase == RunPhase.RUNNING and last.step == s.step + 1 \
            and last.canary_version == s.canary.version:
        return last
    return runs.new_run(spec.checks, step=s.step + 1, percent=spec.steps[s.step], canary_version=s.canary.version,
                        now=s.analysis_started_at if s.analysis_started_at is not None else now)


def _track_window(s: RolloutStatus, *, obs: Observations) -> tuple[RolloutStatus, str]:
    """Follow the builtin provider's data window; a window that begins later than the recorded
    one (an operator restart lost the direct scrape's start snapshots) starts over: the data
    before it is gone, so the full analysisInterval is counted again from its start."""
    note = ""
    if obs.window_from is None:
        return s, note
    if s.window_from is None or abs(obs.window_from - s.window_from) > 0.01:
        if s.window_from is not None:
            note = (f"; analysis window restarted at {_iso(obs.window_from)} (its data since "
                    f"{_iso(s.window_from)} is gone, e.g. an operator restart)")
        s = dataclasses.replace(s, window_from=obs.window_from, window_samples=0)
    if obs.canary_metrics is not None:
        s = dataclasses.replace(s, window_samples=s.window_samples + 1)
    return s, note


def _builtin(run: AnalysisRun, check: CheckSpec, *, result: AnalysisResult | None, covered_s: float,
             spec: RolloutSpec, now: float) -> AnalysisRun:
    """The builtin check as before runs existed: fail fast; pass on a full window that passes;
    thin traffic keeps observing. A dry-run builtin records whatever the full window says."""
    cur = run.check(check.name)
    if result is None or (cur is not None and cur.phase != RunPhase.RUNNING):
        return run
    full = covered_s >= spec.analysis_interval_s
    if result.verdict == Verdict.FAIL:
        phase = MeasurementPhase.FAILED
    elif full and result.verdict == Verdict.PASS:
        phase = MeasurementPhase.SUCCESSFUL
    elif full and check.dry_run:
        phase = MeasurementPhase.INCONCLUSIVE
    else:
        return run
    m = Measurement(phase=phase, at=now, values={c.name: c.value for c in result.checks}, message=result.message)
    run = runs.record(run, check, m, decide=False)
    return runs.set_check_phase(run, check.name, RunPhase(phase.value), result.message)


def _judge_step(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float, percent: int,
                acts: list[Action]) -> RolloutStatus:
    """Analysing, pods in place: record this tick's measurements and decide the step."""
    assert s.canary is not None and s.step is not None
    run = _current_run(s, spec=spec, now=now)
    for check in spec.checks:
        if check.provider != Provider.BUILTIN and check.name in obs.measurements:
            run = runs.record(run, check, runs.judge(check, obs.measurements[check.name], now=now))
    result: AnalysisResult | None = None
    note = ""
    builtin = spec.builtin
    covered = now - (s.analysis_started_at or now)
    if builtin is not None:
        s, note = _track_window(s, obs=obs)
        if s.window_from is not None:
            covered = now - max(s.window_from, s.analysis_started_at or s.window_from)
        result = _analyse(s, spec=spec, obs=obs, now=now)
        if result is not None:
            s = dataclasses.replace(s, last_analysis=result.to_status())
        run = _builtin(run, builtin, result=result, covered_s=covered, spec=spec, now=now)
    verdict, why = runs.run_phase(run, spec.checks)
    step_text = f"step {s.step + 1} ({percent}%)"
    if verdict == RunPhase.FAILED:
        run = runs.finish(run, verdict, why, now=now)
        s = dataclasses.replace(s, analysis_runs=_replace_run(s, run))
        return _fail(s, spec=spec, reason="AnalysisFailed", message=f"{step_text} analysis {why}", acts=acts)
    if verdict == RunPhase.INCONCLUSIVE:
        run = runs.finish(run, verdict, why, now=now)
        msg = (f"{step_text} analysis inconclusive, rollout paused: {why}; promote to continue, retry to analyse "
               f"the step again, abort to roll back")
        acts.append(EmitEvent("Warning", "AnalysisInconclusive", msg))
        return dataclasses.replace(
            s, phase=Phase.PAUSED, analysis_paused=True, analysis_started_at=None, reason="AnalysisInconclusive",
            message=msg, analysis_runs=_replace_run(s, run))
    if verdict == RunPhase.SUCCESSFUL:
        run = runs.finish(run, verdict, why, now=now)
        s = dataclasses.replace(s, analysis_runs=_replace_run(s, run))
        summary = result.message if result is not None and builtin is not None and not builtin.dry_run else why
        acts.append(RecordStep(percent, now - (s.step_started_at or now)))
        if s.step == len(spec.steps) - 1:
            msg = f"{s.canary.version} promoted: {summary}"
            acts += [EmitEvent("Normal", "Promoted", msg), RecordOutcome("succeeded")]
            return _promote_fully(s, spec=spec, reason="Promoted", message=msg)
        s = _advance_step(s, spec=spec, obs=obs, step=s.step + 1, now=now)
        s = dataclasses.replace(s, reason="StepPromoted")
        acts.append(EmitEvent("Normal", "StepPromoted", f"{summary}; {s.message}"))
        return s
    if builtin is not None:
        verdict_text = "waiting for metrics" if result is None else result.message
        progress = f"analysing {covered:.0f}/{spec.analysis_interval_s:g}s: {verdict_text}"
    else:
        progress = f"analysing: {why}"
    return dataclasses.replace(s, analysis_runs=_replace_run(s, run),
                               message=f"step {s.step + 1}/{len(spec.steps)} ({percent}%): {progress}{note}")


def _is_last(s: RolloutStatus, run: AnalysisRun) -> bool:
    last = s.analysis_runs[-1] if s.analysis_runs else None
    return last is not None and last.step == run.step and last.started_at == run.started_at \
        and last.canary_version == run.canary_version


def _replace_run(s: RolloutStatus, run: AnalysisRun) -> tuple[AnalysisRun, ...]:
    """status.analysisRuns with ``run`` as its newest entry (replacing it when it is the open one)."""
    if _is_last(s, run):
        return (*s.analysis_runs[:-1], run)
    return (*s.analysis_runs, run)[-runs.RUN_HISTORY:]


def _analyse(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float) -> AnalysisResult | None:
    if obs.canary_metrics is None:
        return None
    thr = thresholds(
        calibration=spec.calibration, qps_samples=s.qps_samples, error_samples=s.error_samples, now=now
    )
    # The canary's expected share of the traffic: of the pods (instances), or of every pod's
    # requests (requests).
    share = request_canary.weight_of(s.step_percent) if s.strategy == Strategy.REQUESTS \
        else len(s.canary_pods) / max(1, len(obs.pods))
    return analyse(
        canary=obs.canary_metrics,
        stable=obs.stable_metrics,
        thresholds=thr,
        canary_share=share,
        sla_p99_ms=spec.sla_p99_ms,
        max_drift=spec.max_drift,
        min_requests=spec.min_requests,
        max_quality_drop=spec.max_quality_drop,
    )
