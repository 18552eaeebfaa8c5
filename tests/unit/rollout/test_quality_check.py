"""The builtin analysis's quality check: canary vs stable perplexity from the probe set or live
traffic, its bound ``spec.rollout.maxQualityDrop``, and the metrics it reads from a real
model server's exposition (names shared with sparsegate_workload.quality)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sparsegate.clients.metrics_source import PrometheusAPI, parse_pod_counters
from sparsegate.domain.analysis import (
    MIN_QUALITY_TOKENS,
    GroupMetrics,
    PodCounters,
    Verdict,
    aggregate,
    analyse,
    window_delta,
)
from sparsegate.domain.calibration import Thresholds
from sparsegate.domain.rollout import DEFAULT_MAX_QUALITY_DROP, parse_spec

THR = Thresholds(qps_threshold=20.0, error_rate_cap=0.02, baseline_qps=20.0, baseline_error_rate=0.0)
PARAMS = {"confidenceThreshold": 0.6}


def group(*, probe: float | None = None, nll: float = 0.0, tokens: float = 0.0, requests: float = 100) -> GroupMetrics:
    return GroupMetrics(pods=1, seconds=10, requests=requests, errors=0, duration_buckets={0.05: requests, math.inf: requests},
                        mean_active_experts=1.3, quality_nll=nll, quality_tokens=tokens, probe_nll=probe)


def judge(canary: GroupMetrics, stable: GroupMetrics | None, max_quality_drop: float | None = 0.02):
    return analyse(canary=canary, stable=stable, thresholds=THR, canary_share=0.25, sla_p99_ms=800.0, max_drift=0.1,
                   min_requests=20, max_quality_drop=max_quality_drop)


def quality(result) -> dict:
    return next(c for c in result.to_status()["checks"] if c["name"] == "qualityDrop")


def test_probe_perplexity_rise_over_the_bound_fails_naming_quality_and_both_perplexities() -> None:
    # ln 4.8310 = 1.5751, ln 4.1873 = 1.4321: the trained demo model, top-1 vs its trained gate.
    result = judge(group(probe=1.5751), group(probe=1.4321))
    assert result.verdict is Verdict.FAIL
    assert quality(result)["value"] == pytest.approx(math.exp(1.5751 - 1.4321) - 1, abs=1e-6)
    assert [c.name for c in result.failed] == ["qualityDrop"]
    assert "qualityDrop 0.1537 > 0.02" in result.message
    assert "probe set: canary perplexity 4.831 vs stable 4.187" in result.message


def test_small_or_negative_change_passes() -> None:
    assert judge(group(probe=1.4317), group(probe=1.4321)).verdict is Verdict.PASS  # better: negative drop
    assert judge(group(probe=1.4321 + math.log(1.019)), group(probe=1.4321)).verdict is Verdict.PASS
    assert judge(group(probe=1.4321 + math.log(1.021)), group(probe=1.4321)).verdict is Verdict.FAIL


def test_live_traffic_needs_enough_tokens_in_both_groups() -> None:
    few = judge(group(nll=3.0 * 100, tokens=100), group(nll=1.0 * 5000, tokens=5000))
    assert quality(few)["passed"] is None and few.verdict is Verdict.PASS
    n = MIN_QUALITY_TOKENS
    bad = judge(group(nll=1.6 * n, tokens=n), group(nll=1.4 * 3 * n, tokens=3 * n))
    assert bad.verdict is Verdict.FAIL and "live traffic: canary perplexity" in bad.message
    ok = judge(group(nll=1.4 * n, tokens=n), group(nll=1.4 * 3 * n, tokens=3 * n))
    assert quality(ok)["passed"] is True and quality(ok)["value"] == pytest.approx(0.0, abs=1e-12)


def test_probe_preferred_over_live_traffic() -> None:
    n = MIN_QUALITY_TOKENS
    r = judge(group(probe=1.43, nll=9.0 * n, tokens=n), group(probe=1.43, nll=1.0 * n, tokens=n))
    assert r.verdict is Verdict.PASS and quality(r)["value"] == 0.0


def test_not_evaluated_without_stable_group_or_when_disabled() -> None:
    assert quality(judge(group(probe=5.0), None))["passed"] is None
    assert judge(group(probe=5.0), None).verdict is Verdict.PASS
    assert all(c["name"] != "qualityDrop" for c in judge(group(probe=5.0), group(probe=1.0), None).to_status()["checks"])


def test_huge_nll_difference_does_not_overflow() -> None:
    r = judge(group(probe=2000.0), group(probe=1.0))
    assert r.verdict is Verdict.FAIL and math.isfinite(quality(r)["value"])


def test_window_delta_and_aggregate_of_quality_counters() -> None:
    a = PodCounters(at=0, requests=10, quality_nll=100.0, quality_tokens=50, probe_nll=1.5)
    b = PodCounters(at=5, requests=20, quality_nll=160.0, quality_tokens=90, probe_nll=1.6)
    d = window_delta(start=a, end=b)
    assert (d.quality_nll, d.quality_tokens, d.probe_nll) == (60.0, 40, 1.6)
    other = PodCounters(at=5, requests=5, quality_nll=30.0, quality_tokens=10, probe_nll=1.4)
    g = aggregate(deltas=[d, other], seconds=5)
    assert (g.quality_nll, g.quality_tokens, g.live_mean_nll) == (90.0, 50, 90.0 / 50)
    assert g.probe_nll == pytest.approx(1.5)
    assert aggregate(deltas=[PodCounters(at=1)], seconds=1).probe_nll is None


def test_parse_pod_counters_reads_a_model_servers_quality_series() -> None:
    from sparsegate_workload.quality import QualityMetrics, Score

    q = QualityMetrics(CollectorRegistry())
    q.observe("g-old", Score(nll=30.0, tokens=20))
    q.observe("g-new", Score(nll=12.0, tokens=10))
    q.set_probe("g-old", Score(nll=100.0, tokens=50))
    q.set_probe("g-new", Score(nll=160.0, tokens=100))  # replaces the old version's gauge
    counters = parse_pod_counters(_exposition(q), at=1.0)
    assert (counters.quality_nll, counters.quality_tokens) == (42.0, 30.0)
    assert counters.probe_nll == pytest.approx(1.6)
    assert parse_pod_counters("", at=1.0).probe_nll is None


def _exposition(q) -> str:
    registry = CollectorRegistry()
    for metric in (q.nll, q.tokens, q.probe_nll, q.probe_ppl, q.probe_tokens):
        registry.register(metric)
    return generate_latest(registry).decode()


def test_prometheus_queries_cover_quality() -> None:
    q = PrometheusAPI("http://127.0.0.1:9090").queries(namespace="ns", pods=["p"], window_s=10)
    assert q["quality_nll"] == 'sum(increase(sparsegate_quality_nll_total{namespace="ns",pod=~"p"}[10s]))'
    assert q["quality_tokens"] == 'sum(increase(sparsegate_quality_tokens_total{namespace="ns",pod=~"p"}[10s]))'
    assert q["probe_nll"] == 'avg(sparsegate_probe_nll_per_token{namespace="ns",pod=~"p"})'


def test_spec_field_and_default() -> None:
    assert parse_spec({"params": PARAMS}).max_quality_drop == DEFAULT_MAX_QUALITY_DROP == 0.02
    assert parse_spec({"params": PARAMS, "rollout": {"maxQualityDrop": 0.1}}).max_quality_drop == 0.1
