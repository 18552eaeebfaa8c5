"""Analysis providers: one interface, selected per check (``domain.analysis_run.Provider``).

``await provider.measure(check, request)`` answers either a :class:`BuiltinWindow` (the builtin
check's canary and stable groups over the step's window, plus calibration samples) or a
``domain.analysis_run.Measured`` number (declared checks). The controller (``controllers.rollout``)
asks the provider of each check that is due; the state machine (``domain.rollout``) judges the answers.

* :class:`DirectScrape` (builtin, default): ``GET /metrics`` on every pod; it owns its windows
  (start snapshots kept in memory, keyed by canary version, step and analysis start). A
  restarted operator has none, so its window begins at its first scrape, and it says so
  (``window_from``): the state machine then wants a full window of this fresh data. Its spans
  (rates, how long the window has run) are measured on a monotonic clock: a wall-clock jump
  neither completes a window at once nor stretches its rates; ``window_from`` (a wall-clock time,
  written to status) is moved by such a jump so that it stays that span before now.
* :class:`PrometheusGroups` (builtin, with ``SPARSEGATE_PROMETHEUS_URL``): the same groups
  from Prometheus' ``increase()`` since the analysis start (the data survives a restart).

Under the request-level canary (``MeasureRequest.canary_version``/``stable_version`` set) both
builtin providers split the same pods' series by their ``gate_version`` label instead of by pod.
* :class:`PrometheusQuery` (``prometheus`` checks): one instant query answering one number.
* :class:`WebRequest` (``web`` checks): an HTTP GET/POST answering JSON; ``jsonPath`` picks
  the number.

Every call is bounded by a timeout; a declared check's failure becomes an answer
(``Measured(error=...)``) through :func:`measure_safely`, and a builtin provider's failure (Prometheus
unreachable or refusing) leaves the tick without builtin data, the step's message saying why
(``controllers.rollout``). Bodies read from pods, web checks and instant queries are capped.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import aiohttp

from sparsegate.clients.metrics_source import (
    SCRAPED_SAMPLES,
    PrometheusAPI,
    PrometheusError,
    group_from_snapshots,
    parse_samples,
    pod_counters,
)
from sparsegate.clients.podadmin import BodyTooLarge, PodAdmin, PodTarget, read_capped
from sparsegate.domain.analysis import GroupMetrics, PodCounters
from sparsegate.domain.analysis_run import CheckSpec, Measured, render_args

__all__ = ["MeasureRequest", "BuiltinWindow", "AnalysisProvider", "BuiltinProvider", "DirectScrape",
           "PrometheusGroups", "PrometheusQuery", "WebRequest", "measure_safely"]

ANSWER_LIMIT = 256 * 1024  # a web check's JSON or a query's answer: one number is wanted


@dataclass(frozen=True)
class MeasureRequest:
    """What a provider may need: where, which pods, the placeholder values, the step's window."""

    namespace: str
    now: float
    # The monotonic clock read with ``now`` (None: ``now`` stands for it): what in-memory spans are
    # measured on, so a wall-clock jump does not stretch or shrink them.
    monotonic: float | None = None
    args: Mapping[str, str] = field(default_factory=dict)
    targets: Mapping[str, PodTarget] = field(default_factory=dict)  # reachable pods of the models
    canary: Sequence[str] = ()  # canary pods with a target
    stable: Sequence[str] = ()
    analysing: bool = False  # the step's pods are in place and its window runs
    window_key: tuple[Any, ...] | None = None  # (canary version, step, analysis start)
    analysis_started_at: float | None = None
    # Request-level canary: both groups are the same pods, split by the serving version's
    # gate_version label (None: split by pod, the instances strategy).
    canary_version: str | None = None
    stable_version: str | None = None


@dataclass(frozen=True)
class BuiltinWindow:
    canary_metrics: GroupMetrics | None = None
    stable_metrics: GroupMetrics | None = None
    fleet_qps: float | None = None
    stable_error_rate: float | None = None
    window_from: float | None = None  # where the window's data begins (None: not analysing)

    def observations(self) -> dict[str, Any]:
        """As ``domain.rollout.Observations`` keyword arguments (absent values left out)."""
        out = {"canary_metrics": self.canary_metrics, "stable_metrics": self.stable_metrics,
               "fleet_qps": self.fleet_qps, "stable_error_rate": self.stable_error_rate,
               "window_from": self.window_from}
        return {k: v for k, v in out.items() if v is not None}


class AnalysisProvider(Protocol):
    """What every provider is: one ``measure`` per check and tick."""

    async def measure(self, check: CheckSpec, request: MeasureRequest) -> BuiltinWindow | Measured: ...


class BuiltinProvider(AnalysisProvider, Protocol):
    """A provider of the builtin check (:class:`DirectScrape`, :class:`PrometheusGroups`): it answers
    a :class:`BuiltinWindow` and forgets any window it holds on ``reset`` (no canary in flight)."""

    def reset(self) -> None: ...


async def measure_safely(provider: AnalysisProvider, check: CheckSpec, request: MeasureRequest) -> Measured:
    """A declared check's answer; any failure of the provider becomes ``Measured(error=...)``."""
    try:
        answer = await provider.measure(check, request)
    except Exception as e:  # noqa: BLE001 - a provider's failure is a measurement error, not a crashed tick
        return Measured(error=f"{type(e).__name__}: {e}"[:512], at=request.now)
    if not isinstance(answer, Measured):
        return Measured(error=f"provider answered {type(answer).__name__}, not a number", at=request.now)
    if answer.value is not None and math.isnan(answer.value):
        # NaN is no data (judge's rule): e.g. scalar() of an empty vector, or a web answer "NaN";
        # answered as the value NaN, it was counted answer="value" in the measurements metric.
        return replace(answer, value=None)
    return answer


# ---------------------------------------------------------------- builtin


class DirectScrape:
    """The builtin check's groups from the pods' own ``/metrics`` (no Prometheus needed)."""

    # How far the wall clock may drift from the monotonic one (NTP slewing) before ``window_from``
    # is moved: a jump, not a drift.
    JUMP_S = 1.0

    def __init__(self, admin: PodAdmin) -> None:
        self.admin = admin
        # Last scrape ("all" versions, the "stable" group's), for this tick's calibration samples.
        self.prev: dict[str, dict[str, PodCounters]] = {}
        self.window_key: tuple[Any, ...] | None = None
        # Window start snapshots of the canary and the stable group (the same pods' whole
        # counters under the instances strategy, each version's under requests).
        self.window_start: tuple[dict[str, PodCounters], dict[str, PodCounters]] = ({}, {})
        self.window_from: float | None = None
        self.window_mono: float = 0.0  # the window's start on the monotonic clock

    def reset(self) -> None:
        self.prev, self.window_key, self.window_start, self.window_from = {}, None, ({}, {}), None

    async def measure(self, check: CheckSpec, request: MeasureRequest) -> BuiltinWindow:
        texts = await self.admin.scrape(list(request.targets.values()), names=SCRAPED_SAMPLES)
        samples = {name: parse_samples(text) for name, text in texts.items()}  # once, read up to 3 ways
        # Snapshots are stamped on the monotonic clock: their times only ever give spans, in memory.
        mono = request.now if request.monotonic is None else request.monotonic

        def snapshot(version: str | None) -> dict[str, PodCounters]:
            return {name: pod_counters(s, at=mono, gate_version=version) for name, s in samples.items()}

        snap = snapshot(None)
        split = request.canary_version is not None and request.stable_version is not None
        canary_snap = snapshot(request.canary_version) if split else snap
        stable_snap = snapshot(request.stable_version) if split else snap
        # Calibration samples: fleet qps and the stable group's error rate since the last tick.
        prev_all, prev_stable = self.prev.get("all", {}), self.prev.get("stable", {})
        tick = group_from_snapshots(start=prev_all, end=snap, pods=snap.keys())
        stable_tick = group_from_snapshots(start=prev_stable, end=stable_snap, pods=request.stable)
        self.prev = {"all": snap, "stable": stable_snap}
        out: dict[str, Any] = {
            "fleet_qps": tick.qps if tick is not None and tick.seconds > 0 else None,
            "stable_error_rate": stable_tick.error_rate if stable_tick is not None else None,
        }
        if request.analysing:
            if self.window_key != request.window_key:
                # First look at this window (or the first since this process started): it starts now.
                self.window_key, self.window_from, self.window_mono = request.window_key, request.now, mono
                self.window_start = (canary_snap, stable_snap)
            else:
                # The window's start as a wall-clock time is now less the span it has run: the wall
                # clock jumped (forward: the window looked complete at once; back: it waited out the
                # jump) when the one recorded is off by more than a drift.
                start = request.now - (mono - self.window_mono)
                if self.window_from is None or abs(start - self.window_from) > self.JUMP_S:
                    self.window_from = start
                out["canary_metrics"] = group_from_snapshots(start=self.window_start[0], end=canary_snap,
                                                             pods=request.canary)
                out["stable_metrics"] = group_from_snapshots(start=self.window_start[1], end=stable_snap,
                                                             pods=request.stable)
            out["window_from"] = self.window_from
        return BuiltinWindow(**out)


class PrometheusGroups:
    """The builtin check's groups from Prometheus, over the whole window since the analysis start."""

    def __init__(self, api: PrometheusAPI) -> None:
        self.api = api

    def reset(self) -> None:
        pass

    async def measure(self, check: CheckSpec, request: MeasureRequest) -> BuiltinWindow:
        if not request.analysing or request.analysis_started_at is None:
            return BuiltinWindow()
        window = max(1.0, request.now - request.analysis_started_at)
        c = await self.api.group(namespace=request.namespace, pods=list(request.canary), window_s=window,
                                 gate_version=request.canary_version)
        s = await self.api.group(namespace=request.namespace, pods=list(request.stable), window_s=window,
                                 gate_version=request.stable_version)
        groups = [g for g in (c, s) if g is not None]
        return BuiltinWindow(canary_metrics=c, stable_metrics=s,
                             fleet_qps=sum(g.qps for g in groups) if groups else None,
                             stable_error_rate=s.error_rate if s is not None else None,
                             window_from=request.analysis_started_at)


# ---------------------------------------------------------------- declared checks


def _number(value: Any, *, what: str) -> float | None:
    """A JSON value as the measured number: numbers, booleans (1/0), numeric strings; null → no data."""
    if value is None:
        return None
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    # Its kind and size, never its content: the message lands in the GateConfig's status, readable by
    # whoever reads that namespace, and the operator's requests reach pods the callers themselves
    # could not (its source is always allowed), so an answer's text would leak across namespaces.
    raise ValueError(f"{what} is {_kind(value)}, not a number")


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    if isinstance(value, dict):
        return f"an object of {len(value)} fields"
    return type(value).__name__


class PrometheusQuery:
    """``prometheus`` checks: an instant query (``/api/v1/query``) answering a scalar or one series."""

    def __init__(self, *, default_address: str | None, timeout_s: float = 10.0) -> None:
        self.default_address = default_address
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def measure(self, check: CheckSpec, request: MeasureRequest) -> Measured:
        assert check.prometheus is not None
        address = check.prometheus.address or self.default_address
        if not address:
            return Measured(error="no Prometheus address: set provider.prometheus.address or the operator's "
                                  "SPARSEGATE_PROMETHEUS_URL", at=request.now)
        query = render_args(check.prometheus.query, request.args)
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            # POST (form-encoded), as Argo Rollouts sends it: a query naming ~1,000 pods twice is
            # ~60 KB, past what proxies in front of Prometheus take in a URL.
            async with session.post(f"{address.rstrip('/')}/api/v1/query",
                                    data={"query": query, "time": f"{request.now:.3f}"}) as resp:
                raw = await read_capped(resp, ANSWER_LIMIT)
                status = resp.status
        try:
            body = json.loads(raw)
        except ValueError:
            return Measured(error=f"Prometheus answered {status} with no JSON", at=request.now)
        if status != 200 or body.get("status") != "success":
            raise PrometheusError(f"{status}: {body.get('errorType', '')} {body.get('error', '')}".strip())
        data = body.get("data") or {}
        kind, result = data.get("resultType"), data.get("result")
        if kind == "scalar":
            return Measured(value=float(result[1]), at=request.now)
        if kind != "vector":
            return Measured(error=f"query answered a {kind}, not a scalar or an instant vector", at=request.now)
        if not result:
            return Measured(value=None, at=request.now)  # no data
        if len(result) > 1:
            return Measured(error=f"query answered {len(result)} series; aggregate it to one (e.g. sum(...))",
                            at=request.now)
        value = float(result[0]["value"][1])
        return Measured(value=None if math.isnan(value) else value, at=request.now)


class WebRequest:
    """``web`` checks: GET or POST a URL, read JSON, select the number with ``jsonPath``."""

    async def measure(self, check: CheckSpec, request: MeasureRequest) -> Measured:
        web = check.web
        assert web is not None
        url = render_args(web.url, request.args)
        body = render_args(web.body, request.args) if web.body is not None else None
        headers = dict(web.headers)
        # Header names are case-insensitive: a declared "content-type" must not gain a second,
        # JSON one (only the JSON one reached the server: the user's type was lost).
        if body is not None and not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = "application/json"
        timeout = aiohttp.ClientTimeout(total=web.timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.request(web.method, url, data=body, headers=headers) as resp:
                    raw = await read_capped(resp, ANSWER_LIMIT)
                    status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, BodyTooLarge) as e:
            return Measured(error=f"{web.method} {url}: {type(e).__name__} {e}".strip()[:512], at=request.now)
        if not 200 <= status < 300:
            return Measured(error=f"{web.method} {url}: HTTP {status}", at=request.now)
        try:
            doc = json.loads(raw)
            selected = web.json_path.select(doc) if web.json_path is not None else doc
            value = _number(selected, what=web.json_path.text if web.json_path else "the answer")
        except ValueError as e:  # JSON, selection (ExprError) and conversion errors
            return Measured(error=f"{web.method} {url}: {e}"[:512], at=request.now)
        return Measured(value=value, at=request.now)
