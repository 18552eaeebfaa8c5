"""Canary analysis: counter windows, histogram quantiles and verdicts with their numbers."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from sparsegate.domain.analysis import (
    GroupMetrics,
    PodCounters,
    Verdict,
    aggregate,
    DRIFT_DECIDE_FACTOR,
    DRIFT_Z,
    analyse,
    histogram_quantile,
    window_delta,
)
from sparsegate.domain.calibration import Thresholds

INF = math.inf
THR = Thresholds(qps_threshold=20.0, error_rate_cap=0.02, baseline_qps=20.0, baseline_error_rate=0.0)


def group(*, requests: float, errors: float = 0, seconds: float = 10, le_s: float = 0.05, experts: float | None = 1.3,
          pods: int = 1) -> GroupMetrics:
    """All requests in the bucket ending at ``le_s``."""
    buckets = {0.01: 0.0, 0.05: 0.0, 0.1: 0.0, 1.0: 0.0, 2.5: 0.0, INF: 0.0}
    for le in buckets:
        if le >= le_s:
            buckets[le] = requests
    return GroupMetrics(pods=pods, seconds=seconds, requests=requests, errors=errors, duration_buckets=buckets,
                        mean_active_experts=experts)


def judge(canary: GroupMetrics, stable: GroupMetrics | None = None, **kw: float):
    args = dict(thresholds=THR, canary_share=0.25, sla_p99_ms=800.0, max_drift=0.1, min_requests=20)
    args.update(kw)
    return analyse(canary=canary, stable=stable, **args)


def test_histogram_quantile_interpolates_like_promql() -> None:
    buckets = {0.1: 50.0, 0.2: 100.0, INF: 100.0}
    assert histogram_quantile(q=0.5, buckets=buckets) == pytest.approx(0.1)
    assert histogram_quantile(q=0.75, buckets=buckets) == pytest.approx(0.15)
    assert histogram_quantile(q=0.99, buckets={0.1: 0.0, 1.0: 0.0, INF: 10.0}) == 1.0  # +Inf → largest bound
    assert histogram_quantile(q=0.99, buckets={0.1: 0.0, INF: 0.0}) is None


def test_window_delta_and_counter_reset() -> None:
    a = PodCounters(at=0, requests=100, errors=2, duration_buckets={0.1: 90, INF: 100}, experts_sum=130, experts_count=100)
    b = PodCounters(at=10, requests=150, errors=3, duration_buckets={0.1: 130, INF: 150}, experts_sum=200, experts_count=150)
    d = window_delta(start=a, end=b)
    assert (d.requests, d.errors, dict(d.duration_buckets), d.experts_sum, d.experts_count) == (50, 1, {0.1: 40, INF: 50}, 70, 50)
    restarted = PodCounters(at=10, requests=7, errors=0, duration_buckets={0.1: 7, INF: 7})
    assert window_delta(start=a, end=restarted).requests == 7  # reset: counted from zero


def test_aggregate_sums_pods_and_means_experts() -> None:
    d1 = PodCounters(at=10, requests=10, errors=1, duration_buckets={0.1: 10, INF: 10}, experts_sum=10, experts_count=10)
    d2 = PodCounters(at=10, requests=30, errors=0, duration_buckets={0.1: 20, INF: 30}, experts_sum=60, experts_count=30)
    g = aggregate(deltas=[d1, d2], seconds=10)
    assert (g.pods, g.requests, g.errors, g.qps) == (2, 40, 1, 4.0)
    assert dict(g.duration_buckets) == {0.1: 30, INF: 40}
    assert g.mean_active_experts == pytest.approx(70 / 40)


def test_healthy_canary_passes() -> None:
    r = judge(group(requests=60), group(requests=200))
    assert r.verdict == Verdict.PASS, r.message
    assert {c.name: c.passed for c in r.checks} == {"errorRate": True, "p99LatencyMs": True, "drift": True}


def test_error_rate_over_cap_fails_with_numbers() -> None:
    r = judge(group(requests=60, errors=20), group(requests=200))
    assert r.verdict == Verdict.FAIL
    assert [c.name for c in r.failed] == ["errorRate"]
    assert "errorRate 0.3333 > 0.02" in r.message


def test_p99_over_sla_fails() -> None:
    r = judge(group(requests=60, le_s=2.5), group(requests=200))
    assert r.verdict == Verdict.FAIL
    assert [c.name for c in r.failed] == ["p99LatencyMs"]
    assert r.failed[0].value > 800


def test_p99_beyond_the_largest_bucket_is_a_lower_bound_never_within_the_sla() -> None:
    """Every canary request took a minute: the p99 lies in the +Inf bucket and reads as the largest
    finite bound (10 s, PromQL's answer). Under an SLA of 15 s that bound passed the check; it is
    only a lower bound, so the check fails (a p99 over the SLA still fails as before)."""
    buckets = {0.1: 0.0, 1.0: 0.0, 10.0: 0.0, INF: 60.0}
    canary = dataclasses.replace(group(requests=60), duration_buckets=buckets)
    r = judge(canary, group(requests=200), sla_p99_ms=15_000.0)
    assert r.verdict == Verdict.FAIL and [c.name for c in r.failed] == ["p99LatencyMs"], r.message
    assert "p99LatencyMs over 1e+04, the largest finite latency bucket: cannot be shown ≤ 1.5e+04" in r.message
    assert canary.p99_ms == 10_000 and canary.p99_is_lower_bound
    assert judge(canary, group(requests=200), sla_p99_ms=800.0).verdict == Verdict.FAIL
    # Only buckets for +Inf: PromQL's largest finite bound is no bound at all (0 here), never a pass.
    only_inf = dataclasses.replace(group(requests=60), duration_buckets={INF: 60.0})
    assert judge(only_inf, group(requests=200)).verdict == Verdict.FAIL
    # Exactly 1 % beyond the largest bucket: the p99 is that bound itself, a real value that passes.
    edge = dataclasses.replace(group(requests=100), duration_buckets={1.0: 0.0, 10.0: 99.0, INF: 100.0})
    assert not edge.p99_is_lower_bound
    assert judge(edge, group(requests=200), sla_p99_ms=15_000.0).verdict == Verdict.PASS


def test_drift_of_mean_active_experts_fails() -> None:
    r = judge(group(requests=60, experts=2.0), group(requests=200, experts=1.3))
    assert r.verdict == Verdict.FAIL
    assert [c.name for c in r.failed] == ["drift"]
    assert r.failed[0].value == pytest.approx(0.7 / 1.3)


def per_request(means: list[float], **kw) -> GroupMetrics:
    """A group whose requests (of equal length) had these mean active experts per token."""
    g = group(requests=len(means), experts=sum(means) / len(means), **kw)
    return dataclasses.replace(g, request_experts_count=len(means), request_experts_sum=sum(means),
                               request_experts_squares=sum(x * x for x in means))


def spread(mean: float, sd: float, n: int) -> list[float]:
    """n values with exactly this mean and (sample) standard deviation."""
    half = n // 2
    base = [mean + sd] * half + [mean - sd] * (n - half)
    scale = sd / math.sqrt(sum((x - mean) ** 2 for x in base) / (n - 1))
    return [mean + (x - mean) * scale for x in base]


def test_standard_error_from_the_per_request_spread() -> None:
    g = per_request(spread(2.0, 0.6, 20))
    assert g.experts_standard_error == pytest.approx(0.6 / math.sqrt(20))
    assert group(requests=60).experts_standard_error is None  # servers that do not export it
    assert per_request([2.0]).experts_standard_error is None  # one request has no spread


def test_drift_within_noise_keeps_observing() -> None:
    # 20 canary requests 11 % above stable, per-request sd 0.6: 2 standard errors ≈ 14 %.
    r = judge(per_request(spread(2.22, 0.6, 20)), per_request(spread(2.0, 0.6, 200)))
    drift = {c.name: c for c in r.checks}["drift"]
    assert drift.value == pytest.approx(0.11) and drift.undecided and drift.passed is None
    assert r.verdict == Verdict.INCONCLUSIVE and not r.failed
    assert "within noise" in r.message and "more traffic needed" in r.message
    st = {c["name"]: c for c in r.to_status()["checks"]}
    assert st["drift"]["undecided"] is True and st["drift"]["passed"] is None
    assert "undecided" not in st["errorRate"]


def test_drift_beyond_noise_fails() -> None:
    r = judge(per_request(spread(2.6, 0.6, 200)), per_request(spread(2.0, 0.6, 200)))
    assert r.verdict == Verdict.FAIL and [c.name for c in r.failed] == ["drift"]
    assert r.failed[0].value == pytest.approx(0.3)
    assert f"at {DRIFT_Z:g} standard errors" in r.failed[0].describe()


def test_undecided_drift_is_decided_by_the_estimate_after_enough_requests() -> None:
    # Same 11 % with a wide spread: never significant, so at DRIFT_DECIDE_FACTOR × minRequests the
    # estimate decides (a drift at the bound must not hold a step forever).
    n = int(DRIFT_DECIDE_FACTOR * 20)
    r = judge(per_request(spread(2.22, 3.0, n)), per_request(spread(2.0, 3.0, 400)))
    assert r.verdict == Verdict.FAIL and [c.name for c in r.failed] == ["drift"]
    r = judge(per_request(spread(2.22, 3.0, n - 1)), per_request(spread(2.0, 3.0, 400)))
    assert r.verdict == Verdict.INCONCLUSIVE


def test_noise_alone_rarely_fails_drift_where_the_estimate_alone_often_did() -> None:
    """Both groups drawn from one distribution (a gate change that does not move expert
    selection): judged at minRequests, the estimate alone fails a large share of steps; the
    noise-aware check fails about the one-sided DRIFT_Z tail (≈ 2.3 %)."""
    rng = random.Random(13)
    trials, estimate_fails, aware_fails = 2000, 0, 0
    for _ in range(trials):
        draw = lambda n: [max(1.0, rng.gauss(2.0, 0.5)) for _ in range(n)]  # noqa: E731
        canary, stable = per_request(draw(20)), per_request(draw(60))
        r = judge(canary, stable)
        aware_fails += r.verdict == Verdict.FAIL
        c, st = canary.mean_active_experts, stable.mean_active_experts
        estimate_fails += abs(c - st) / st > 0.1
    assert estimate_fails / trials > 0.08, estimate_fails
    assert aware_fails / trials < 0.03 and aware_fails * 4 < estimate_fails, (aware_fails, estimate_fails)


def test_drift_skipped_without_stable_group() -> None:
    r = judge(group(requests=60, experts=3.0), None)
    assert r.verdict == Verdict.PASS
    assert {c.name: c.passed for c in r.checks}["drift"] is None


def test_too_few_requests_is_inconclusive_even_when_failing() -> None:
    r = judge(group(requests=5, errors=5), group(requests=200))
    assert r.verdict == Verdict.INCONCLUSIVE
    assert "inconclusive" in r.message


def test_qps_far_below_expected_share_is_inconclusive() -> None:
    # Expected canary share 1000 qps · 25 % = 250 qps; 10 % of that is 25 qps; 3 qps is far below.
    busy = Thresholds(qps_threshold=1000.0, error_rate_cap=0.02, baseline_qps=None, baseline_error_rate=None)
    r = judge(group(requests=30, seconds=10), group(requests=200), thresholds=busy)
    assert r.verdict == Verdict.INCONCLUSIVE
    assert judge(group(requests=300, seconds=10), group(requests=200), thresholds=busy).verdict == Verdict.PASS


def test_to_status_is_json_ready() -> None:
    st = judge(group(requests=60, errors=20)).to_status()
    assert st["verdict"] == "Fail" and st["canaryRequests"] == 60
    assert {c["name"] for c in st["checks"]} == {"errorRate", "p99LatencyMs", "drift"}


def test_error_rate_is_a_share_even_when_extrapolated_counts_disagree() -> None:
    # Prometheus extrapolates increase() of each counter on its own: errors may read 1e-4 above requests.
    assert group(requests=180.0, errors=180.02).error_rate == 1.0
    assert group(requests=200.0, errors=50.0).error_rate == 0.25
    assert group(requests=0.0).error_rate is None
