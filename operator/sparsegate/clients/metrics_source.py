"""Where canary analysis reads live metrics from: two providers, one shape.

* :class:`DirectScrape` (default): ``GET /metrics`` on every pod IP, parsed by this module's line
  parser (:func:`parse_samples`) into cumulative :class:`PodCounters`; windows are the
  difference of two snapshots (``domain.analysis.window_delta``), per ``gate_version`` series
  when not split by version (a server drops long-retired versions' series). Needs no Prometheus.
* :class:`PrometheusAPI`: PromQL over the HTTP API (``/api/v1/query``) for clusters that
  already scrape the model pods; windows are computed server-side with ``increase()``.
  It assumes the scrape config attaches ``namespace`` and ``pod`` labels (the usual
  kubernetes_sd relabelling); the label names are parameters.

Both answer :class:`GroupMetrics` for a group of pods over a window.

Request-level canary (``spec.rollout.strategy: requests``): every pod serves both versions, so
the two groups are the same pods' series split by the ``gate_version`` label the model server
puts on its request, latency, token, assignment and quality series (``gate_version=`` below).

Mean active experts per token comes from counters, not the last-batch gauge:
``sparsegate_expert_assignments_total / (sparsegate_tokens_total · layers)`` where layers is
the gauge ``sparsegate_moe_layers`` (direct scrape; a server without it: the number of distinct
``layer`` labels of ``sparsegate_expert_tokens_total``, which Prometheus queries count). Its noise: the
per-request histogram ``sparsegate_request_experts_per_token`` (``_sum``, ``_count``) and
``sparsegate_request_experts_per_token_squares_total`` give the per-request spread.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from sparsegate.domain.analysis import GroupMetrics, PodCounters, aggregate, window_delta

__all__ = ["parse_samples", "pod_counters", "SCRAPED_SAMPLES", "PARSED_SAMPLES", "parse_pod_counters",
           "group_from_snapshots", "PrometheusAPI", "PrometheusError"]

REQUESTS = "sparsegate_requests_total"
DURATION = "sparsegate_request_duration_seconds"
DURATION_BUCKET = f"{DURATION}_bucket"
TOKENS = "sparsegate_tokens_total"
ASSIGNMENTS = "sparsegate_expert_assignments_total"
EXPERT_TOKENS = "sparsegate_expert_tokens_total"
MOE_LAYERS = "sparsegate_moe_layers"
REQUEST_EXPERTS = "sparsegate_request_experts_per_token"  # histogram: _sum, _count
REQUEST_EXPERTS_COUNT, REQUEST_EXPERTS_SUM = f"{REQUEST_EXPERTS}_count", f"{REQUEST_EXPERTS}_sum"
REQUEST_EXPERTS_SQUARES = "sparsegate_request_experts_per_token_squares_total"
ACTIVE_GAUGE = "sparsegate_active_experts_per_token"
# Quality (the model server's quality.py): live counters summed over gate versions, and the
# probe set's gauge (one per version the pod holds: its stable, and a request-level canary's).
QUALITY_NLL = "sparsegate_quality_nll_total"
QUALITY_TOKENS = "sparsegate_quality_tokens_total"
PROBE_NLL = "sparsegate_probe_nll_per_token"


def _is_error(code: str) -> bool:
    return code.isdigit() and int(code) >= 500


# The samples the analysis asks a pod for (``/metrics?name[]=…``, prometheus_client's restricted
# registry): not the per-expert series, whose only use here is counting layers on a server that
# predates ``sparsegate_moe_layers`` (such a server answers every series, name[] or not).
SCRAPED_SAMPLES = (REQUESTS, DURATION_BUCKET, TOKENS, ASSIGNMENTS, MOE_LAYERS, ACTIVE_GAUGE,
                   QUALITY_NLL, QUALITY_TOKENS, PROBE_NLL, REQUEST_EXPERTS_COUNT, REQUEST_EXPERTS_SUM,
                   REQUEST_EXPERTS_SQUARES)
# What parse_samples reads; every other line of an exposition is skipped without being parsed.
PARSED_SAMPLES = frozenset((*SCRAPED_SAMPLES, EXPERT_TOKENS))
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")

Sample = tuple[str, dict[str, str], float]


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_samples(text: str, names: frozenset[str] = PARSED_SAMPLES) -> list[Sample]:
    """The samples named in ``names`` of a Prometheus text exposition (0.0.4), as
    prometheus_client's parser reads them; other lines are skipped unparsed. A 1,000-pod step
    scrapes 1,000 expositions per tick on the operator's event loop: the library parser reads
    every label of every series (most are per-expert series the analysis never uses) and took
    three quarters of the operator's CPU there; a malformed wanted line is skipped."""
    out: list[Sample] = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace].strip()
            if name not in names:
                continue
            end = line.rfind("}")
            labels = {k: _unescape(v) for k, v in _LABEL.findall(line, brace + 1, end)}
            rest = line[end + 1:].split()
        else:
            name = line[:space] if space != -1 else line
            if name not in names:
                continue
            labels, rest = {}, line[space + 1:].split()
        try:
            out.append((name, labels, float(rest[0])))
        except (IndexError, ValueError):
            continue
    return out


def _bound(le: str | None) -> float | None:
    try:
        return None if le is None else float(le)
    except ValueError:
        return None


def parse_pod_counters(text: str, *, at: float, gate_version: str | None = None) -> PodCounters:
    """One pod's ``/metrics`` exposition → cumulative counters (unknown metrics ignored)."""
    return pod_counters(parse_samples(text), at=at, gate_version=gate_version)


class _Sums:
    """The counters of one ``gate_version`` (or of every version): running sums."""

    __slots__ = ("requests", "errors", "tokens", "assignments", "buckets", "quality_nll", "quality_tokens",
                 "rx_count", "rx_sum", "rx_squares")

    def __init__(self) -> None:
        self.requests = self.errors = self.tokens = self.assignments = 0.0
        self.quality_nll = self.quality_tokens = 0.0
        self.rx_count = self.rx_sum = self.rx_squares = 0.0  # per-request experts: count, sum, squares
        self.buckets: dict[float, float] = {}

    def add(self, name: str, labels: Mapping[str, str], value: float) -> bool:
        """Count one sample; False when it is none of these counters."""
        if name == REQUESTS:
            self.requests += value
            if _is_error(labels.get("code", "")):
                self.errors += value
        elif name == DURATION_BUCKET:
            le = _bound(labels.get("le"))
            if le is not None:  # a bucket without a readable bound is left out
                self.buckets[le] = self.buckets.get(le, 0.0) + value
        elif name == TOKENS:
            self.tokens += value
        elif name == ASSIGNMENTS:
            self.assignments += value
        elif name == QUALITY_NLL:
            self.quality_nll += value
        elif name == QUALITY_TOKENS:
            self.quality_tokens += value
        elif name == REQUEST_EXPERTS_COUNT:
            self.rx_count += value
        elif name == REQUEST_EXPERTS_SUM:
            self.rx_sum += value
        elif name == REQUEST_EXPERTS_SQUARES:
            self.rx_squares += value
        else:
            return False
        return True

    def counters(self, *, at: float, layers: float, gauge: float | None = None, probe_nll: float | None = None,
                 by_version: Mapping[str, PodCounters] | None = None) -> PodCounters:
        return PodCounters(
            at=at,
            requests=self.requests,
            errors=self.errors,
            duration_buckets=self.buckets,
            experts_sum=self.assignments,
            experts_count=self.tokens * layers,
            experts_gauge=gauge,
            quality_nll=self.quality_nll,
            quality_tokens=self.quality_tokens,
            probe_nll=probe_nll,
            request_experts_count=self.rx_count,
            request_experts_sum=self.rx_sum,
            request_experts_squares=self.rx_squares,
            by_version=by_version or {},
        )


def pod_counters(samples: Iterable[Sample], *, at: float, gate_version: str | None = None) -> PodCounters:
    """Cumulative counters of one pod's samples (:func:`parse_samples`).

    ``gate_version``: count only the samples of the requests that version served (labelled
    ``gate_version``); the last-batch gauge, which no version owns, is then left out.
    Without it, every version's counters summed, and each version's own in ``by_version``
    (a window is each version's delta summed: ``domain.analysis.window_delta``)."""
    total = _Sums()
    versions: dict[str, _Sums] = {}
    layers: set[str] = set()
    moe_layers: float | None = None
    gauge: float | None = None
    probe_nll: float | None = None
    for name, labels, value in samples:
        if gate_version is not None and name not in (EXPERT_TOKENS, MOE_LAYERS) \
                and labels.get("gate_version") != gate_version:
            continue
        if total.add(name, labels, value):
            if gate_version is None:
                version = labels.get("gate_version", "")
                sums = versions.get(version)
                if sums is None:
                    sums = versions[version] = _Sums()
                sums.add(name, labels, value)
        elif name == EXPERT_TOKENS:
            layers.add(labels.get("layer", ""))
        elif name == MOE_LAYERS and value >= 1:
            moe_layers = value
        elif name == ACTIVE_GAUGE:
            gauge = value
        elif name == PROBE_NLL and math.isfinite(value):
            probe_nll = value
    n_layers = moe_layers if moe_layers is not None else max(1, len(layers))
    by_version = {v: sums.counters(at=at, layers=n_layers) for v, sums in versions.items()}
    return total.counters(at=at, layers=n_layers, gauge=gauge, probe_nll=probe_nll, by_version=by_version)


def group_from_snapshots(
    *, start: Mapping[str, PodCounters], end: Mapping[str, PodCounters], pods: Iterable[str]
) -> GroupMetrics | None:
    """Window metrics of ``pods`` between two snapshot maps (pods missing at the end are left out).

    A pod without a start snapshot (new, or first seen after an operator restart) contributes
    only from its next snapshot on, so a restart shortens the window rather than inventing data.
    """
    deltas: list[PodCounters] = []
    spans: list[float] = []
    for name in pods:
        if name in end and name in start:
            deltas.append(window_delta(start=start[name], end=end[name]))
            spans.append(end[name].at - start[name].at)
    if not deltas:
        return None
    return aggregate(deltas=deltas, seconds=max(spans) if spans else 0.0)


class PrometheusError(RuntimeError):
    pass


_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


class PrometheusAPI:
    """Windowed group metrics from a Prometheus server's HTTP API."""

    def __init__(self, url: str, *, namespace_label: str = "namespace", pod_label: str = "pod",
                 timeout_s: float = 5.0) -> None:
        self._url = url.rstrip("/")
        self._ns_label, self._pod_label = namespace_label, pod_label
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def selector(self, *, namespace: str, pods: Sequence[str]) -> str:
        for value in (namespace, *pods):
            if not _SAFE.match(value):  # Kubernetes names never need quoting; refuse anything else
                raise ValueError(f"unexpected characters in {value!r}")
        # `.` is the one regex metacharacter a Kubernetes name may hold: match it literally
        # (`\\.` in the PromQL string is the regex `\.`), so `a.b` never matches `axb`.
        alternatives = "|".join(p.replace(".", "\\\\.") for p in sorted(pods))
        return f'{self._ns_label}="{namespace}",{self._pod_label}=~"{alternatives}"'

    def queries(self, *, namespace: str, pods: Sequence[str], window_s: float,
                gate_version: str | None = None) -> dict[str, str]:
        """``gate_version``: only that version's requests (request-level canary); the layer
        count still comes from the pods' per-expert series, which no version owns."""
        pod_sel = self.selector(namespace=namespace, pods=pods)
        sel = pod_sel
        if gate_version is not None:
            if not _SAFE.match(gate_version):
                raise ValueError(f"unexpected characters in {gate_version!r}")
            sel = f'{pod_sel},gate_version="{gate_version}"'
        w = f"{max(1, math.ceil(window_s))}s"
        return {
            "requests": f"sum(increase({REQUESTS}{{{sel}}}[{w}]))",
            "errors": f'sum(increase({REQUESTS}{{{sel},code=~"5.."}}[{w}]))',
            "p99": f"histogram_quantile(0.99, sum by (le) (increase({DURATION_BUCKET}{{{sel}}}[{w}])))",
            # The share of observations beyond the largest finite bucket: over 1 %, the p99 above is
            # that bucket's bound, only a lower bound (domain.analysis.quantile_beyond_buckets).
            "p99_beyond": (f'1 - max(sum by (le) (increase({DURATION_BUCKET}{{{sel},le!="+Inf"}}[{w}]))) '
                           f'/ sum(increase({DURATION_BUCKET}{{{sel},le="+Inf"}}[{w}]))'),
            "assignments": f"sum(increase({ASSIGNMENTS}{{{sel}}}[{w}]))",
            "tokens": f"sum(increase({TOKENS}{{{sel}}}[{w}]))",
            "layers": f'count(count by (layer) ({EXPERT_TOKENS}{{{pod_sel}}}))',
            "quality_nll": f"sum(increase({QUALITY_NLL}{{{sel}}}[{w}]))",
            "quality_tokens": f"sum(increase({QUALITY_TOKENS}{{{sel}}}[{w}]))",
            "probe_nll": f"avg({PROBE_NLL}{{{sel}}})",
            "request_experts_count": f"sum(increase({REQUEST_EXPERTS_COUNT}{{{sel}}}[{w}]))",
            "request_experts_sum": f"sum(increase({REQUEST_EXPERTS_SUM}{{{sel}}}[{w}]))",
            "request_experts_squares": f"sum(increase({REQUEST_EXPERTS_SQUARES}{{{sel}}}[{w}]))",
        }

    async def _scalar(self, session: aiohttp.ClientSession, query: str, *, at: float) -> float | None:
        form = {"query": query, "time": f"{at:.3f}"}
        # POST (form-encoded): a group's pod alternation can make a URL too long for a proxy.
        async with session.post(f"{self._url}/api/v1/query", data=form) as resp:
            body: Any = await resp.json(content_type=None)
        if resp.status != 200 or body.get("status") != "success":
            raise PrometheusError(f"query {query!r}: {resp.status} {body.get('error', body)}")
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value

    async def group(self, *, namespace: str, pods: Sequence[str], window_s: float,
                    gate_version: str | None = None) -> GroupMetrics | None:
        if not pods:
            return None
        qs = self.queries(namespace=namespace, pods=pods, window_s=window_s, gate_version=gate_version)
        # One evaluation instant for every query: the group's ratios (error rate, mean experts)
        # divide two of them, and increase() extrapolates by the samples its window holds, so a
        # scrape landing between two queries scaled one side only (e-2e: error rate 0.375 vs 0.422).
        at = time.time()
        # At once, not one after another: each query has its own timeout, so a slow Prometheus made
        # a group 13 round trips (up to 13 x timeout_s) long.
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            tasks = [asyncio.ensure_future(self._scalar(session, q, at=at)) for q in qs.values()]
            try:
                answers = await asyncio.gather(*tasks)
            finally:  # one failed (or the caller gave up): the others are not left running
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        values = dict(zip(qs, answers))
        if values["requests"] is None:
            return None
        tokens, layers = values["tokens"] or 0.0, values["layers"] or 1.0
        # Live quality needs both sums: a NaN NLL (a counter a broken server poisoned: _scalar reads
        # it as None) or no series is no live quality at all, never a perfect one (NLL 0).
        quality_nll = values["quality_nll"]
        quality_tokens = (values["quality_tokens"] or 0.0) if quality_nll is not None else 0.0
        mean = (values["assignments"] or 0.0) / (tokens * layers) if tokens > 0 else None
        return GroupMetrics(
            pods=len(pods),
            seconds=window_s,
            requests=values["requests"],
            errors=values["errors"] or 0.0,
            duration_buckets={},
            mean_active_experts=mean,
            p99_seconds=values["p99"],
            p99_beyond_buckets=(values["p99_beyond"] or 0.0) > 1.0 - 0.99,
            quality_nll=quality_nll or 0.0,
            quality_tokens=quality_tokens,
            probe_nll=values["probe_nll"],
            request_experts_count=values["request_experts_count"] or 0.0,
            request_experts_sum=values["request_experts_sum"] or 0.0,
            request_experts_squares=values["request_experts_squares"] or 0.0,
        )
