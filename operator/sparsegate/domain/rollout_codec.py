"""The rollout's persisted shapes: the GateConfig spec it reads and the status it writes.

:func:`parse_spec` turns ``spec`` (``params`` and the ``rollout`` block) into a
:class:`RolloutSpec`, raising :class:`SpecError` that names the field; :class:`RolloutStatus`
reads and writes every field the rollout keeps in ``status`` (``stable``, ``history``,
``analysisRuns``, ``conditions`` and the ``rollout`` block), so a restarted operator resumes
from it. :class:`Revision` and :func:`record_stable` keep ``status.history`` (the versions that
became stable, the targets of ``kubectl sparsegate undo``). No transitions here: the state
machine that moves between phases is :mod:`sparsegate.domain.rollout`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sparsegate_contracts import gate as gatedoc

from sparsegate.domain import analysis_run as runs
from sparsegate.domain import request_canary
from sparsegate.domain.analysis_run import BUILTIN_CHECK, AnalysisRun, CheckSpec, Provider
from sparsegate.domain.calibration import Calibration, parse_calibration, parse_duration
from sparsegate.domain.request_canary import Strategy

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


class Phase(str, enum.Enum):
    PENDING = "Pending"
    # Spec seen, nothing recorded yet (before the first reconcile writes status.stable).
    PROGRESSING = "Progressing"
    # Pushing the current step's version to its pods; waiting until each reports it.
    ANALYSING = "Analysing"
    # Every pod of the step runs the canary version; live metrics are judged for the window.
    PAUSED = "Paused"
    # spec.rollout.paused, or an inconclusive analysis (analysisPaused): the current step is held as
    # is, nothing pushed or promoted.
    SUCCEEDED = "Succeeded"
    # Resting: every pod runs status.stable (the new version was promoted, or the first one).
    ROLLING_BACK = "RollingBack"
    # Pushing the stable version back to canary pods (analysis failed, abort or spec reverted).
    ROLLED_BACK = "RolledBack"
    # Resting after an automatic rollback; the failed version is not retried until spec changes or
    # the retry annotation asks for it.
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
    def from_status(cls, raw: Any) -> GateVersion | None:
        """None when absent or not a gate document (``status.rollout.canary`` is free-form: a hand edit)."""
        if not isinstance(raw, Mapping) or not raw.get("version") or not isinstance(raw["version"], str):
            return None
        params = raw.get("params")
        checksum = raw.get("checksum")
        return cls(version=raw["version"], checksum=checksum if isinstance(checksum, str) else "",
                   params=dict(params) if isinstance(params, Mapping) else {})

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


def iso_time(t: float | None) -> str | None:
    """Epoch seconds as the RFC 3339 time status holds (milliseconds, Z)."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def epoch_time(s: object) -> float | None:
    """An RFC 3339 time of the status as Unix seconds; None when absent or not a time. The status
    keeps unknown fields and ``promotedAt`` is free text, so a hand edit ("yesterday", a number)
    must read as missing, not raise on every tick (and in every plugin command)."""
    if not s or not isinstance(s, str):
        return None
    try:
        parsed = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:  # what the operator writes carries "Z": read one without as UTC
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


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
        return cls(revision=raw["revision"], gate=gate, promoted_at=epoch_time(raw.get("promotedAt")),
                   reason=raw.get("reason") or "")

    def to_status(self) -> dict[str, Any]:
        out = {"revision": self.revision, **self.gate.document(), "promotedAt": iso_time(self.promoted_at),
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
    # (phase, reason, message) an invalid spec interrupted: restored once the spec is valid again,
    # so an abort, a rejection, a pause or a failed analysis is not forgotten on the way.
    before_invalid_spec: tuple[Phase, str, str] | None = None
    # One-shot requests (the Observations fields abort, promote, promote_step, retry) whose effect
    # this status holds while their annotations may still be on the object: status is written
    # before they are cleared, so a clear that did not land (an API error, a crash or a lost Lease
    # in between) must not make the next tick act on them a second time (domain.rollout).
    consumed_requests: tuple[str, ...] = ()
    # Request annotations left in place (an applier declares them: Git puts one back whenever it is
    # cleared), as (annotation, value) acted on once: the same value again is not a new request.
    handled_requests: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_status(cls, raw: Mapping[str, Any] | None) -> RolloutStatus:
        """Read GateConfig ``status`` (``stable``, ``history``, ``conditions``, the ``rollout`` block)."""
        # Most of status.rollout is free-form in the CRD (x-kubernetes-preserve-unknown-fields): a
        # field of the wrong type (``kubectl edit --subresource=status``) reads as missing rather than
        # raising on every tick; an in-flight phase without its canary or a valid step index is then
        # reported and started over (domain.rollout's InvalidStatus).
        raw = raw if isinstance(raw, Mapping) else {}
        ro = _mapping(raw.get("rollout"))
        phase = _text(ro.get("phase"))
        after = _text(ro.get("afterRollback"))
        calibration = _mapping(ro.get("calibration"))
        window = _mapping(ro.get("analysisWindow"))
        step = _count(ro.get("stepIndex"))
        return cls(
            phase=Phase(phase) if phase in Phase._value2member_map_ else Phase.PENDING,
            stable=GateVersion.from_status(raw.get("stable")),
            canary=GateVersion.from_status(ro.get("canary")),
            step=step,
            step_percent=_count(ro.get("canaryPercent")),
            canary_pods=tuple(p for p in _items(ro.get("canaryPods")) if isinstance(p, str)),
            pod_versions={k: v for k, v in _mapping(ro.get("podVersions")).items() if isinstance(v, str)},
            instances=_count(ro.get("instances")) or 0,
            step_started_at=epoch_time(ro.get("stepStartedAt")),
            analysis_started_at=epoch_time(ro.get("analysisStartedAt")),
            after_rollback=Phase(after) if after in Phase._value2member_map_ else None,
            rejected_version=_text(ro.get("rejectedVersion")),
            promote=ro.get("promote") is True,  # not bool("false"): a promote skips every analysis
            reason=_text(ro.get("reason")) or "",
            message=_text(ro.get("message")) or "",
            last_analysis=ro.get("analysis") if isinstance(ro.get("analysis"), Mapping) else None,
            qps_samples=_samples(calibration.get("qps")),
            error_samples=_samples(calibration.get("errorRate")),
            conditions=tuple(c for c in _items(raw.get("conditions")) if isinstance(c, Mapping)),
            history=tuple(r for r in (Revision.from_status(x) for x in _items(raw.get("history"))
                                      if isinstance(x, Mapping)) if r),
            analysis_runs=tuple(r for r in (AnalysisRun.from_status(x) for x in _items(raw.get("analysisRuns"))
                                            if isinstance(x, Mapping)) if r),
            analysis_paused=ro.get("analysisPaused") is True,
            window_from=epoch_time(window.get("from")),
            window_samples=_count(window.get("samples")) or 0,
            strategy=Strategy(ro["strategy"]) if _text(ro.get("strategy")) in Strategy._value2member_map_ else None,
            before_invalid_spec=_interrupted(ro.get("beforeInvalidSpec")),
            consumed_requests=tuple(r for r in _items(ro.get("consumedRequests")) if isinstance(r, str)),
            handled_requests=tuple(sorted(
                (k, v) for k, v in (ro.get("handledRequests") or {}).items() if isinstance(v, str)
            )) if isinstance(ro.get("handledRequests"), dict) else (),
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
            "stepStartedAt": iso_time(self.step_started_at),
            "analysisStartedAt": iso_time(self.analysis_started_at),
            "afterRollback": self.after_rollback.value if self.after_rollback else None,
            "rejectedVersion": self.rejected_version,
            "beforeInvalidSpec": {"phase": self.before_invalid_spec[0].value, "reason": self.before_invalid_spec[1],
                                  "message": self.before_invalid_spec[2]} if self.before_invalid_spec else None,
            "promote": self.promote,
            "consumedRequests": list(self.consumed_requests) or None,
            "handledRequests": dict(self.handled_requests) or None,
            "analysisPaused": self.analysis_paused or None,
            "analysisWindow": {"from": iso_time(self.window_from), "samples": self.window_samples}
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


def _mapping(raw: Any) -> Mapping[str, Any]:
    return raw if isinstance(raw, Mapping) else {}


def _items(raw: Any) -> Sequence[Any]:
    return raw if isinstance(raw, list | tuple) else ()


def _text(raw: Any) -> str | None:
    return raw if isinstance(raw, str) else None


def _count(raw: Any) -> int | None:
    """A non-negative integer of the status (a step index, a percent, a count); None otherwise."""
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None


def _samples(raw: Any) -> tuple[tuple[float, float], ...]:
    """Calibration samples, [time, value] pairs of numbers; anything else is dropped."""
    return tuple((float(x[0]), float(x[1])) for x in _items(raw)
                 if isinstance(x, list | tuple) and len(x) == 2
                 and all(isinstance(v, int | float) and not isinstance(v, bool) for v in x))


def _interrupted(raw: Any) -> tuple[Phase, str, str] | None:
    if not isinstance(raw, Mapping) or raw.get("phase") not in Phase._value2member_map_:
        return None
    return Phase(raw["phase"]), str(raw.get("reason") or ""), str(raw.get("message") or "")
