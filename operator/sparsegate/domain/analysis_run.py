"""Declared analysis checks and the AnalysisRun record of each step (after Argo Rollouts'
AnalysisTemplate and AnalysisRun), as pure functions.

A GateConfig lists its checks under ``spec.rollout.analysis.checks``; without that list a step is
judged by one implicit ``builtin`` check (today's error-rate / p99 / drift analysis of
:mod:`sparsegate.domain.analysis`). Each check names one provider:

* ``builtin``: the built-in analysis over the step's window (direct scrape of the pods, or the
  operator's Prometheus). Fails fast; passes once it has a full window of data that passes
  (``spec.rollout.analysisInterval``); while traffic is too thin it keeps observing.
* ``prometheus``: a PromQL ``query`` answering one number; ``address`` or the operator's
  ``SPARSEGATE_PROMETHEUS_URL``.
* ``web``: an HTTP GET or POST answering JSON; ``jsonPath`` selects the number.

Queries, URLs and bodies may hold ``{{args.NAME}}`` placeholders (:data:`ARG_NAMES`).
A declared check takes ``count`` measurements, one every ``interval`` (the first one interval
after the step's analysis began; each next one an interval after the previous, so a restarted
operator continues from the times recorded in status). Each measurement is judged as Argo does:

* ``failureCondition`` true → Failed; ``successCondition`` true → Successful;
* only ``successCondition`` given: false → Failed; only ``failureCondition``: false → Successful;
* both given and neither true, or no data (empty query result, NaN) → Inconclusive;
* the provider failed (HTTP error, timeout, bad JSON, several series) → Error.

The check is Failed when more than ``failureLimit`` measurements failed, Inconclusive when
more than ``inconclusiveLimit`` were inconclusive or more than ``consecutiveErrorLimit``
errors came in a row, Successful after ``count`` measurements otherwise. The step (the run)
fails when a check that is not ``dryRun`` failed, is Inconclusive (the rollout pauses, it
neither promotes nor rolls back) when one is inconclusive, and is Successful when every check
has finished and every check that is not ``dryRun`` succeeded. Dry-run checks are measured and
recorded like the others and never decide; nor do they hold a step with nothing to record: one
measured without any value (no data, provider errors) is closed Inconclusive once every deciding
check has finished (:func:`release_dry_runs`), and a dry-run builtin check without data by the end
of ``analysisInterval`` records Inconclusive (no data). One with values is waited for, as Argo does.

Runs live in GateConfig ``status.analysisRuns`` (the last :data:`RUN_HISTORY` steps, at most
:data:`MEASUREMENT_HISTORY` measurements per check), readable with kubectl.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sparsegate.domain.analysis_expr import Condition, ExprError, JsonPath, parse_condition, parse_json_path
from sparsegate.domain.calibration import parse_duration

__all__ = [
    "ARG_NAMES", "RUN_HISTORY", "MEASUREMENT_HISTORY", "Provider", "MeasurementPhase", "RunPhase",
    "PrometheusCheck", "WebCheck", "CheckSpec", "BUILTIN_CHECK", "parse_checks", "Measured", "Measurement",
    "CheckRun", "AnalysisRun", "judge", "record", "due_checks", "new_run", "release_dry_runs", "run_phase",
    "render_args", "finish",
    "set_check_phase", "measure_args", "pods_regex",
]

RUN_HISTORY = 10
MEASUREMENT_HISTORY = 10
DEFAULT_CONSECUTIVE_ERROR_LIMIT = 4  # Argo Rollouts' default
WEB_METHODS = ("GET", "POST")
ARG_NAMES = ("namespace", "gateConfig", "models", "canaryPods", "stablePods", "canaryVersion", "stableVersion",
             "step", "canaryPercent", "window")
_PLACEHOLDER = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_CHECK_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# The CRD's rules for web check headers: a name is an RFC 9110 token; a value holds no control
# character but tab (the HTTP client refuses CR, LF, NUL and the rest: the request is never sent).
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_HEADER_VALUE_FORBIDDEN = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class Provider(str, enum.Enum):
    BUILTIN = "builtin"
    PROMETHEUS = "prometheus"
    WEB = "web"


class MeasurementPhase(str, enum.Enum):
    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"  # the provider could not answer (counted against consecutiveErrorLimit)


class RunPhase(str, enum.Enum):
    RUNNING = "Running"
    # Measurements still due.
    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"
    TERMINATED = "Terminated"
    # The step stopped being analysed before the run decided (abort, pause, newer spec, promote, re-verify).


# ---------------------------------------------------------------- spec


@dataclass(frozen=True)
class PrometheusCheck:
    query: str
    address: str | None = None


@dataclass(frozen=True)
class WebCheck:
    url: str
    method: str = "GET"
    body: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    json_path: JsonPath | None = None
    timeout_s: float = 5.0


@dataclass(frozen=True)
class CheckSpec:
    name: str
    provider: Provider
    prometheus: PrometheusCheck | None = None
    web: WebCheck | None = None
    success: Condition | None = None
    failure: Condition | None = None
    count: int = 1
    interval_s: float | None = None  # None: spec.rollout.analysisInterval
    failure_limit: int = 0
    inconclusive_limit: int = 0
    consecutive_error_limit: int = DEFAULT_CONSECUTIVE_ERROR_LIMIT
    dry_run: bool = False


BUILTIN_CHECK = CheckSpec(name="builtin", provider=Provider.BUILTIN)


def _placeholders_ok(text: str, *, field_name: str) -> None:
    for name in _PLACEHOLDER.findall(text):
        if not name.startswith("args.") or name[5:] not in ARG_NAMES:
            raise ValueError(f"{field_name}: unknown placeholder {{{{{name}}}}} "
                             f"(known: {', '.join('{{args.' + a + '}}' for a in ARG_NAMES)})")


def _int(raw: Mapping[str, Any], key: str, default: int, *, lo: int, where: str) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{where}.{key} must be an integer ≥ {lo}, got {value!r}")
    return value


def _condition(raw: Mapping[str, Any], key: str, where: str) -> Condition | None:
    text = raw.get(key)
    if text is None or text == "":
        return None
    try:
        return parse_condition(str(text))
    except ExprError as e:
        raise ValueError(f"{where}.{key} {text!r}: {e}") from e


def _parse_check(raw: Any, *, where: str) -> CheckSpec:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or not _CHECK_NAME.match(name):
        raise ValueError(f"{where}.name must be 1-63 letters, digits, '-', '_' or '.', got {name!r}")
    provider_raw = raw.get("provider") or {}
    if not isinstance(provider_raw, Mapping):
        raise ValueError(f"{where}.provider must be an object")
    kinds = [p for p in Provider if p.value in provider_raw]
    if len(kinds) != 1 or set(provider_raw) - {p.value for p in Provider}:
        raise ValueError(f"{where}.provider must set exactly one of builtin, prometheus, web, got "
                         f"{sorted(provider_raw) or 'none'}")
    kind = kinds[0]
    body = provider_raw[kind.value] or {}
    if not isinstance(body, Mapping):
        raise ValueError(f"{where}.provider.{kind.value} must be an object")
    success, failure = _condition(raw, "successCondition", where), _condition(raw, "failureCondition", where)
    interval = raw.get("interval")
    common: dict[str, Any] = {
        "name": name, "provider": kind, "success": success, "failure": failure,
        "count": _int(raw, "count", 1, lo=1, where=where),
        "interval_s": None if interval is None else parse_duration(interval, field=f"{where}.interval"),
        "failure_limit": _int(raw, "failureLimit", 0, lo=0, where=where),
        "inconclusive_limit": _int(raw, "inconclusiveLimit", 0, lo=0, where=where),
        "consecutive_error_limit": _int(raw, "consecutiveErrorLimit", DEFAULT_CONSECUTIVE_ERROR_LIMIT, lo=0,
                                        where=where),
        "dry_run": bool(raw.get("dryRun", False)),
    }
    if kind == Provider.BUILTIN:
        extra = [k for k in ("successCondition", "failureCondition", "count", "interval", "failureLimit",
                             "inconclusiveLimit", "consecutiveErrorLimit") if raw.get(k) not in (None, "")]
        if extra:
            raise ValueError(f"{where}: a builtin check takes no {', '.join(extra)} (its thresholds are "
                             f"spec.rollout's and spec.calibration's)")
        return CheckSpec(**common)
    if success is None and failure is None:
        raise ValueError(f"{where}: set successCondition, failureCondition or both")
    if kind == Provider.PROMETHEUS:
        query = body.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ValueError(f"{where}.provider.prometheus.query must be a non-empty PromQL query")
        _placeholders_ok(query, field_name=f"{where}.provider.prometheus.query")
        address = body.get("address") or None
        if address is not None and not re.match(r"^https?://", str(address)):
            raise ValueError(f"{where}.provider.prometheus.address must be an http(s) URL, got {address!r}")
        return CheckSpec(**common, prometheus=PrometheusCheck(query=query, address=address))
    url = body.get("url")
    if not isinstance(url, str) or not re.match(r"^https?://", url):
        raise ValueError(f"{where}.provider.web.url must be an http(s) URL, got {url!r}")
    _placeholders_ok(url, field_name=f"{where}.provider.web.url")
    method = str(body.get("method", "GET")).upper()
    if method not in WEB_METHODS:
        raise ValueError(f"{where}.provider.web.method must be GET or POST, got {body.get('method')!r}")
    payload = body.get("body")
    if payload is not None:
        _placeholders_ok(str(payload), field_name=f"{where}.provider.web.body")
    headers = []
    for i, h in enumerate(body.get("headers") or []):
        if not isinstance(h, Mapping) or not h.get("name"):
            raise ValueError(f"{where}.provider.web.headers[{i}] needs a name and a value")
        name, value = str(h["name"]), str(h.get("value", ""))
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"{where}.provider.web.headers[{i}].name must be an HTTP header name (letters, digits "
                             f"and !#$%&'*+.^_`|~-), got {name!r}")
        if _HEADER_VALUE_FORBIDDEN.search(value):
            raise ValueError(f"{where}.provider.web.headers[{i}].value must hold no control characters (CR, LF, "
                             f"NUL, ...; tab is allowed), got {value!r}")
        headers.append((name, value))
    path_text = body.get("jsonPath")
    try:
        json_path = parse_json_path(path_text) if path_text else None
    except ExprError as e:
        raise ValueError(f"{where}.provider.web.jsonPath: {e}") from e
    timeout = parse_duration(body.get("timeout", "5s"), field=f"{where}.provider.web.timeout")
    return CheckSpec(**common, web=WebCheck(url=url, method=method, body=None if payload is None else str(payload),
                                            headers=tuple(headers), json_path=json_path, timeout_s=timeout))


def parse_checks(raw: Mapping[str, Any] | None) -> tuple[CheckSpec, ...]:
    """``spec.rollout.analysis`` → checks (the implicit builtin one when none are declared).

    Raises ValueError naming the field (``spec.rollout.analysis.checks[1].successCondition``)."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ValueError("spec.rollout.analysis must be an object")
    listed = raw.get("checks")
    if listed is None:
        return (BUILTIN_CHECK,)
    if not isinstance(listed, Sequence) or isinstance(listed, str) or not listed:
        raise ValueError("spec.rollout.analysis.checks must be a non-empty list")
    checks = tuple(_parse_check(c, where=f"spec.rollout.analysis.checks[{i}]") for i, c in enumerate(listed))
    names = [c.name for c in checks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"spec.rollout.analysis.checks: names must be unique, repeated: {', '.join(dup)}")
    if sum(c.provider == Provider.BUILTIN for c in checks) > 1:
        raise ValueError("spec.rollout.analysis.checks: at most one builtin check")
    return checks


def render_args(text: str, args: Mapping[str, str]) -> str:
    """Replace ``{{args.NAME}}`` placeholders (names checked when the spec was parsed)."""
    return _PLACEHOLDER.sub(lambda m: str(args.get(m.group(1)[5:], m.group(0))), text)


# ---------------------------------------------------------------- measurements


@dataclass(frozen=True)
class Measured:
    """What a provider answered for one check: a number, no data (value None), or an error."""

    value: float | None = None
    error: str | None = None
    at: float | None = None  # when it was taken (the handler's now when None)


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _epoch(s: Any) -> float | None:
    if not isinstance(s, str) or not s:
        return None
    try:
        return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _rounded(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, 6)


@dataclass(frozen=True)
class Measurement:
    phase: MeasurementPhase
    at: float
    value: float | None = None
    values: Mapping[str, float | None] = field(default_factory=dict)  # builtin: each check's number
    message: str = ""

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase.value, "time": _iso(self.at), "value": _rounded(self.value)}
        if self.values:
            # A check without data (drift at 100 %) is left out: the CRD's numbers are not nullable.
            out["values"] = {k: r for k, v in self.values.items() if (r := _rounded(v)) is not None}
        if self.message:
            out["message"] = self.message[:512]
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_status(cls, raw: Mapping[str, Any]) -> Measurement | None:
        phase, at = raw.get("phase"), _epoch(raw.get("time"))
        if phase not in MeasurementPhase._value2member_map_ or at is None:
            return None
        return cls(phase=MeasurementPhase(phase), at=at, value=raw.get("value"), values=dict(raw.get("values") or {}),
                   message=raw.get("message") or "")


def judge(check: CheckSpec, measured: Measured, *, now: float) -> Measurement:
    """One provider answer → a judged measurement (the rules in the module docstring)."""
    at = measured.at if measured.at is not None else now
    if measured.error is not None:
        return Measurement(phase=MeasurementPhase.ERROR, at=at, message=measured.error)
    value = measured.value
    if value is None or math.isnan(value):
        return Measurement(phase=MeasurementPhase.INCONCLUSIVE, at=at, message="no data")
    try:
        success_true = check.success.evaluate(value) if check.success else None
        failure_true = check.failure.evaluate(value) if check.failure else None
    except ExprError as e:
        return Measurement(phase=MeasurementPhase.ERROR, at=at, value=value, message=f"condition: {e}")
    shown = f"result {value:.6g}"
    if failure_true:
        assert check.failure is not None
        phase, why = MeasurementPhase.FAILED, f"{shown}: failureCondition {check.failure.text!r} is true"
    elif success_true:
        phase, why = MeasurementPhase.SUCCESSFUL, f"{shown}"
    elif failure_true is None:  # only successCondition, and it is false
        assert check.success is not None
        phase, why = MeasurementPhase.FAILED, f"{shown}: successCondition {check.success.text!r} is false"
    elif success_true is None:  # only failureCondition, and it is false
        phase, why = MeasurementPhase.SUCCESSFUL, f"{shown}"
    else:
        phase, why = MeasurementPhase.INCONCLUSIVE, f"{shown}: neither condition is true"
    return Measurement(phase=phase, at=at, value=value, message=why)


# ---------------------------------------------------------------- the run record


@dataclass(frozen=True)
class CheckRun:
    name: str
    provider: Provider
    dry_run: bool = False
    phase: RunPhase = RunPhase.RUNNING
    measurements: tuple[Measurement, ...] = ()  # the last MEASUREMENT_HISTORY
    taken: int = 0  # measurements taken in all (errors included)
    successful: int = 0
    failed: int = 0
    inconclusive: int = 0
    errors: int = 0
    consecutive_errors: int = 0
    last_at: float | None = None  # when the latest measurement was taken (schedules the next one)
    message: str = ""

    def to_status(self) -> dict[str, Any]:
        out = {"name": self.name, "provider": self.provider.value, "dryRun": self.dry_run, "phase": self.phase.value,
               "count": self.taken, "successful": self.successful, "failed": self.failed,
               "inconclusive": self.inconclusive, "errors": self.errors, "consecutiveErrors": self.consecutive_errors,
               "lastMeasuredAt": _iso(self.last_at), "message": self.message[:512] or None,
               "measurements": [m.to_status() for m in self.measurements]}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_status(cls, raw: Mapping[str, Any]) -> CheckRun | None:
        if raw.get("provider") not in Provider._value2member_map_ or not raw.get("name"):
            return None
        phase = raw.get("phase")

        def n(key: str) -> int:
            v = raw.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else 0

        return cls(name=raw["name"], provider=Provider(raw["provider"]), dry_run=bool(raw.get("dryRun")),
                   phase=RunPhase(phase) if phase in RunPhase._value2member_map_ else RunPhase.RUNNING,
                   measurements=tuple(m for m in (Measurement.from_status(x) for x in raw.get("measurements") or ())
                                      if m),
                   taken=n("count"), successful=n("successful"), failed=n("failed"), inconclusive=n("inconclusive"),
                   errors=n("errors"), consecutive_errors=n("consecutiveErrors"),
                   last_at=_epoch(raw.get("lastMeasuredAt")), message=raw.get("message") or "")


@dataclass(frozen=True)
class AnalysisRun:
    """The analysis of one step of one canary version."""

    step: int  # 1-based, as status.rollout.step
    percent: int
    canary_version: str
    started_at: float
    phase: RunPhase = RunPhase.RUNNING
    checks: tuple[CheckRun, ...] = ()
    finished_at: float | None = None
    message: str = ""

    def check(self, name: str) -> CheckRun | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_status(self) -> dict[str, Any]:
        out = {"step": self.step, "canaryPercent": self.percent, "canaryVersion": self.canary_version,
               "phase": self.phase.value, "startedAt": _iso(self.started_at), "finishedAt": _iso(self.finished_at),
               "message": self.message[:1024] or None, "checks": [c.to_status() for c in self.checks]}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_status(cls, raw: Mapping[str, Any]) -> AnalysisRun | None:
        started = _epoch(raw.get("startedAt"))
        if not isinstance(raw.get("step"), int) or started is None or not raw.get("canaryVersion"):
            return None
        phase = raw.get("phase")
        return cls(step=raw["step"], percent=int(raw.get("canaryPercent") or 0), canary_version=raw["canaryVersion"],
                   started_at=started,
                   phase=RunPhase(phase) if phase in RunPhase._value2member_map_ else RunPhase.RUNNING,
                   checks=tuple(c for c in (CheckRun.from_status(x) for x in raw.get("checks") or ()) if c),
                   finished_at=_epoch(raw.get("finishedAt")), message=raw.get("message") or "")


def new_run(checks: Sequence[CheckSpec], *, step: int, percent: int, canary_version: str, now: float) -> AnalysisRun:
    return AnalysisRun(step=step, percent=percent, canary_version=canary_version, started_at=now,
                       checks=tuple(CheckRun(name=c.name, provider=c.provider, dry_run=c.dry_run) for c in checks))


def _assess(check: CheckSpec, run: CheckRun) -> tuple[RunPhase, str]:
    """A declared check's phase from its counts (Argo's assessMetricStatus), saying why with the
    latest measurement's own words (value and the condition that decided it)."""
    last = f" (latest: {run.measurements[-1].message})" if run.measurements and run.measurements[-1].message else ""
    if run.failed > check.failure_limit:
        return RunPhase.FAILED, f"{run.failed} failed measurement(s) > failureLimit {check.failure_limit}{last}"
    if run.inconclusive > check.inconclusive_limit:
        return RunPhase.INCONCLUSIVE, (f"{run.inconclusive} inconclusive measurement(s) > inconclusiveLimit "
                                       f"{check.inconclusive_limit}{last}")
    if run.consecutive_errors > check.consecutive_error_limit:
        return RunPhase.INCONCLUSIVE, (f"{run.consecutive_errors} provider errors in a row > consecutiveErrorLimit "
                                       f"{check.consecutive_error_limit}{last}")
    if run.taken - run.errors >= check.count:
        return RunPhase.SUCCESSFUL, f"{run.successful} of {check.count} measurement(s) successful{last}"
    return RunPhase.RUNNING, ""


def record(run: AnalysisRun, check: CheckSpec, m: Measurement, *, decide: bool = True) -> AnalysisRun:
    """``run`` with measurement ``m`` of ``check`` added (counts updated, the check re-assessed).

    ``decide`` False records a builtin measurement whose phase the caller sets itself."""
    cur = run.check(check.name) or CheckRun(name=check.name, provider=check.provider, dry_run=check.dry_run)
    phase = m.phase
    cur = dataclasses.replace(
        cur,
        measurements=(*cur.measurements, m)[-MEASUREMENT_HISTORY:],
        taken=cur.taken + 1,
        successful=cur.successful + (phase == MeasurementPhase.SUCCESSFUL),
        failed=cur.failed + (phase == MeasurementPhase.FAILED),
        inconclusive=cur.inconclusive + (phase == MeasurementPhase.INCONCLUSIVE),
        errors=cur.errors + (phase == MeasurementPhase.ERROR),
        consecutive_errors=cur.consecutive_errors + 1 if phase == MeasurementPhase.ERROR else 0,
        last_at=m.at,
        message=m.message,
    )
    if decide:
        verdict, why = _assess(check, cur)
        cur = dataclasses.replace(cur, phase=verdict, message=why if verdict != RunPhase.RUNNING else m.message)
    return _with_check(run, cur)


def _with_check(run: AnalysisRun, cur: CheckRun) -> AnalysisRun:
    names = [c.name for c in run.checks]
    checks = tuple(cur if c.name == cur.name else c for c in run.checks) if cur.name in names \
        else (*run.checks, cur)
    return dataclasses.replace(run, checks=checks)


def set_check_phase(run: AnalysisRun, name: str, phase: RunPhase, message: str) -> AnalysisRun:
    cur = run.check(name)
    if cur is None:
        return run
    return _with_check(run, dataclasses.replace(cur, phase=phase, message=message))


def due_checks(checks: Sequence[CheckSpec], run: AnalysisRun | None, *, now: float,
               default_interval_s: float) -> tuple[CheckSpec, ...]:
    """Declared (non-builtin) checks whose next measurement is due now: each first one
    interval after the run started, each next one an interval after the previous one. A
    measurement "in the future" (the wall clock went back past it: status keeps wall-clock times)
    makes the next one due now, not the jump waited out."""
    if run is None or run.phase != RunPhase.RUNNING:
        return ()
    due = []
    for check in checks:
        if check.provider == Provider.BUILTIN:
            continue
        cur = run.check(check.name)
        if cur is not None and cur.phase != RunPhase.RUNNING:
            continue
        since = cur.last_at if cur is not None and cur.last_at is not None else run.started_at
        if now < since or now - since >= (check.interval_s or default_interval_s):
            due.append(check)
    return tuple(due)


def release_dry_runs(run: AnalysisRun, checks: Sequence[CheckSpec]) -> AnalysisRun:
    """Dry-run checks are recorded and never decide, so one must not hold a step whose deciding
    checks have all finished while it has nothing to record: measured, but no measurement with a
    value (no data, provider errors), it is closed Inconclusive here instead of being measured until
    its limits run out. One that has values is waited for (as Argo waits for dry-run metrics)."""
    by_name = {c.name: c for c in run.checks}
    if any(by_name.get(c.name) is None or by_name[c.name].phase == RunPhase.RUNNING
           for c in checks if not c.dry_run):
        return run
    for check in checks:
        cur = by_name.get(check.name)
        if not check.dry_run or cur is None or cur.phase != RunPhase.RUNNING or cur.taken == 0 \
                or cur.successful or cur.failed or any(m.value is not None for m in cur.measurements):
            continue
        why = f"no result when the deciding checks finished, recorded only (latest: {cur.message})"
        run = set_check_phase(run, check.name, RunPhase.INCONCLUSIVE, why)
    return run


def run_phase(run: AnalysisRun, checks: Sequence[CheckSpec]) -> tuple[RunPhase, str]:
    """The step's verdict from its checks (dry-run checks recorded, never deciding)."""
    by_name = {c.name: c for c in run.checks}
    deciding = [by_name.get(c.name) or CheckRun(name=c.name, provider=c.provider) for c in checks if not c.dry_run]
    failed = [c for c in deciding if c.phase == RunPhase.FAILED]
    if failed:
        return RunPhase.FAILED, "; ".join(f"check {c.name} failed: {c.message}" for c in failed)
    unsure = [c for c in deciding if c.phase == RunPhase.INCONCLUSIVE]
    if unsure:
        return RunPhase.INCONCLUSIVE, "; ".join(f"check {c.name} inconclusive: {c.message}" for c in unsure)
    running = [c.name for c in checks if (by_name.get(c.name) is None
                                          or by_name[c.name].phase == RunPhase.RUNNING)]
    if running:
        return RunPhase.RUNNING, f"measuring {', '.join(running)}"
    return RunPhase.SUCCESSFUL, "every check passed" + (
        "" if all(not c.dry_run for c in checks) else " (dry-run checks recorded, not deciding)")


def finish(run: AnalysisRun, phase: RunPhase, message: str, *, now: float) -> AnalysisRun:
    """Close the run; checks still running stop there (Terminated), as Argo terminates the metrics
    left when a run fails."""
    checks = tuple(dataclasses.replace(c, phase=RunPhase.TERMINATED) if c.phase == RunPhase.RUNNING else c
                   for c in run.checks)
    return dataclasses.replace(run, phase=phase, message=message, finished_at=now, checks=checks)


NO_POD = "_"  # matches no pod: '_' is not allowed in pod names


def pods_regex(pods: Sequence[str]) -> str:
    """Pod names as a PromQL regex alternation for a double-quoted string (``.`` matched literally,
    written ``\\\\.``); :data:`NO_POD` when there are none."""
    return "|".join(p.replace(".", "\\\\.") for p in sorted(pods)) or NO_POD


def measure_args(*, namespace: str, gate_config: str, models: Sequence[str], canary_pods: Sequence[str],
                 stable_pods: Sequence[str], canary_version: str, stable_version: str, step: int, percent: int,
                 window_s: float) -> dict[str, str]:
    """The ``{{args.NAME}}`` values of one measurement (:data:`ARG_NAMES`)."""
    return {"namespace": namespace, "gateConfig": gate_config, "models": pods_regex(models),
            "canaryPods": pods_regex(canary_pods), "stablePods": pods_regex(stable_pods),
            "canaryVersion": canary_version, "stableVersion": stable_version, "step": str(step),
            "canaryPercent": str(percent), "window": f"{max(1, math.ceil(window_s))}s"}
