"""Progressive rollout of GateConfig changes, as pure state transitions.

``next_action(spec=, status=, obs=, now=) -> Decision(status, actions)`` is the
whole controller logic (after Argo Rollouts' ``CalculateRolloutPhase``): it reads
the parsed spec, the persisted status and what the controller just observed (pod
versions from ``/healthz``, one-shot annotations, windowed metrics) and returns
the next status plus side effects for the controller (``controllers.rollout``) to
perform. No I/O here.

Why it is crash-safe: every bit of rollout state lives in ``status``, and pushes
are *level-based*: each tick derives the version every pod should run from
``status`` (:func:`desired_versions`) and pushes only to pods whose reported
version differs. A restarted operator observes the pods again, so work already
done is never repeated and the stable version is never lost (it only changes on
promotion). The controller persists the returned status before performing the
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
    any ─promote annotation of no accepted value ("false", "")─▶ unchanged (refused: Warning Event)
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
version's params back into the spec. The spec and status shapes (parsing, the status document,
the history) are :mod:`sparsegate.domain.rollout_codec`'s; the conditions (kstatus' ``Ready``,
``Reconciling``, ``Stalled`` that Flux and kpt read, plus ``Progressing`` and ``Degraded``) are
:mod:`sparsegate.domain.rollout_conditions`'.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparsegate_contracts.names import ABORT_ANNOTATION, PROMOTE_ANNOTATION, RETRY_ANNOTATION

from sparsegate.domain import analysis_run as runs
from sparsegate.domain import request_canary
from sparsegate.domain.analysis import AnalysisResult, GroupMetrics, Verdict, analyse
from sparsegate.domain.analysis_run import (
    AnalysisRun,
    CheckSpec,
    Measured,
    Measurement,
    MeasurementPhase,
    Provider,
    RunPhase,
)
from sparsegate.domain.calibration import add_sample, thresholds
from sparsegate.domain.request_canary import GateSetTarget, Strategy
from sparsegate.domain.rollout_codec import (
    ACTIVE_PHASES,
    DEFAULT_ANALYSIS_INTERVAL_S,
    DEFAULT_MAX_DRIFT,
    DEFAULT_MAX_QUALITY_DROP,
    DEFAULT_MIN_REQUESTS,
    DEFAULT_PROGRESS_DEADLINE_S,
    DEFAULT_SLA_P99_MS,
    DEFAULT_STEPS,
    HISTORY_LIMIT,
    RESTING_PHASES,
    GateVersion,
    Phase,
    Revision,
    RolloutSpec,
    RolloutStatus,
    SpecError,
    iso_time,
    parse_spec,
    record_stable,
)
from sparsegate.domain.rollout_conditions import CONDITION_ORDER, conditions, kstatus_conditions

# The spec/status codec and the conditions are defined in their own modules; importers of this
# one (the controller, the kubectl plugin, tests) keep reading them from here.
__all__ = [
    "ABORT_ANNOTATION", "ACTIVE_PHASES", "CONDITION_ORDER", "DEFAULT_ANALYSIS_INTERVAL_S", "DEFAULT_MAX_DRIFT",
    "DEFAULT_MAX_QUALITY_DROP", "DEFAULT_MIN_REQUESTS", "DEFAULT_PROGRESS_DEADLINE_S", "DEFAULT_SLA_P99_MS",
    "DEFAULT_STEPS", "HISTORY_LIMIT", "PROMOTE_ANNOTATION", "PROMOTE_FULL_VALUES", "PROMOTE_STEP_VALUE",
    "RESTING_PHASES", "RETRY_ANNOTATION", "Action", "ClearAnnotation", "Decision", "EmitEvent", "GateSetTarget",
    "GateVersion", "Observations", "Phase", "PodObservation", "PushGate", "RecordOutcome", "RecordStep", "Revision",
    "RolloutSpec", "RolloutStatus", "SpecError", "Strategy", "annotation_requests", "canary_gate", "conditions",
    "declared_requests", "pending_requests", "request_values",
    "desired_versions", "in_flight", "instances_for", "invalid_spec", "is_step_promote", "kstatus_conditions",
    "promote_kind",
    "next_action",
    "parse_spec",
    "record_stable", "select_canary_pods",
]

# PROMOTE_ANNOTATION's values (any case, blanks around ignored): "step" promotes one step; "full"
# (what `kubectl sparsegate promote --full` writes), "now" (the documented
# `sparsegate.dev/promote=now`) or "all" promote to all instances. Each may carry a "-<anything>"
# suffix, so a request held in Git gets a new value per rollout (`now-2026-12-07`). Any other value
# ("false", "no", "", a typo) is refused: not acted on, a Warning Event names it. A full promote
# skips every remaining analysis, so it is never what an unrecognised value means.
PROMOTE_STEP_VALUE = "step"
PROMOTE_FULL_VALUES = ("full", "now", "all")


# ---------------------------------------------------------------- observations and actions


@dataclass(frozen=True)
class PodObservation:
    name: str
    reachable: bool  # has an IP and answered /healthz
    version: str | None  # gateVersion reported by /healthz (None when unreachable)
    # Has an IP: its server may have run and been pushed a gate. A pod without one (Pending) has
    # served nothing and starts from the gate ConfigMap (the stable version) when it does.
    addressed: bool = True


@dataclass(frozen=True)
class Observations:
    pods: tuple[PodObservation, ...] = ()
    abort: bool = False
    promote: bool = False  # to all instances at once
    promote_step: bool = False  # to the next step, skipping the current step's analysis
    promote_refused: bool = False  # a promote annotation of no accepted value: not acted on, a Warning
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
    # Why the builtin check's provider answered nothing this tick (e.g. Prometheus unreachable):
    # the step waits for metrics and its message says why.
    builtin_error: str | None = None
    # How many SparseModels use the GateConfig now, pods or none (scaled to 0, or their Deployment
    # being replaced): a step whose pods all went while models remain waits for pods to come back
    # rather than promoting a version no pod has been judged on.
    models: int = 0
    # The request annotations present (annotation -> value), and those of them an applier declares
    # (:func:`declared_requests`): such a one acts once per value and is left in place.
    request_values: Mapping[str, str] = field(default_factory=dict)
    declared: frozenset[str] = frozenset()
    # Pods refuse the document they are to hold (a pod's 4xx answer to its push, kept while the
    # push backs off: ``controllers.rollout``): (reason, message) for the conditions; None: none do.
    push_refused: tuple[str, str] | None = None


_REQUEST_ANNOTATIONS = (ABORT_ANNOTATION, PROMOTE_ANNOTATION, RETRY_ANNOTATION)
_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def request_values(annotations: Mapping[str, str] | None) -> dict[str, str]:
    """The one-shot request annotations present, annotation -> value."""
    annotations = annotations or {}
    return {a: str(annotations[a]) for a in _REQUEST_ANNOTATIONS if a in annotations}


def declared_requests(metadata: Mapping[str, Any] | None) -> frozenset[str]:
    """The request annotations an applier declares: named in kubectl's last-applied copy (``kubectl
    apply``, Argo CD's default sync) or owned by a server-side apply (Flux, Argo CD with
    ServerSideApply, ``kubectl apply --server-side``). Cleared, such an annotation is put back by the
    next sync (Argo CD self-heal, Flux's interval), so it is left in place and acts once per value."""
    meta = metadata if isinstance(metadata, Mapping) else {}
    out: set[str] = set()
    last = (meta.get("annotations") or {}).get(_LAST_APPLIED)
    if isinstance(last, str):
        try:
            applied = json.loads(last)
        except ValueError:
            applied = None
        ann = ((applied.get("metadata") if isinstance(applied, dict) else None) or {})
        ann = ann.get("annotations") if isinstance(ann, dict) else None
        if isinstance(ann, dict):
            out.update(a for a in _REQUEST_ANNOTATIONS if a in ann)
    for entry in meta.get("managedFields") or ():
        if not isinstance(entry, Mapping) or entry.get("operation") != "Apply":
            continue
        owned = ((entry.get("fieldsV1") or {}).get("f:metadata") or {})
        owned = owned.get("f:annotations") if isinstance(owned, Mapping) else None
        if isinstance(owned, Mapping):
            out.update(a for a in _REQUEST_ANNOTATIONS if f"f:{a}" in owned)
    return frozenset(out)


def pending_requests(annotations: Mapping[str, str] | None, status: RolloutStatus) -> dict[str, bool]:
    """:func:`annotation_requests`, less those left in place whose value the status already handled."""
    handled = dict(status.handled_requests)
    present = request_values(annotations)
    return annotation_requests({a: v for a, v in present.items() if handled.get(a) != v})


def promote_kind(value: str) -> str | None:
    """What a ``sparsegate.dev/promote`` value asks for: ``"step"`` (one step), ``"full"`` (every
    remaining step) or None (no accepted value: refused). See :data:`PROMOTE_FULL_VALUES`."""
    word = value.strip().lower().split("-", 1)[0]
    if word == PROMOTE_STEP_VALUE:
        return "step"
    return "full" if word in PROMOTE_FULL_VALUES else None


def is_step_promote(value: str) -> bool:
    """Whether a ``sparsegate.dev/promote`` value asks for one step (``step``, any case, blanks
    around it ignored, a ``-<anything>`` suffix allowed) rather than every remaining step."""
    return promote_kind(value) == "step"


def annotation_requests(annotations: Mapping[str, str] | None) -> dict[str, bool]:
    """The one-shot requests in a GateConfig's annotations, as :class:`Observations` fields."""
    annotations = annotations or {}
    promote = annotations.get(PROMOTE_ANNOTATION)
    # "Step", " step\n" (a hand-typed or YAML block value) mean one step too. A full promote skips
    # every remaining analysis, so only its own words ask for it: "false", "" or a typo is refused.
    kind = None if promote is None else promote_kind(str(promote))
    return {
        "abort": ABORT_ANNOTATION in annotations,
        "promote": kind == "full",
        "promote_step": kind == "step",
        "promote_refused": promote is not None and kind is None,
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




# ---------------------------------------------------------------- transitions


def _start(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float, reason: str) -> RolloutStatus:
    percent = spec.steps[0]
    # Chosen once per rollout and kept in status (a precisionPolicy change runs pod by pod).
    strategy, why = request_canary.strategy_for(spec.strategy, stable=s.stable, canary=spec.target)
    chosen = _choose(strategy, pods=obs.pods, percent=percent, previous=s.canary_pods,
                     canary_version=spec.target.version)
    return dataclasses.replace(
        s,
        phase=Phase.PAUSED if spec.paused else Phase.PROGRESSING,
        strategy=strategy,
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
        f"step 1/{len(spec.steps)} ({_step_text(strategy, percent=percent, chosen=chosen, pods=obs.pods)})"
        + (f"; {why}" if why else ""),
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


def _set_stable(s: RolloutStatus, gate: GateVersion, *, reason: str, message: str,
                phase: Phase = Phase.SUCCEEDED) -> RolloutStatus:
    """The one place that sets ``status.stable``: the first version (:func:`_initialize`) and every
    promotion (:func:`_promote_fully`) come to rest here, in Succeeded (a stable version a status
    lost, restored from its history, keeps the phase). ``status.history`` follows ``stable`` in
    :func:`_bookkeeping`; the codec only reads and writes what is set here."""
    return dataclasses.replace(s, phase=phase, stable=gate, reason=reason, message=message)


def _promote_fully(s: RolloutStatus, *, spec: RolloutSpec, reason: str, message: str) -> RolloutStatus:
    """The canary becomes stable (Succeeded); the finished rollout's step fields are cleared."""
    assert s.canary is not None
    canary = s.canary
    s = dataclasses.replace(
        s,
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
    )
    return _set_stable(s, canary, reason=reason, message=message)


def _advance_step(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, step: int, now: float) -> RolloutStatus:
    percent = spec.steps[step]
    chosen = _choose(s.strategy, pods=obs.pods, percent=percent, previous=s.canary_pods,
                     canary_version=s.canary.version if s.canary else None)
    if not obs.pods and obs.models:
        chosen = s.canary_pods  # the pods are gone for now: :func:`_progressing` waits for them
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
    """A spec that cannot be parsed: Failed, nothing pushed (pods keep what they run); the phase it
    interrupted is kept in status for when the spec is valid again."""
    before = status.before_invalid_spec
    if not (status.phase == Phase.FAILED and status.reason == "InvalidSpec"):
        before = (status.phase, status.reason, status.message)
    s = dataclasses.replace(status, phase=Phase.FAILED, reason="InvalidSpec", message=error,
                            before_invalid_spec=before)
    s = dataclasses.replace(
        s, conditions=conditions(status=s, target_version=None, previous=status.conditions, now=now)
    )
    acts: tuple[Action, ...] = ()
    if status.reason != "InvalidSpec" or status.message != error:
        acts = (EmitEvent("Warning", "InvalidSpec", error),)
    return Decision(status=s, actions=acts)


def next_action(*, spec: RolloutSpec, status: RolloutStatus, obs: Observations, now: float) -> Decision:
    """One reconcile step: (spec, status, observations, now) → (new status, actions).

    The same stages every tick, in this order: consume the one-shot annotations; adopt the first
    stable version; follow the spec (steps edited, a spec valid again, retry, a new, reverted or
    superseding version); abort and promote requests; pause and resume; calibration samples; the
    work of the phase the status is now in (:data:`_PHASE_WORK`); level-based pushes; bookkeeping.
    """
    # Request annotations left in place (an applier declares them, or this status handled their
    # value): Git puts a cleared one back, so the same value is acted on once and never cleared.
    handled = dict(status.handled_requests)
    kept = {a: v for a, v in obs.request_values.items() if a in obs.declared or handled.get(a) == v}
    repeated = {a for a, v in kept.items() if handled.get(a) == v}
    obs = dataclasses.replace(obs, **{r: False for r in _REQUESTS if _ANNOTATION_OF[r] in repeated})
    acts: list[Action] = [ClearAnnotation(name) for name in _consumed(obs) if name not in kept]
    requested = tuple(r for r in _REQUESTS if getattr(obs, r) and _ANNOTATION_OF[r] not in kept)
    # A request this status already acted on whose annotation is still there (its clear did not
    # land) is cleared again, not acted on again: a step promote would otherwise skip two steps.
    obs = dataclasses.replace(obs, **{r: False for r in requested if r in status.consumed_requests})
    if obs.promote_refused:
        value = obs.request_values.get(PROMOTE_ANNOTATION)
        acts.append(EmitEvent("Warning", "PromoteRefused", _promote_refused(value)))
    s = _initialize(status, target=spec.target, acts=acts)
    s = _follow_spec(s, spec=spec, obs=obs, now=now, acts=acts)
    s = _requests(s, spec=spec, obs=obs, now=now, acts=acts)
    s = _pause_or_resume(s, spec=spec, now=now, acts=acts)
    s = _sample_calibration(s, spec=spec, obs=obs, now=now)
    work = _PHASE_WORK.get(s.phase)
    if work is not None:
        s = work(s, spec=spec, obs=obs, now=now, acts=acts)
    unusable = next((a.message for a in acts if isinstance(a, EmitEvent) and a.reason == "InvalidStatus"), None)
    if unusable and not s.message.startswith(unusable):
        # Started over in the same tick: this tick's conditions still say why.
        s = dataclasses.replace(s, reason="InvalidStatus", message=f"{unusable}; {s.message}")
    acts += _pushes(s, spec=spec, obs=obs)
    s = dataclasses.replace(s, consumed_requests=requested, handled_requests=tuple(sorted(kept.items())))
    return Decision(status=_bookkeeping(s, previous=status, target=spec.target, obs=obs, now=now),
                    actions=tuple(acts))


def in_flight(s: RolloutStatus) -> bool:
    """A canary version is out (being pushed, analysed, held, or failed with autoRollback off)."""
    return s.canary is not None and (s.phase in ACTIVE_PHASES or s.phase == Phase.FAILED)


# The one-shot requests, as Observations fields (status.rollout.consumedRequests names them).
_REQUESTS = ("abort", "promote", "promote_step", "promote_refused", "retry")
_ANNOTATION_OF = {"abort": ABORT_ANNOTATION, "promote": PROMOTE_ANNOTATION, "promote_step": PROMOTE_ANNOTATION,
                  "promote_refused": PROMOTE_ANNOTATION, "retry": RETRY_ANNOTATION}


def _promote_refused(value: str | None) -> str:
    full = ", ".join(f"'{w}'" for w in PROMOTE_FULL_VALUES)
    return (f"{PROMOTE_ANNOTATION}={value!r} refused, not acted on: accepted values are '{PROMOTE_STEP_VALUE}' "
            f"(the next step) and {full} (every remaining step), each optionally followed by '-<anything>'")


def _consumed(obs: Observations) -> list[str]:
    """One-shot annotations are cleared whatever the phase; their effect is recorded in status."""
    out = []
    if obs.abort:
        out.append(ABORT_ANNOTATION)
    if obs.promote or obs.promote_step or obs.promote_refused:
        out.append(PROMOTE_ANNOTATION)  # a refused value too: the request is answered (an Event), not kept
    if obs.retry:
        out.append(RETRY_ANNOTATION)
    return out


def _initialize(s: RolloutStatus, *, target: GateVersion, acts: list[Action]) -> RolloutStatus:
    """First reconcile: the spec's version becomes stable (what new pods start with), unless
    status already records one (e.g. written by an operator version whose SparseModel side set
    it on first sight)."""
    if s.stable is not None and s.phase != Phase.PENDING:
        return s
    if s.stable is None and s.phase != Phase.PENDING:
        # status.stable lost (a hand edit, a tool writing status): adopting the spec's version would
        # make a canary in flight stable on every instance, unanalysed. status.history's last entry
        # is the stable version: it is restored, and the rollout goes on.
        known = s.history[-1].gate if s.history else None
        problem = f"status unusable: status.stable is missing in phase {s.phase.value}; " + (
            f"restored from status.history: {known.version}" if known else
            f"status.history is empty: {target.version} adopted")
        acts.append(EmitEvent("Warning", "InvalidStatus", problem))
        if known is not None:
            return _set_stable(s, known, reason="InvalidStatus", message=problem, phase=s.phase)
    stable = s.stable or target
    s = _set_stable(s, stable, reason="Initialized", message=f"stable version {stable.version}")
    acts.append(EmitEvent("Normal", "Initialized", s.message))
    return s


def _recover_unusable(s: RolloutStatus, *, acts: list[Action]) -> RolloutStatus:
    """A status whose phase needs a canary (and, in flight, a step) that it does not record, e.g.
    edited by hand, cannot be continued: the operator never crashes on it (the transitions below
    rely on both). As for a status whose phase is unknown (read as Pending, then adopted from
    stable), it starts over from stable: an in-flight phase rests in Succeeded (a spec naming
    another version rolls out again from step 1 this tick); a rollback, which needs only the stable
    version, rests where it was headed, so an abort or rejection still holds. Pods follow from the
    new phase (level-based pushes: stable everywhere, or step 1's canary pods). A Warning event
    (reason InvalidStatus) names the missing status field (one of the wrong type or a negative step
    index reads as missing: ``RolloutStatus.from_status``)."""
    if s.phase in ACTIVE_PHASES and s.canary is None:
        missing = "status.rollout.canary"
    elif s.phase in ACTIVE_PHASES and s.step is None:
        missing = "status.rollout.stepIndex"
    elif s.phase == Phase.ROLLING_BACK and s.canary is None:
        missing = "status.rollout.canary"
    else:
        return s
    rest = (s.after_rollback or Phase.ROLLED_BACK) if s.phase == Phase.ROLLING_BACK else Phase.SUCCEEDED
    stable = s.stable.version if s.stable else "-"  # _initialize has adopted one
    problem = (f"status unusable: {missing} is missing or invalid in phase {s.phase.value}; every instance goes "
               f"back to stable {stable}")
    acts.append(EmitEvent("Warning", "InvalidStatus", problem))
    return dataclasses.replace(
        s, phase=rest, canary=None, strategy=None, step=None, step_percent=None, canary_pods=(), step_started_at=None,
        analysis_started_at=None, after_rollback=None, promote=False, analysis_paused=False, window_from=None,
        window_samples=0, reason="InvalidStatus", message=problem)


def _follow_spec(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float,
                 acts: list[Action]) -> RolloutStatus:
    """Steps edited mid-rollout, a spec valid again, retry, then the spec's version itself."""
    if s.step is not None and s.step >= len(spec.steps):
        s = dataclasses.replace(s, step=len(spec.steps) - 1)
    if in_flight(s) and s.step is not None and s.step_percent is not None and s.step_percent != spec.steps[s.step]:
        # The steps were edited: the current step now targets what the spec says (instances
        # chosen, or the weight pushed, anew); an analysis under way judged the old share, so the
        # step is verified again from its start.
        old, percent = s.step_percent, spec.steps[s.step]
        s = dataclasses.replace(s, step_percent=percent)
        if s.phase == Phase.ANALYSING:
            s = dataclasses.replace(s, phase=Phase.PROGRESSING, step_started_at=now, analysis_started_at=None,
                                    window_from=None, window_samples=0, reason="StepsEdited",
                                    message=f"step {s.step + 1}/{len(spec.steps)} now {percent}% (was {old}%)")
        acts.append(EmitEvent("Normal", "StepsEdited", f"step {s.step + 1}/{len(spec.steps)} now targets "
                                                       f"{percent}% (was {old}%)"))
    # A once-invalid spec that is valid again returns to the phase it interrupted (a step under
    # way is verified again from its start; an abort, rejection, pause or failure stands).
    if s.phase == Phase.FAILED and s.reason == "InvalidSpec" and s.before_invalid_spec is not None:
        phase, reason, message = s.before_invalid_spec
        s = dataclasses.replace(s, phase=phase, reason=reason, message=message, before_invalid_spec=None)
        if phase in (Phase.PROGRESSING, Phase.ANALYSING):
            s = dataclasses.replace(s, phase=Phase.PROGRESSING, step_started_at=now, analysis_started_at=None,
                                    window_from=None, window_samples=0, reason="SpecValid")
    elif s.phase == Phase.FAILED and s.reason == "InvalidSpec":  # a status from before it was kept
        if s.canary is not None and s.step is not None:
            s = dataclasses.replace(s, phase=Phase.PROGRESSING, step_started_at=now, reason="SpecValid")
        else:
            s = dataclasses.replace(s, phase=Phase.SUCCEEDED, reason="SpecValid")
    s = _recover_unusable(s, acts=acts)  # as read, or as restored above
    s, retried = _retry(s, spec=spec, obs=obs, now=now, acts=acts)
    return _follow_version(s, spec=spec, obs=obs, now=now, acts=acts, retried=retried)


def _retry(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float,
           acts: list[Action]) -> tuple[RolloutStatus, bool]:
    """Forget the rejection of the version the spec still names (:func:`_follow_version` then rolls it
    out from step 1; True is returned), or send a step whose analysis failed (autoRollback off) or
    was inconclusive back to work, analysed again from the start."""
    if not obs.retry:
        return s, False
    if s.phase in (Phase.ROLLED_BACK, Phase.ABORTED) and s.rejected_version == spec.target.version:
        return dataclasses.replace(s, rejected_version=None), True
    if (s.phase == Phase.FAILED or (s.phase == Phase.PAUSED and s.analysis_paused)) \
            and s.canary is not None and s.step is not None:
        s = dataclasses.replace(s, phase=Phase.PROGRESSING, step_started_at=now, analysis_started_at=None,
                                analysis_paused=False, window_from=None, window_samples=0,
                                reason="Retried", message=f"retrying step {s.step + 1}/{len(spec.steps)}")
        acts.append(EmitEvent("Normal", "Retried", s.message))
    return s, False


def _follow_version(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float, acts: list[Action],
                    retried: bool) -> RolloutStatus:
    """The spec names stable again (revert), a third version (supersede), or a new one (start).

    A rejected (rolled back or aborted) version is not rolled out again while the spec still asks
    for it: once the spec names another, the rejection is forgotten, and it holds only at rest in
    RolledBack or Aborted (a status from before this rule may carry a stale one elsewhere)."""
    target = spec.target
    if s.rejected_version is not None and target.version != s.rejected_version:
        s = dataclasses.replace(s, rejected_version=None)
    if in_flight(s) or s.phase == Phase.ROLLING_BACK:
        assert s.canary is not None and s.stable is not None
        if target.version == s.stable.version and in_flight(s):
            msg = f"spec reverted to stable {s.stable.version}: rolling back {s.canary.version}"
            acts += [EmitEvent("Normal", "Reverted", msg), RecordOutcome("reverted")]
            return _rollback(s, after=Phase.SUCCEEDED, reason="Reverted", message=msg, reject=False)
        if target.version not in (s.canary.version, s.stable.version):
            old = s.canary.version
            s = _start(s, spec=spec, obs=obs, now=now, reason="Superseded")
            acts += [EmitEvent("Normal", "Superseded", f"{old} superseded by {target.version}; {s.message}"),
                     RecordOutcome("superseded")]
        return s
    if s.stable is not None and target.version != s.stable.version and not rejection_holds(s, target.version):
        s = _start(s, spec=spec, obs=obs, now=now, reason="Retried" if retried else "RolloutStarted")
        acts.append(EmitEvent("Normal", s.reason, s.message))
    return s


def rejection_holds(s: RolloutStatus, target_version: str) -> bool:
    """The spec's version was rolled back or aborted and the rollout rests there."""
    return s.rejected_version == target_version and s.phase in (Phase.ROLLED_BACK, Phase.ABORTED)


def _requests(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float,
              acts: list[Action]) -> RolloutStatus:
    """Abort and promote (one-shot annotations), for a rollout in flight."""
    if not in_flight(s):
        return s
    assert s.canary is not None and s.stable is not None
    last = len(spec.steps) - 1
    if obs.abort:
        msg = f"aborted by annotation: rolling back {s.canary.version} to {s.stable.version}"
        acts.append(EmitEvent("Warning", "Aborted", msg))
        return _rollback(s, after=Phase.ABORTED, reason="Aborted", message=msg, reject=True)
    one_step = obs.promote_step and s.step is not None and s.step < last
    if obs.promote or (obs.promote_step and not one_step):
        # Promote annotation, or a step promote at the last step (promoting it is promoting fully).
        s = _advance_step(s, spec=spec, obs=obs, step=last, now=now)
        s = dataclasses.replace(s, promote=True, reason="PromoteRequested")
        acts.append(EmitEvent("Normal", "PromoteRequested", f"promoting {s.canary.version} to all instances"))
    elif one_step:
        assert s.step is not None
        # One step on, this step's analysis skipped; the next step is analysed as usual. Paused
        # stays paused (spec.rollout.paused is the spec's to change): the held step moves on.
        # An inconclusive-analysis pause is what promote answers: it ends (Argo's promote resumes too).
        paused = s.phase == Phase.PAUSED and (spec.paused or not s.analysis_paused)
        s = _advance_step(s, spec=spec, obs=obs, step=s.step + 1, now=now)
        s = dataclasses.replace(s, phase=Phase.PAUSED if paused else s.phase, reason="StepPromoteRequested")
        acts.append(EmitEvent("Normal", "StepPromoteRequested", s.message))
    return s


def _pause_or_resume(s: RolloutStatus, *, spec: RolloutSpec, now: float, acts: list[Action]) -> RolloutStatus:
    """spec.rollout.paused (GitOps friendly) holds the step; an accepted promote wins."""
    if s.phase in (Phase.PROGRESSING, Phase.ANALYSING) and spec.paused and not s.promote:
        assert s.step is not None
        s = dataclasses.replace(s, phase=Phase.PAUSED, analysis_started_at=None, reason="Paused",
                                message=f"paused at step {s.step + 1}/{len(spec.steps)}")
        acts.append(EmitEvent("Normal", "Paused", s.message))
    elif s.phase == Phase.PAUSED and not s.analysis_paused and (not spec.paused or s.promote):
        assert s.step is not None
        s = dataclasses.replace(s, phase=Phase.PROGRESSING, step_started_at=now, reason="Resumed",
                                message=f"resumed at step {s.step + 1}/{len(spec.steps)}")
        acts.append(EmitEvent("Normal", "Resumed", s.message))
    return s


def _sample_calibration(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float) -> RolloutStatus:
    """Calibration samples (baseline traffic, stable error rate) while a canary is in flight."""
    if s.phase not in (Phase.PROGRESSING, Phase.ANALYSING):
        return s
    if obs.fleet_qps is not None:
        s = dataclasses.replace(s, qps_samples=tuple(map(tuple, add_sample(
            s.qps_samples, t=now, value=obs.fleet_qps, window_s=spec.calibration.qps.window_s))))
    if obs.stable_error_rate is not None:
        s = dataclasses.replace(s, error_samples=tuple(map(tuple, add_sample(
            s.error_samples, t=now, value=obs.stable_error_rate, window_s=spec.calibration.error_rate.window_s))))
    return s


# ---------------------------------------------------------------- the work of each phase


def _progressing(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float,
                 acts: list[Action]) -> RolloutStatus:
    """Wait until every pod of the step reports its version (pushes follow from the status), within
    progressDeadline; with no pods at all the version is promoted directly, unless the step had pods
    and models still use the GateConfig (then it waits for pods, its deadline counted from their return)."""
    assert s.canary is not None and s.stable is not None and s.step is not None
    if not obs.pods and s.canary_pods and obs.models:
        return dataclasses.replace(s, step_started_at=now, reason="WaitingForInstances",
                                   message=f"step {s.step + 1}/{len(spec.steps)}: no instances now (the step had "
                                   f"{len(s.canary_pods)}): waiting for them to come back")
    if not obs.pods:
        msg = f"no instances use this GateConfig: {s.canary.version} promoted directly"
        acts += [EmitEvent("Normal", "Promoted", msg), RecordOutcome("succeeded")]
        return _promote_fully(s, spec=spec, reason="NoInstances", message=msg)
    percent = spec.steps[s.step]
    s = dataclasses.replace(s, canary_pods=_choose(s.strategy, pods=obs.pods, percent=percent,
                                                   previous=s.canary_pods, canary_version=s.canary.version))
    waiting = _not_at_desired(s, obs.pods, sticky_header=spec.sticky_header)
    if not waiting:
        return _step_in_place(s, spec=spec, obs=obs, now=now, percent=percent, acts=acts)
    if s.step_started_at is not None and now < s.step_started_at:
        # The wall clock went back past the step's start (status keeps wall-clock times; a new
        # leader's clock may lag): the deadline counts from now, not after the jump is waited out.
        s = dataclasses.replace(s, step_started_at=now)
    if s.step_started_at is not None and now - s.step_started_at > spec.progress_deadline_s:
        msg = (f"step {s.step + 1}: {len(waiting)} instance(s) did not report the expected version within "
               f"{spec.progress_deadline_s:g}s: {', '.join(waiting[:5])}")
        return _fail(s, spec=spec, reason="ProgressDeadlineExceeded", message=msg, acts=acts)
    return dataclasses.replace(s, message=f"step {s.step + 1}/{len(spec.steps)} ({percent}%): waiting for "
                               f"{len(waiting)} instance(s) to report their version")


def _step_in_place(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float, percent: int,
                   acts: list[Action]) -> RolloutStatus:
    """Every pod of the step runs its version: promote (an accepted promote) or begin the analysis."""
    assert s.canary is not None and s.step is not None
    if s.promote:
        msg = f"{s.canary.version} promoted by annotation to all {len(obs.pods)} instances"
        acts += [RecordStep(percent, now - (s.step_started_at or now)), EmitEvent("Normal", "Promoted", msg),
                 RecordOutcome("succeeded")]
        return _promote_fully(s, spec=spec, reason="Promoted", message=msg)
    run = runs.new_run(spec.checks, step=s.step + 1, percent=percent, canary_version=s.canary.version, now=now)
    return dataclasses.replace(
        s, phase=Phase.ANALYSING, analysis_started_at=now, reason="Analysing", window_from=None, window_samples=0,
        analysis_runs=(*s.analysis_runs, run)[-runs.RUN_HISTORY:],
        message=f"step {s.step + 1}/{len(spec.steps)}: {_running_text(s, s.canary_pods, obs.pods)}; "
        f"analysing for {spec.analysis_interval_s:g}s")


def _analysing(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float,
               acts: list[Action]) -> RolloutStatus:
    """Judge the step, unless its pods changed (then it is verified again before it is judged)."""
    assert s.canary is not None and s.step is not None
    percent = spec.steps[s.step]
    chosen = _choose(s.strategy, pods=obs.pods, percent=percent, previous=s.canary_pods,
                     canary_version=s.canary.version)
    if not obs.pods and obs.models:
        chosen = s.canary_pods  # kept: the step had pods, so :func:`_progressing` waits for them
    if chosen != s.canary_pods or not obs.pods or _not_at_desired(s, obs.pods, sticky_header=spec.sticky_header):
        # An instance left, restarted or drifted: re-verify the step before judging it.
        return dataclasses.replace(s, phase=Phase.PROGRESSING, canary_pods=chosen, step_started_at=now,
                                   analysis_started_at=None, reason="Reverifying",
                                   message="instances changed during analysis: re-verifying the step")
    if s.analysis_started_at is not None and now < s.analysis_started_at:
        # The wall clock went back past the analysis start (status keeps wall-clock times): the
        # window would wait out the whole jump. The step is analysed again from now, a full window.
        return dataclasses.replace(s, phase=Phase.PROGRESSING, step_started_at=now, analysis_started_at=None,
                                   reason="ClockMovedBack", message=f"the clock moved back past the analysis start "
                                   f"{iso_time(s.analysis_started_at)}: analysing the step again")
    return _judge_step(s, spec=spec, obs=obs, now=now, percent=percent, acts=acts)


def _rolling_back(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float,
                  acts: list[Action]) -> RolloutStatus:
    """Once every reachable pod runs stable again, and no step pod that may still hold the canary
    is silent, come to rest where the rollback was headed."""
    assert s.stable is not None
    if any(p.reachable and p.version != s.stable.version for p in obs.pods):
        return s
    # A step pod with an address that did not answer may still hold the canary and serve it (its
    # Ready condition is the kubelet's, not ours): coming to rest would leave it there until the
    # next resting check, minutes away, under a status saying every instance is back. It answers
    # (a restarted server starts from the stable ConfigMap) or goes away; until then the rollback
    # goes on, naming it.
    base = s.message.split(_SILENT)[0]
    silent = [p.name for p in obs.pods if not p.reachable and p.addressed and p.name in s.canary_pods]
    if silent:
        held = s.canary.version if s.canary else "the canary"
        return dataclasses.replace(s, message=f"{base}{_SILENT}{len(silent)} unreachable instance(s) that may "
                                              f"still hold {held}: {', '.join(silent[:5])}")
    after = s.after_rollback or Phase.ROLLED_BACK
    outcome = {Phase.ABORTED: "aborted", Phase.SUCCEEDED: None}.get(after, "rolled_back")
    msg = base if after != Phase.SUCCEEDED else f"every instance runs stable {s.stable.version}"
    if outcome:
        acts.append(RecordOutcome(outcome))
    acts.append(EmitEvent("Normal" if after == Phase.SUCCEEDED else "Warning",
                          "RolledBack", f"every instance back on {s.stable.version}"))
    return dataclasses.replace(s, phase=after, canary=None, strategy=None, step=None, step_percent=None,
                               canary_pods=(), step_started_at=None, analysis_started_at=None, after_rollback=None,
                               message=msg)


# What a rollback's message says while silent step pods hold it (``_rolling_back``).
_SILENT = "; rollback waiting for "


# The phases with work of their own each tick; the others (Paused, Failed, resting) only follow the
# spec and the requests above and keep their pods where they are.
_PHASE_WORK: dict[Phase, Callable[..., RolloutStatus]] = {
    Phase.PROGRESSING: _progressing,
    Phase.ANALYSING: _analysing,
    Phase.ROLLING_BACK: _rolling_back,
}


def _pushes(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations) -> list[Action]:
    """Level-based pushes: every reachable pod not on its desired version."""
    by_name = {p.name: p for p in obs.pods}
    desired = desired_versions(status=s, pods=obs.pods, sticky_header=spec.sticky_header)
    return [PushGate(pod=name, gate=gate) for name, gate in sorted(desired.items())
            if by_name[name].reachable and by_name[name].version != gate.version]


def _bookkeeping(s: RolloutStatus, *, previous: RolloutStatus, target: GateVersion, obs: Observations,
                 now: float) -> RolloutStatus:
    """Close a run the step stopped being analysed under; record pods, history and conditions."""
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
    return dataclasses.replace(
        s, conditions=conditions(status=s, target_version=target.version, previous=previous.conditions, now=now,
                                 refused=obs.push_refused))


def _not_at_desired(s: RolloutStatus, pods: Sequence[PodObservation], *,
                    sticky_header: str = request_canary.contract.DEFAULT_STICKY_HEADER) -> list[str]:
    """Pods of the step that do not yet run their desired version (unreachable canary pods count);
    under strategy requests a pod keying sessions by another header than the spec's is not there."""
    assert s.canary is not None and s.stable is not None
    canary = canary_gate(s, sticky_header=sticky_header)
    assert canary is not None
    chosen = set(s.canary_pods)
    waiting = []
    for p in pods:
        if p.name in chosen:
            if not p.addressed and s.strategy == Strategy.REQUESTS:
                # Every pod is a step pod, a pod not started yet too (Pending, e.g. a scale-up waiting for a
                # node): it serves nothing until it starts and is pushed the set then (its Ready event
                # brings the next tick). Waiting for it would roll a healthy canary back at progressDeadline.
                continue
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
            note = (f"; analysis window restarted at {iso_time(obs.window_from)} (its data since "
                    f"{iso_time(s.window_from)} is gone, e.g. an operator restart, or the wall clock jumped)")
        s = dataclasses.replace(s, window_from=obs.window_from, window_samples=0)
    if obs.canary_metrics is not None:
        s = dataclasses.replace(s, window_samples=s.window_samples + 1)
    return s, note


def _builtin(run: AnalysisRun, check: CheckSpec, *, result: AnalysisResult | None, covered_s: float,
             spec: RolloutSpec, now: float, error: str | None = None) -> AnalysisRun:
    """The builtin check as before runs existed: fail fast; pass on a full window that passes;
    thin traffic keeps observing. A dry-run builtin records whatever the full window says, and
    no data when it has none by then (``error``: why the provider answered nothing)."""
    cur = run.check(check.name)
    if cur is not None and cur.phase != RunPhase.RUNNING:
        return run
    full = covered_s >= spec.analysis_interval_s
    if result is None:
        if not (check.dry_run and full):
            return run  # a deciding builtin waits for metrics: never passed on missing data
        # Recorded, never deciding: it must not hold the step (which waits for every check) forever.
        why = "no data by the end of the analysis interval" + (f" ({error})" if error else "")
        run = runs.record(run, check, Measurement(phase=MeasurementPhase.INCONCLUSIVE, at=now, message=why),
                          decide=False)
        return runs.set_check_phase(run, check.name, RunPhase.INCONCLUSIVE, why)
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


@dataclass(frozen=True)
class _StepData:
    """What one tick measured for the step under analysis."""

    run: AnalysisRun  # the step's run with this tick's measurements recorded
    result: AnalysisResult | None = None  # the builtin check's verdict on its window (None: no data)
    covered_s: float = 0.0  # seconds of data the builtin window holds
    note: str = ""  # "; analysis window restarted ..." when the provider's window began again


def _measure_step(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations,
                  now: float) -> tuple[RolloutStatus, _StepData]:
    """Record the declared checks' answers and the builtin check's window in the step's run. The
    builtin passes only on a full analysisInterval of data from where its provider's window begins
    (a restarted operator's direct scrape begins a new one), never on time since the analysis began."""
    run = _current_run(s, spec=spec, now=now)
    for check in spec.checks:
        if check.provider != Provider.BUILTIN and check.name in obs.measurements:
            run = runs.record(run, check, runs.judge(check, obs.measurements[check.name], now=now))
    builtin = spec.builtin
    if builtin is None:
        return s, _StepData(run=run, covered_s=now - (s.analysis_started_at or now))
    future = ""
    if s.window_from is not None and s.window_from > now:
        # A window beginning after now (a hand edit, or the clock moved back) never covers the
        # interval: where no provider window replaces it (Prometheus), the step never passed.
        future = f"; analysis window start {iso_time(s.window_from)} is in the future: ignored"
        s = dataclasses.replace(s, window_from=None, window_samples=0)
    s, note = _track_window(s, obs=obs)
    note = future + note
    covered = now - (s.analysis_started_at or now)
    if s.window_from is not None:
        covered = now - max(s.window_from, s.analysis_started_at or s.window_from)
    result = _analyse(s, spec=spec, obs=obs, now=now)
    if result is not None:
        s = dataclasses.replace(s, last_analysis=result.to_status())
    run = _builtin(run, builtin, result=result, covered_s=covered, spec=spec, now=now, error=obs.builtin_error)
    return s, _StepData(run=run, result=result, covered_s=covered, note=note)


def _judge_step(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float, percent: int,
                acts: list[Action]) -> RolloutStatus:
    """Analysing, pods in place: record this tick's measurements and decide the step by its run."""
    assert s.canary is not None and s.step is not None
    s, data = _measure_step(s, spec=spec, obs=obs, now=now)
    data = dataclasses.replace(data, run=runs.release_dry_runs(data.run, spec.checks))
    verdict, why = runs.run_phase(data.run, spec.checks)
    if verdict == RunPhase.RUNNING:
        if spec.builtin is not None:
            verdict_text = data.result.message if data.result is not None else (
                f"waiting for metrics ({obs.builtin_error})" if obs.builtin_error else "waiting for metrics")
            progress = f"analysing {data.covered_s:.0f}/{spec.analysis_interval_s:g}s: {verdict_text}"
        else:
            progress = f"analysing: {why}"
        return dataclasses.replace(s, analysis_runs=_replace_run(s, data.run),
                                   message=f"step {s.step + 1}/{len(spec.steps)} ({percent}%): {progress}{data.note}")
    s = dataclasses.replace(s, analysis_runs=_replace_run(s, runs.finish(data.run, verdict, why, now=now)))
    step_text = f"step {s.step + 1} ({percent}%)"
    if verdict == RunPhase.FAILED:
        return _fail(s, spec=spec, reason="AnalysisFailed", message=f"{step_text} analysis {why}", acts=acts)
    if verdict == RunPhase.INCONCLUSIVE:
        msg = (f"{step_text} analysis inconclusive, rollout paused: {why}; promote to continue, retry to analyse "
               f"the step again, abort to roll back")
        acts.append(EmitEvent("Warning", "AnalysisInconclusive", msg))
        return dataclasses.replace(s, phase=Phase.PAUSED, analysis_paused=True, analysis_started_at=None,
                                   reason="AnalysisInconclusive", message=msg)
    builtin = spec.builtin
    summary = data.result.message if data.result is not None and builtin is not None and not builtin.dry_run else why
    return _step_passed(s, spec=spec, obs=obs, now=now, percent=percent, summary=summary, acts=acts)


def _step_passed(s: RolloutStatus, *, spec: RolloutSpec, obs: Observations, now: float, percent: int, summary: str,
                 acts: list[Action]) -> RolloutStatus:
    """The step's analysis succeeded: the next step, or promotion after the last one."""
    assert s.canary is not None and s.step is not None
    acts.append(RecordStep(percent, now - (s.step_started_at or now)))
    if s.step == len(spec.steps) - 1:
        msg = f"{s.canary.version} promoted: {summary}"
        acts += [EmitEvent("Normal", "Promoted", msg), RecordOutcome("succeeded")]
        return _promote_fully(s, spec=spec, reason="Promoted", message=msg)
    s = _advance_step(s, spec=spec, obs=obs, step=s.step + 1, now=now)
    s = dataclasses.replace(s, reason="StepPromoted")
    acts.append(EmitEvent("Normal", "StepPromoted", f"{summary}; {s.message}"))
    return s


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
