"""Canary analysis: live model-server metrics → pass / fail / inconclusive.

Metric sources (direct ``/metrics`` scrape or Prometheus) reduce each pod to a
:class:`PodCounters` snapshot of *cumulative* counters. A window is the
difference of two snapshots (:func:`window_delta`), summed per group
(canary pods vs stable pods) into :class:`GroupMetrics`. Prometheus already
answers windowed questions and builds :class:`GroupMetrics` directly.

Checks on the canary group (each reported with its numbers):

* ``errorRate`` ≤ calibrated cap (see :mod:`sparsegate.domain.calibration`);
  errors are responses with status ≥ 500.
* ``p99LatencyMs`` ≤ ``slaP99LatencyMs``, estimated from histogram buckets
  the way PromQL's ``histogram_quantile`` does (linear within a bucket). A p99 beyond the
  largest finite bucket reads as that bucket's bound, which is only a lower bound: it fails
  when the SLA is below it, as any p99 over the SLA does, and also when it is not, since
  such a p99 cannot be shown to be within the SLA (the model server's largest latency bucket
  is 120 s: a p99 beyond it cannot be evaluated, whatever ``slaP99LatencyMs`` says).
* ``drift``: relative difference of mean active experts per token, canary vs
  stable, ≤ ``maxDrift`` (only when both groups have enough requests; the last
  step has no stable group). Noise-aware when the model servers export the
  per-request spread (``sparsegate_request_experts_per_token`` and its squares):
  a drift over ``maxDrift`` fails only when it is over it by more than
  ``DRIFT_Z`` standard errors of the difference; within that band the check is
  undecided and the step keeps observing (the window grows, the error shrinks),
  until the canary has ``DRIFT_DECIDE_FACTOR × minRequests`` requests, when the
  drift itself decides. Without the spread the drift itself decides at once.

* ``qualityDrop``: how much worse the canary predicts text than stable, as the relative
  increase of perplexity, exp(canary mean NLL − stable mean NLL) − 1, ≤ ``maxQualityDrop``.
  From the probe set both score at gate load (same tokens on both sides) when both groups
  report it, else from live traffic's scored prompt tokens when each group scored at least
  ``MIN_QUALITY_TOKENS`` in the window; otherwise not evaluated (nor at the last step of strategy
  instances, which leaves no stable group; under requests every pod holds and scores both).

Traffic gates the verdict: with fewer than ``minRequests`` canary requests, or
canary qps far below its expected share of the calibrated qps threshold, the
result is INCONCLUSIVE and the step keeps observing. Any failing check with
enough traffic is FAIL at once (fail fast); PASS needs every check to pass.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sparsegate.domain.calibration import INCONCLUSIVE_FRACTION, Thresholds

__all__ = [
    "PodCounters",
    "GroupMetrics",
    "Verdict",
    "Check",
    "AnalysisResult",
    "window_delta",
    "aggregate",
    "histogram_quantile",
    "quantile_beyond_buckets",
    "analyse",
    "MIN_QUALITY_TOKENS",
    "DRIFT_Z",
    "DRIFT_DECIDE_FACTOR",
    "drift_check",
]

# Fewest live-traffic tokens per group for the live quality comparison: below it the mean NLL
# of a window is too noisy to compare (a token's NLL varies by ~1-2 nats on a small LM).
MIN_QUALITY_TOKENS = 2000.0

# Drift fails only this many standard errors beyond maxDrift (one-sided ≈ 97.7 % when the
# per-request means are near normal): mean experts over 20 requests can be 10 % off by noise alone.
DRIFT_Z = 2.0
# Undecided drift stops waiting at this many times minRequests canary requests: the point
# estimate decides (a drift sitting exactly at maxDrift would otherwise never be decided).
DRIFT_DECIDE_FACTOR = 10.0


@dataclass(frozen=True)
class PodCounters:
    """Cumulative counters of one pod at one scrape (seconds since epoch ``at``)."""

    at: float
    requests: float = 0.0
    errors: float = 0.0  # responses with status code ≥ 500
    # Cumulative histogram buckets of request duration: upper bound (s) → count (le semantics).
    duration_buckets: Mapping[float, float] = field(default_factory=dict)
    # Active experts per token: cumulative sum and count (histogram/summary), when exported so.
    experts_sum: float = 0.0
    experts_count: float = 0.0
    # Or an instantaneous gauge value, when exported as a gauge.
    experts_gauge: float | None = None
    # Quality: live traffic's summed NLL (nats) over scored tokens (counters), and the probe
    # set's mean NLL per token under the gate in effect (gauge; None when not exported).
    quality_nll: float = 0.0
    quality_tokens: float = 0.0
    probe_nll: float | None = None
    # Per-request mean active experts (one observation per request): count, sum, sum of squares.
    request_experts_count: float = 0.0
    request_experts_sum: float = 0.0
    request_experts_squares: float = 0.0
    # A snapshot of every version (unfiltered): the same counters per ``gate_version`` label, so a
    # window is the sum of each version's own delta (:func:`window_delta`). Empty: filtered by
    # version, or built by hand; the totals above are then the only series.
    by_version: Mapping[str, PodCounters] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupMetrics:
    """What one group of pods did during a window."""

    pods: int
    seconds: float
    requests: float
    errors: float
    duration_buckets: Mapping[float, float]  # cumulative (le) counts within the window
    mean_active_experts: float | None
    # Prometheus computes p99 server-side; direct scrapes leave it None (derived from buckets).
    p99_seconds: float | None = None
    # Prometheus: whether more than 1 % of the window's observations lie beyond the largest finite
    # bucket, so p99_seconds is that bucket's bound, a lower bound (direct scrapes: from the buckets).
    p99_beyond_buckets: bool = False
    quality_nll: float = 0.0       # live traffic: summed NLL of scored tokens in the window
    quality_tokens: float = 0.0
    probe_nll: float | None = None  # probe set: mean NLL per token (mean over the group's pods)
    # Per-request mean active experts: count, sum and sum of squares (0 when not exported).
    request_experts_count: float = 0.0
    request_experts_sum: float = 0.0
    request_experts_squares: float = 0.0

    @property
    def experts_standard_error(self) -> float | None:
        """Standard error of the group's mean active experts, from the spread of the per-request
        means (s / √n; None below two requests or when the servers do not export the spread).
        The mean itself is token-weighted: this is its error when requests are of like length."""
        n = self.request_experts_count
        if n < 2:
            return None
        variance = (self.request_experts_squares - self.request_experts_sum ** 2 / n) / (n - 1)
        return math.sqrt(max(0.0, variance) / n)

    @property
    def live_mean_nll(self) -> float | None:
        return self.quality_nll / self.quality_tokens if self.quality_tokens > 0 else None

    @property
    def qps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def error_rate(self) -> float | None:
        # Errors are a subset of requests; Prometheus' increase() extrapolates the two counters
        # separately and can return a ratio a hair above 1 (1.000111 seen), which is clamped.
        return min(1.0, self.errors / self.requests) if self.requests > 0 else None

    @property
    def p99_is_lower_bound(self) -> bool:
        """The p99 lies beyond the largest finite bucket (in the +Inf one): :attr:`p99_ms` is then
        that bucket's bound (PromQL's answer), and the real p99 is anywhere above it."""
        if self.p99_seconds is not None:
            return self.p99_beyond_buckets
        return quantile_beyond_buckets(q=0.99, buckets=self.duration_buckets)

    @property
    def p99_ms(self) -> float | None:
        if self.p99_seconds is not None:
            return self.p99_seconds * 1000.0
        q = histogram_quantile(q=0.99, buckets=self.duration_buckets)
        return None if q is None else q * 1000.0


def _counter_delta(new: float, old: float) -> float:
    # A restarted pod resets its counters: count from zero, as PromQL's rate() does.
    return new - old if new >= old else new


def window_delta(*, start: PodCounters | None, end: PodCounters) -> PodCounters:
    """Counters accumulated between two scrapes of one pod (``start`` None: since pod start).

    Snapshots of every version (``by_version`` on both): each version's own delta, summed. A
    version absent at the start counts from 0, one absent at the end (its series removed by the
    server) adds nothing, and a version whose own counters went down restarted them. Summing
    first would read the removal of a retired version's series as a pod restart."""
    if start is None:
        return end
    if start.by_version and end.by_version:
        deltas = [_version_delta(start=start.by_version.get(v), end=e, at=start.at)
                  for v, e in end.by_version.items()]
        buckets: dict[float, float] = {}
        for d in deltas:
            for le, c in d.duration_buckets.items():
                buckets[le] = buckets.get(le, 0.0) + c
        return PodCounters(
            at=end.at,
            requests=sum(d.requests for d in deltas),
            errors=sum(d.errors for d in deltas),
            duration_buckets=buckets,
            experts_sum=sum(d.experts_sum for d in deltas),
            experts_count=sum(d.experts_count for d in deltas),
            experts_gauge=end.experts_gauge,
            quality_nll=sum(d.quality_nll for d in deltas),
            quality_tokens=sum(d.quality_tokens for d in deltas),
            probe_nll=end.probe_nll,
            request_experts_count=sum(d.request_experts_count for d in deltas),
            request_experts_sum=sum(d.request_experts_sum for d in deltas),
            request_experts_squares=sum(d.request_experts_squares for d in deltas),
        )
    return _version_delta(start=start, end=end, at=start.at)


def _version_delta(*, start: PodCounters | None, end: PodCounters, at: float) -> PodCounters:
    """One series set's delta (start None: absent at the start, counted from 0)."""
    if start is None:
        start = PodCounters(at=at)
    reset = end.requests < start.requests
    base = PodCounters(at=start.at) if reset else start
    return PodCounters(
        at=end.at,
        requests=_counter_delta(end.requests, base.requests),
        errors=_counter_delta(end.errors, base.errors),
        duration_buckets={
            le: _counter_delta(c, base.duration_buckets.get(le, 0.0)) for le, c in end.duration_buckets.items()
        },
        experts_sum=_counter_delta(end.experts_sum, base.experts_sum),
        experts_count=_counter_delta(end.experts_count, base.experts_count),
        experts_gauge=end.experts_gauge,
        quality_nll=_counter_delta(end.quality_nll, base.quality_nll),
        quality_tokens=_counter_delta(end.quality_tokens, base.quality_tokens),
        probe_nll=end.probe_nll,
        request_experts_count=_counter_delta(end.request_experts_count, base.request_experts_count),
        request_experts_sum=_counter_delta(end.request_experts_sum, base.request_experts_sum),
        request_experts_squares=_counter_delta(end.request_experts_squares, base.request_experts_squares),
    )


def aggregate(*, deltas: Iterable[PodCounters], seconds: float) -> GroupMetrics:
    """Sum per-pod window deltas into one group."""
    deltas = list(deltas)
    buckets: dict[float, float] = {}
    for d in deltas:
        for le, c in d.duration_buckets.items():
            buckets[le] = buckets.get(le, 0.0) + c
    experts_count = sum(d.experts_count for d in deltas)
    if experts_count > 0:
        mean_experts: float | None = sum(d.experts_sum for d in deltas) / experts_count
    else:
        gauges = [d.experts_gauge for d in deltas if d.experts_gauge is not None and d.requests > 0]
        mean_experts = sum(gauges) / len(gauges) if gauges else None
    return GroupMetrics(
        pods=len(deltas),
        seconds=seconds,
        requests=sum(d.requests for d in deltas),
        errors=sum(d.errors for d in deltas),
        duration_buckets=buckets,
        mean_active_experts=mean_experts,
        quality_nll=sum(d.quality_nll for d in deltas),
        quality_tokens=sum(d.quality_tokens for d in deltas),
        probe_nll=sum(probes) / len(probes) if (probes := [d.probe_nll for d in deltas if d.probe_nll is not None]) else None,
        request_experts_count=sum(d.request_experts_count for d in deltas),
        request_experts_sum=sum(d.request_experts_sum for d in deltas),
        request_experts_squares=sum(d.request_experts_squares for d in deltas),
    )


def histogram_quantile(*, q: float, buckets: Mapping[float, float]) -> float | None:
    """PromQL ``histogram_quantile`` over cumulative ``le`` buckets; None without observations.

    Linear interpolation inside the bucket holding the rank; a rank in the +Inf
    bucket answers the largest finite bound (as PromQL does).
    """
    if not buckets:
        return None
    ordered = sorted(buckets.items())
    total = ordered[-1][1] if math.isinf(ordered[-1][0]) else max(c for _, c in ordered)
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def quantile_beyond_buckets(*, q: float, buckets: Mapping[float, float]) -> bool:
    """Whether the ``q`` quantile of cumulative ``le`` buckets lies in the +Inf bucket, where
    :func:`histogram_quantile` answers the largest finite bound (0 without one): a lower bound."""
    total = buckets.get(math.inf, 0.0)
    finite = [c for le, c in buckets.items() if not math.isinf(le)]
    return total > 0 and max(finite, default=0.0) < q * total


class Verdict(str, enum.Enum):
    PASS = "Pass"
    # Every check passed with enough traffic.
    FAIL = "Fail"
    # At least one check failed with enough traffic: roll back.
    INCONCLUSIVE = "Inconclusive"
    # Not enough traffic to judge: keep observing.


@dataclass(frozen=True)
class Check:
    name: str
    value: float | None
    threshold: float
    passed: bool | None  # None: not evaluated (no data), or undecided
    detail: str = ""  # the numbers behind the value, e.g. both groups' perplexities
    # Over the threshold but within noise: neither passed nor failed, the step keeps observing.
    undecided: bool = False
    # The value is a lower bound (a quantile beyond the histogram's largest finite bucket).
    lower_bound: bool = False

    def describe(self) -> str:
        if self.passed is None and not self.undecided:  # e.g. drift at 100 %: no stable group left
            return f"{self.name} not evaluated (no data)"
        value = "n/a" if self.value is None else f"{self.value:.4g}"
        detail = f" ({self.detail})" if self.detail else ""
        if self.undecided:
            return f"{self.name} {value} > {self.threshold:.4g} within noise{detail}: more traffic needed"
        if self.lower_bound and self.value is not None and self.value <= self.threshold:
            return (f"{self.name} over {value}, the largest finite latency bucket: cannot be shown "
                    f"≤ {self.threshold:.4g}{detail}")
        return f"{self.name} {value} {'≤' if self.passed else '>'} {self.threshold:.4g}{detail}"


@dataclass(frozen=True)
class AnalysisResult:
    verdict: Verdict
    checks: tuple[Check, ...]
    canary_requests: float
    canary_qps: float
    message: str

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.passed is False)

    def to_status(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "canaryRequests": round(self.canary_requests, 3),
            "canaryQps": round(self.canary_qps, 3),
            "checks": [
                {
                    "name": c.name,
                    "value": None if c.value is None else round(c.value, 6),
                    "threshold": round(c.threshold, 6),
                    "passed": c.passed,
                    **({"undecided": True} if c.undecided else {}),
                }
                for c in self.checks
            ],
            "message": self.message,
        }


def analyse(
    *,
    canary: GroupMetrics,
    stable: GroupMetrics | None,
    thresholds: Thresholds,
    canary_share: float,
    sla_p99_ms: float,
    max_drift: float,
    min_requests: float,
    max_quality_drop: float | None = None,
) -> AnalysisResult:
    """Judge the canary group over one window (pure; see module docstring)."""
    checks: list[Check] = []

    error_rate = canary.error_rate
    checks.append(
        Check(
            name="errorRate",
            value=error_rate,
            threshold=thresholds.error_rate_cap,
            passed=None if error_rate is None else error_rate <= thresholds.error_rate_cap,
        )
    )
    p99 = canary.p99_ms
    # Beyond the largest finite bucket the p99 reads as that bound: a lower bound never passes.
    beyond = p99 is not None and canary.p99_is_lower_bound
    checks.append(Check(name="p99LatencyMs", value=p99, threshold=sla_p99_ms,
                        passed=None if p99 is None else p99 <= sla_p99_ms and not beyond, lower_bound=beyond))

    drift = drift_check(canary=canary, stable=stable, max_drift=max_drift, min_requests=min_requests)
    checks.append(drift)

    if max_quality_drop is not None:
        checks.append(quality_check(canary=canary, stable=stable, max_quality_drop=max_quality_drop))

    expected_qps = thresholds.qps_threshold * canary_share
    enough = canary.requests >= min_requests and canary.qps >= INCONCLUSIVE_FRACTION * expected_qps
    numbers = "; ".join(c.describe() for c in checks)
    traffic = f"canary {canary.requests:.0f} requests at {canary.qps:.3g} qps"
    undecided = [c for c in checks if c.undecided]
    if not enough:
        verdict = Verdict.INCONCLUSIVE
        message = (
            f"inconclusive: {traffic} (need ≥ {min_requests:.0f} requests and "
            f"≥ {INCONCLUSIVE_FRACTION * expected_qps:.3g} qps); {numbers}"
        )
    elif any(c.passed is False for c in checks):
        verdict = Verdict.FAIL
        failed = "; ".join(c.describe() for c in checks if c.passed is False)
        message = f"failed: {failed} ({traffic})"
    elif undecided:
        verdict = Verdict.INCONCLUSIVE
        message = f"inconclusive: {'; '.join(c.describe() for c in undecided)} ({traffic}); {numbers}"
    else:
        verdict = Verdict.PASS
        message = f"passed: {numbers} ({traffic})"
    return AnalysisResult(
        verdict=verdict,
        checks=tuple(checks),
        canary_requests=canary.requests,
        canary_qps=canary.qps,
        message=message,
    )


def drift_check(*, canary: GroupMetrics, stable: GroupMetrics | None, max_drift: float,
                min_requests: float) -> Check:
    """``drift``: relative difference of mean active experts, canary vs stable (module docstring).

    Fails when the drift exceeds ``max_drift`` by more than ``DRIFT_Z`` standard errors of the
    difference (both groups' per-request spread); a drift over ``max_drift`` within that band is
    undecided until the canary has ``DRIFT_DECIDE_FACTOR × min_requests`` requests."""
    name = "drift"
    if (stable is None or stable.requests < min_requests or canary.mean_active_experts is None
            or stable.mean_active_experts is None or stable.mean_active_experts <= 0):
        return Check(name=name, value=None, threshold=max_drift, passed=None)
    base = stable.mean_active_experts
    drift = abs(canary.mean_active_experts - base) / base
    if drift <= max_drift:
        return Check(name=name, value=drift, threshold=max_drift, passed=True)
    se_c, se_s = canary.experts_standard_error, stable.experts_standard_error
    if se_c is None or se_s is None:  # the servers do not export the spread: the drift decides
        return Check(name=name, value=drift, threshold=max_drift, passed=False)
    noise = DRIFT_Z * math.sqrt(se_c ** 2 + se_s ** 2) / base
    detail = (f"canary {canary.mean_active_experts:.4g} vs stable {base:.4g} experts/token, "
              f"±{noise:.3g} at {DRIFT_Z:g} standard errors")
    if drift - noise > max_drift or canary.requests >= DRIFT_DECIDE_FACTOR * min_requests:
        return Check(name=name, value=drift, threshold=max_drift, passed=False, detail=detail)
    return Check(name=name, value=drift, threshold=max_drift, passed=None, detail=detail, undecided=True)


def quality_check(*, canary: GroupMetrics, stable: GroupMetrics | None, max_quality_drop: float) -> Check:
    """``qualityDrop``: relative perplexity increase of the canary over stable (module docstring)."""
    name = "qualityDrop"
    if stable is None:
        return Check(name=name, value=None, threshold=max_quality_drop, passed=None)
    if canary.probe_nll is not None and stable.probe_nll is not None:
        source, c_nll, s_nll = "probe set", canary.probe_nll, stable.probe_nll
    elif (canary.live_mean_nll is not None and stable.live_mean_nll is not None
          and min(canary.quality_tokens, stable.quality_tokens) >= MIN_QUALITY_TOKENS):
        source, c_nll, s_nll = "live traffic", canary.live_mean_nll, stable.live_mean_nll
    else:
        return Check(name=name, value=None, threshold=max_quality_drop, passed=None)
    # exp of a huge difference would overflow: cap the exponent (the check fails either way).
    drop = math.exp(min(c_nll - s_nll, 50.0)) - 1.0
    detail = (f"{source}: canary perplexity {math.exp(min(c_nll, 50.0)):.4g} vs stable "
              f"{math.exp(min(s_nll, 50.0)):.4g}")
    return Check(name=name, value=drop, threshold=max_quality_drop, passed=drop <= max_quality_drop,
                 detail=detail)
