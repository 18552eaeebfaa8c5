"""What ``kubectl sparsegate`` prints and writes, as pure functions of GateConfig objects.

Nothing here talks to the API server: the command module reads objects, hands them to these
functions and sends the patches they return. The status fields read are the ones
``sparsegate.domain.rollout.RolloutStatus.to_status`` writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sparsegate_contracts import gate as gatedoc

from sparsegate.domain import calibration
from sparsegate.domain.rollout import (
    ABORT_ANNOTATION,
    DEFAULT_STEPS,
    PROMOTE_ANNOTATION,
    PROMOTE_STEP_VALUE,
    RETRY_ANNOTATION,
    Phase,
    RolloutStatus,
    SpecError,
    declared_requests,
    in_flight,
    is_step_promote,
    parse_spec,
    pending_requests,
    rejection_holds,
)

PROMOTE_FULL_VALUE = "full"  # one of PROMOTE_FULL_VALUES (the operator refuses a value that is none of them)


class PluginError(Exception):
    """A request the plugin refuses, with the reason for the user."""


# ---------------------------------------------------------------- reading


def _rollout(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((obj.get("status") or {}).get("rollout")) or {}


def spec_steps(obj: Mapping[str, Any]) -> list[int]:
    """The rollout's step percentages as the spec gives them (the operator's default otherwise)."""
    steps = (((obj.get("spec") or {}).get("rollout")) or {}).get("steps")
    return [int(s) for s in steps] if steps else list(DEFAULT_STEPS)


def _num(value: Any) -> str:
    """A status number as printed (``%g``); ``n/a`` for none. ``status.rollout`` keeps unknown fields, so
    a hand-edited status may hold null or a string there: printed as is rather than crashing the view."""
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    return str(value)


def analysis_summary(analysis: Mapping[str, Any] | None) -> str:
    """``errorRate=0.01/0.02 p99LatencyMs=120/800 ...``: each check's value over its threshold,
    a failed check marked with ``!``, an undecided one (over, within noise) with ``?``; ``-`` when
    nothing was analysed yet."""
    if not isinstance(analysis, Mapping) or not analysis:
        return "-"
    parts = []
    for check in _checks(analysis):
        mark = "!" if check.get("passed") is False else "?" if check.get("undecided") else ""
        parts.append(f"{mark}{check.get('name')}={_num(check.get('value'))}/{_num(check.get('threshold', 0))}")
    return " ".join(parts) or str(analysis.get("verdict") or "-")


def _checks(analysis: Any) -> list[Mapping[str, Any]]:
    """``status.rollout.analysis.checks``, the entries that are objects (``status.rollout`` keeps
    unknown fields: a hand-edited one may hold anything there)."""
    checks = analysis.get("checks") if isinstance(analysis, Mapping) else None
    return [c for c in checks if isinstance(c, Mapping)] if isinstance(checks, list) else []


def check_result(check: Mapping[str, Any]) -> str:
    """pass, FAIL, undecided (over its threshold within noise: more traffic decides) or n/a (not
    evaluated, e.g. drift at 100 %: no stable requests left to compare with)."""
    passed = check.get("passed")
    if passed is None:
        return "undecided" if check.get("undecided") else "n/a"
    return "pass" if passed else "FAIL"


def latest_run(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The newest entry of ``status.analysisRuns`` (None before any step was analysed)."""
    analysis_runs = (obj.get("status") or {}).get("analysisRuns") or []
    return analysis_runs[-1] if analysis_runs else None


def _latest_value(check: Mapping[str, Any]) -> str:
    measurements = check.get("measurements") or []
    if not measurements:
        return "-"
    last = measurements[-1]
    if last.get("value") is not None:
        return _num(last["value"])
    return "n/a" if last.get("phase") != "Error" else "error"


def checks_summary(run: Mapping[str, Any] | None) -> str:
    """``errors=0.01 quality=0.95~``: each declared check's latest value, ``!`` before a failed
    check, ``?`` before an inconclusive one, ``~`` after a dry-run one; builtin checks left to
    :func:`analysis_summary`."""
    parts = []
    for check in (run or {}).get("checks") or []:
        if check.get("provider") == "builtin":
            continue
        mark = {"Failed": "!", "Inconclusive": "?"}.get(check.get("phase", ""), "")
        parts.append(f"{mark}{check.get('name')}={_latest_value(check)}{'~' if check.get('dryRun') else ''}")
    return " ".join(parts)


def _canary_share(ro: Mapping[str, Any]) -> str:
    """The step's canary share: of instances, or (strategy requests) of every instance's requests."""
    if not ro.get("canaryVersion") or not ro.get("canaryInstances"):
        return ""
    if ro.get("strategy") == "requests":
        return (f"  {ro.get('canaryPercent')}% of requests (weight {ro.get('canaryWeight')}) on all "
                f"{ro['canaryInstances'].split('/')[-1]} instances")
    return f"  {ro.get('canaryPercent')}% target, {ro['canaryInstances']} instances"


def row(obj: Mapping[str, Any], *, with_namespace: bool = False) -> list[str]:
    """One line of ``kubectl sparsegate get``."""
    meta = obj.get("metadata") or {}
    ro = _rollout(obj)
    stable = ((obj.get("status") or {}).get("stable") or {}).get("version") or "-"
    step = f"{ro['step']}/{ro.get('steps', len(spec_steps(obj)))}" if ro.get("step") else "-"
    percent = f"{ro['canaryPercent']}%" if ro.get("canaryPercent") is not None and ro.get("canaryVersion") else "-"
    builtin = analysis_summary(ro.get("analysis")) if ro.get("analysis") else ""
    declared = checks_summary(latest_run(obj)) if ro.get("canaryVersion") else ""
    cells = [meta.get("name", ""), ro.get("phase") or "Pending", step, percent, ro.get("canaryVersion") or "-",
             stable, " ".join(x for x in (builtin, declared) if x) or "-"]
    return [meta.get("namespace", ""), *cells] if with_namespace else cells


GET_HEADER = ["NAME", "PHASE", "STEP", "CANARY%", "CANARY", "STABLE", "ANALYSIS"]


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Left-aligned columns, two spaces apart, like kubectl's tables (no trailing spaces)."""
    all_rows = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in all_rows)


def get_table(objs: Sequence[Mapping[str, Any]], *, with_namespace: bool = False) -> str:
    header = (["NAMESPACE"] if with_namespace else []) + GET_HEADER
    ordered = sorted(objs, key=lambda o: ((o.get("metadata") or {}).get("namespace", ""),
                                          (o.get("metadata") or {}).get("name", "")))
    return table([row(o, with_namespace=with_namespace) for o in ordered], header)


def _step_marks(obj: Mapping[str, Any]) -> list[list[str]]:
    """One row per spec step: done, current (with the phase) or pending."""
    ro = _rollout(obj)
    current = ro.get("step") if ro.get("canaryVersion") else None
    out = []
    for i, percent in enumerate(spec_steps(obj), start=1):
        if current is None:
            state = "-"
        elif i < current:
            state = "done"
        elif i == current:
            state = f"<- {ro.get('phase', '')}"
        else:
            state = "pending"
        out.append([f"{i}", f"{percent}%", state])
    return out


def status_view(obj: Mapping[str, Any], *, now: datetime | None = None) -> str:
    """The ``kubectl sparsegate status NAME`` page: versions, steps, canary share, analysis values,
    conditions and revision history."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    ro = _rollout(obj)
    stable = (status.get("stable") or {}).get("version") or "-"
    lines = [
        f"Name:       {meta.get('namespace', '')}/{meta.get('name', '')}",
        f"Phase:      {ro.get('phase') or 'Pending'}" + (f" ({ro['reason']})" if ro.get("reason") else ""),
        f"Message:    {ro.get('message') or '-'}",
        f"Stable:     {stable}",
        f"Canary:     {ro.get('canaryVersion') or '-'}" + _canary_share(ro),
    ]
    if ro.get("rejectedVersion"):
        lines.append(f"Rejected:   {ro['rejectedVersion']} (not rolled out again while the spec names it; "
                     f"`kubectl sparsegate retry` to try it again)")
    counts = ro.get("versionCounts") if isinstance(ro.get("versionCounts"), Mapping) else {}
    if counts:
        lines.append("Instances:  " + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items())))
    lines += ["", table(_step_marks(obj), ["STEP", "WEIGHT", "STATE"]), ""]
    analysis = ro.get("analysis")
    if isinstance(analysis, Mapping) and analysis:
        lines.append(f"Analysis:   {analysis.get('verdict', '-')}, {_num(analysis.get('canaryRequests', 0))} canary "
                     f"requests at {_num(analysis.get('canaryQps', 0))} qps")
        checks = [[str(c.get("name")), _num(c.get("value")), _num(c.get("threshold", 0)), check_result(c)]
                  for c in _checks(analysis)]
        if checks:
            lines += [table(checks, ["CHECK", "VALUE", "THRESHOLD", "RESULT"]), ""]
    run = latest_run(obj)
    if run:
        lines += _run_lines(run)
    conditions = status.get("conditions") or []
    if conditions:
        lines += [table([[str(c.get("type")), str(c.get("status")), str(c.get("reason", ""))] for c in conditions],
                        ["CONDITION", "STATUS", "REASON"]), ""]
    history = status.get("history") or []
    if history:
        rows = [[str(r.get("revision")), str(r.get("version")), str(r.get("reason", "")),
                 _age(r.get("promotedAt"), now=now), "stable" if r.get("version") == stable else ""]
                for r in reversed(history)]
        lines.append(table(rows, ["REVISION", "VERSION", "REASON", "AGE", ""]))
    return "\n".join(lines).rstrip() + "\n"


def _run_lines(run: Mapping[str, Any]) -> list[str]:
    """The latest AnalysisRun: its phase, and per check phase, counts and latest measurements."""
    lines = [f"AnalysisRun: step {run.get('step')} ({run.get('canaryPercent')}%) of {run.get('canaryVersion')}: "
             f"{run.get('phase')}" + (f" ({run['message']})" if run.get("message") else "")]
    rows = []
    for c in run.get("checks") or []:
        recent = [m for m in c.get("measurements") or []][-3:]
        shown = ", ".join(("error" if m.get("phase") == "Error" else _num(m.get("value"))) + f" {m.get('phase', '')}"
                          for m in recent) or "-"
        counts = f"{c.get('successful', 0)}/{c.get('failed', 0)}/{c.get('inconclusive', 0)}/{c.get('errors', 0)}"
        rows.append([str(c.get("name")), str(c.get("provider")), str(c.get("phase")), counts,
                     "yes" if c.get("dryRun") else "", shown])
    if rows:
        lines += [table(rows, ["CHECK", "PROVIDER", "PHASE", "OK/FAIL/INC/ERR", "DRY-RUN", "LATEST"]), ""]
    return lines


def _age(stamp: str | None, *, now: datetime | None) -> str:
    if not stamp:
        return "-"
    try:
        when = datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:  # a hand-edited promotedAt: no age rather than a crash
        return "?"
    if when.tzinfo is None:  # a date or time without an offset: read as UTC, as the operator writes it
        when = when.replace(tzinfo=UTC)
    seconds = max(0, int(((now or datetime.now(tz=UTC)) - when).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


# ---------------------------------------------------------------- status --watch: when to stop


def watch_outcome(obj: Mapping[str, Any]) -> tuple[int, str] | None:
    """Where ``status --watch`` ends on ``obj``: ``(exit code, last line)`` once the rollout is at rest,
    None while it is not (in flight, rolling back, paused, or the operator has not yet acted on the
    spec or a one-shot request: a Succeeded status from before ``kubectl apply`` must not end it).

    0: Succeeded, every instance on the version the spec names, nothing in flight. 1: Failed (an
    invalid spec, or analysis failed with autoRollback off), RolledBack or Aborted (Degraded)."""
    meta = obj.get("metadata") or {}
    raw = obj.get("status") if isinstance(obj.get("status"), Mapping) else {}
    observed, generation = raw.get("observedGeneration"), meta.get("generation")
    if observed is not None and generation is not None and observed != generation:
        return None  # the spec changed since the operator last wrote status
    status = RolloutStatus.from_status(raw)
    if any(pending_requests(meta.get("annotations"), status).values()):
        return None  # an abort, promote or retry the operator has not acted on yet
    try:
        target: str | None = parse_spec(obj.get("spec") or {}).target.version
    except SpecError:
        target = None
    stable = status.stable.version if status.stable else None
    ro = _rollout(obj)
    why = f" ({ro['reason']})" if ro.get("reason") else ""
    said = f": {ro['message']}" if ro.get("message") else ""
    if status.phase == Phase.SUCCEEDED and status.canary is None and stable is not None and target == stable:
        return 0, f"rollout Succeeded: every instance runs the stable version {stable}"
    if status.phase == Phase.FAILED:
        return 1, f"rollout Failed{why}{said}"
    if status.phase in (Phase.ROLLED_BACK, Phase.ABORTED) and target in (None, stable, status.rejected_version):
        return 1, f"rollout {status.phase.value}{why}{said}"
    return None


def parse_duration(text: str) -> float:
    """``--timeout``: a duration as the CRDs write one (``90s``, ``5m``, ``1h30m``: the operator's
    own parser) or plain seconds; 0 waits for ever. Raises ValueError."""
    text = text.strip()
    try:
        number = float(text)
    except ValueError:
        return calibration.parse_duration(text, field="--timeout")
    return 0.0 if number == 0 else calibration.parse_duration(number, field="--timeout")


# ---------------------------------------------------------------- writing


def pause_patch(paused: bool) -> dict[str, Any]:
    """Merge patch for ``spec.rollout.paused`` (the spec field, so GitOps sees the same switch)."""
    return {"spec": {"rollout": {"paused": paused}}}


def resume_patch(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``spec.rollout.paused: false``; refused for a rollout that inconclusive analysis paused (the
    spec switch does not hold it, so flipping it would change nothing)."""
    if _rollout(obj).get("analysisPaused"):
        raise PluginError("paused because analysis was inconclusive, not by spec.rollout.paused: `promote` to "
                          "continue, `retry` to analyse the step again, `abort` to roll back")
    return pause_patch(False)


def annotation_patch(name: str, value: str) -> dict[str, Any]:
    return {"metadata": {"annotations": {name: value}}}


def _not_declared(obj: Mapping[str, Any], annotation: str) -> None:
    """A request annotation an applier declares (Git: kubectl's last-applied copy or a server-side
    apply owns it) acts once per value and is left in place: a value written here is ignored when
    it was already acted on, and otherwise acts, then Git's value, put back by the next sync or
    apply, acts again (a step promote becomes a full one). Refused: the request goes through Git."""
    if annotation in declared_requests(obj.get("metadata")):
        value = ((obj.get("metadata") or {}).get("annotations") or {}).get(annotation)
        raise PluginError(f"{annotation} is declared by the applied manifest (Git){f' as {value!r}' if value else ''}: "
                          f"a value written here would be ignored, or Git's acted on again at the next sync; "
                          f"set a new value in Git instead (a new value is a new request), or remove it from Git")


def _needs_canary(obj: Mapping[str, Any], what: str) -> None:
    """Promote and abort act on a canary in flight; the operator clears them unused otherwise, so
    they are refused here with the phase instead of reported as requested."""
    if not in_flight(RolloutStatus.from_status(obj.get("status"))):
        phase = _rollout(obj).get("phase") or "Pending"
        raise PluginError(f"nothing to {what}: no canary version is in flight (phase {phase})")


def promote_patch(obj: Mapping[str, Any], *, full: bool) -> dict[str, Any]:
    """The one-shot promote request: the next step (analysis of this one skipped) or, ``full``,
    every remaining step at once; refused for ``obj`` without a canary in flight."""
    _needs_canary(obj, "promote")
    _not_declared(obj, PROMOTE_ANNOTATION)
    pending = ((obj.get("metadata") or {}).get("annotations") or {}).get(PROMOTE_ANNOTATION)
    if not full and pending is not None and is_step_promote(pending):
        # Written again, the same value changes nothing: two requests, one step.
        raise PluginError(f"a step promote is already pending ({PROMOTE_ANNOTATION}={pending}: the operator has not "
                          f"acted on it yet); promote again once it has (`--full` for every remaining step)")
    return annotation_patch(PROMOTE_ANNOTATION, PROMOTE_FULL_VALUE if full else PROMOTE_STEP_VALUE)


def abort_patch(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The one-shot abort request; refused for ``obj`` without a canary in flight."""
    _needs_canary(obj, "abort")
    _not_declared(obj, ABORT_ANNOTATION)
    return annotation_patch(ABORT_ANNOTATION, "kubectl-sparsegate")


def retry_patch(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The retry request; refused when there is nothing to retry (the operator would ignore it)."""
    ro = _rollout(obj)
    phase = ro.get("phase")
    if phase not in ("RolledBack", "Aborted", "Failed") and not (phase == "Paused" and ro.get("analysisPaused")):
        raise PluginError(f"nothing to retry: phase is {phase or 'Pending'} (retry follows a rollback, an abort, "
                          f"a failed analysis or an inconclusive one)")
    status = RolloutStatus.from_status(obj.get("status"))
    if phase in ("RolledBack", "Aborted"):
        # The operator retries only the rejected version the spec still names.
        try:
            target: str | None = parse_spec(obj.get("spec") or {}).target.version
        except SpecError:
            target = None
        if target is None or not rejection_holds(status, target):
            raise PluginError(f"nothing to retry: the spec no longer names the {phase.lower()} version "
                              f"{status.rejected_version or '(none recorded)'}")
    if phase == "Failed" and not in_flight(status):
        raise PluginError(f"nothing to retry: no canary version is in flight ({ro.get('reason') or 'Failed'}: "
                          f"{ro.get('message') or ''})")
    _not_declared(obj, RETRY_ANNOTATION)
    return annotation_patch(RETRY_ANNOTATION, "kubectl-sparsegate")


def undo_target(obj: Mapping[str, Any], *, to_revision: int | None = None) -> Mapping[str, Any]:
    """The history entry ``undo`` rolls out: ``to_revision``, or the one before the stable version."""
    history = list((obj.get("status") or {}).get("history") or [])
    stable = ((obj.get("status") or {}).get("stable") or {}).get("version")
    if to_revision is not None:
        found = [r for r in history if r.get("revision") == to_revision]
        if not found:
            known = ", ".join(str(r.get("revision")) for r in history) or "none"
            raise PluginError(f"no revision {to_revision} in status.history (known: {known})")
        return found[0]
    earlier = [r for r in history if r.get("version") != stable]
    if not earlier:
        raise PluginError("no earlier revision in status.history to undo to")
    return earlier[-1]


def undo_patch(obj: Mapping[str, Any], *, to_revision: int | None = None) -> list[dict[str, Any]]:
    """JSON patch writing the revision's params as ``spec.params`` (replaced whole: a merge patch
    would keep keys the old version did not have, and hash to a third version)."""
    target = undo_target(obj, to_revision=to_revision)
    if not isinstance(target.get("params"), Mapping):
        raise PluginError(f"revision {target.get('revision')} has no params recorded")
    try:
        # The operator's check (parse_spec → the shared contract): params it would report as
        # InvalidSpec are refused here, before anything is written.
        gatedoc.validate_params(target["params"])
    except gatedoc.GateParamsError as e:
        why = " ".join(str(e).split())  # one line: the key names come from status
        raise PluginError(f"revision {target.get('revision')} ({target.get('version')}) has invalid params: {why}; "
                          f"spec.params left unchanged") from e
    return [{"op": "replace", "path": "/spec/params", "value": dict(target["params"])}]
