"""The direct scrape's exposition parser (clients.metrics_source.parse_samples) reads the samples
the analysis needs exactly as prometheus_client's parser does, and skips the rest."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sparsegate.clients.analysis_providers import DirectScrape, MeasureRequest
from sparsegate.clients.metrics_source import (PARSED_SAMPLES, SCRAPED_SAMPLES, group_from_snapshots,
                                               parse_pod_counters, parse_samples)
from sparsegate.clients.podadmin import PodAdmin, PodTarget
from sparsegate.domain.analysis import PodCounters, window_delta
from sparsegate.domain.analysis_run import BUILTIN_CHECK
from sparsegate_workload.metrics import ServerMetrics


def reference(text: str, names=PARSED_SAMPLES) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in names]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2])))
        for x, y in zip(a, b))


@pytest.fixture
def exposition() -> str:
    """A model server's registry after requests of two gate versions (every series it exports)."""
    m = ServerMetrics(n_layers=2, num_experts=8, model_name="m")
    for i in range(30):
        version = "g-aaaaaaaaaaaa" if i % 3 else "g-bbbbbbbbbbbb"
        m.observe_request(code=200 if i % 7 else 503, gate_version=version, seconds=0.01 * i)
        m.observe_routing(num_tokens=4 + i % 5, expert_counts=[[i % 3, 1, 0, 2, 0, 0, 1, 1], [1] * 8],
                          active=1.5, dropped=0, entropy=0.3, gate_version=version)
    return generate_latest(m.registry).decode()


def test_reads_a_model_servers_exposition_as_the_library_does(exposition: str) -> None:
    got = parse_samples(exposition)
    assert same(got, reference(exposition))
    assert {name for name, _, _ in got} >= {"sparsegate_requests_total", "sparsegate_request_duration_seconds_bucket",
                                            "sparsegate_request_experts_per_token_squares_total"}
    # Only the analysis's samples: most of the exposition (per-expert series, vLLM names) is skipped.
    assert len(got) < len(reference(exposition, frozenset(s.name for f in text_string_to_metric_families(exposition)
                                                           for s in f.samples)))


def test_the_text_formats_corners() -> None:
    text = "\n".join([
        '# HELP sparsegate_requests_total Requests {not a sample}',
        '# TYPE sparsegate_requests_total counter',
        'sparsegate_requests_total{code="200",gate_version="g-\\"quoted\\"\\\\ \\n}, x"} 5.0',
        'sparsegate_requests_total{code="503", gate_version="g-1"} 2 1700000000000',
        'sparsegate_requests_total{gate_version="g-2",} +Inf',
        '# TYPE sparsegate_active_experts_per_token gauge',
        'sparsegate_active_experts_per_token NaN',
        '# TYPE sparsegate_tokens_total counter',
        'sparsegate_tokens_total 1.5e+06',
        'other_metric{gate_version="g-1"} 9',
        '',
    ])
    got = parse_samples(text)
    assert same(got, reference(text))
    assert got[0][1]["gate_version"] == 'g-"quoted"\\ \n}, x' and got[1][2] == 2.0 and got[2][2] == math.inf


def test_a_malformed_wanted_line_is_skipped_not_raised() -> None:
    text = 'sparsegate_tokens_total{gate_version="g-1"} not-a-number\nsparsegate_tokens_total{gate_version="g-1"}\n' \
           'sparsegate_tokens_total{gate_version="g-1"} 3\nsparsegate_request_duration_seconds_bucket{x="1"} 4\n' \
           'sparsegate_request_duration_seconds_bucket{le="soon"} 5\n'
    got = parse_samples(text)
    assert [v for _, _, v in got] == [3.0, 4.0, 5.0]
    counters = parse_pod_counters(text, at=0.0)  # a bucket without a readable `le` is left out
    assert counters.duration_buckets == {}


def test_counters_by_version_from_the_exposition(exposition: str) -> None:
    a = parse_pod_counters(exposition, at=1.0, gate_version="g-aaaaaaaaaaaa")
    b = parse_pod_counters(exposition, at=1.0, gate_version="g-bbbbbbbbbbbb")
    both = parse_pod_counters(exposition, at=1.0)
    assert (a.requests, b.requests, both.requests) == (20, 10, 30)
    assert a.request_experts_count == 20 and b.request_experts_count == 10
    assert a.experts_count + b.experts_count == both.experts_count


def test_layers_from_the_gauge_or_counted_from_per_expert_series(exposition: str) -> None:
    """What the operator asks for leaves the per-expert series out: the layer count comes from
    sparsegate_moe_layers; a server without that gauge (older) is read as before."""
    assert "sparsegate_expert_tokens_total" not in SCRAPED_SAMPLES and "sparsegate_moe_layers" in SCRAPED_SAMPLES
    with_gauge = parse_pod_counters(exposition, at=1.0, gate_version="g-aaaaaaaaaaaa")
    older = "\n".join(line for line in exposition.splitlines() if "sparsegate_moe_layers" not in line)
    assert parse_pod_counters(older, at=1.0, gate_version="g-aaaaaaaaaaaa") == with_gauge
    tokens = sum(v for n, labels, v in parse_samples(exposition)
                 if n == "sparsegate_tokens_total" and labels["gate_version"] == "g-aaaaaaaaaaaa")
    assert with_gauge.experts_count == tokens * 2  # 2 MoE layers


def _versions(at: float, counts: dict[str, float], *, version: str | None = None) -> PodCounters:
    """A pod's counters from an exposition with ``counts`` requests per gate_version (each
    request 3 tokens, 1.5 experts per token over 2 layers, 2 scored tokens, under 0.1 s)."""
    lines = ["sparsegate_moe_layers 2"]
    for v, n in counts.items():
        g = f'gate_version="{v}"'
        lines += [f'sparsegate_requests_total{{code="200",{g}}} {n}',
                  f'sparsegate_request_duration_seconds_bucket{{{g},le="0.1"}} {n}',
                  f'sparsegate_request_duration_seconds_bucket{{{g},le="+Inf"}} {n}',
                  f'sparsegate_tokens_total{{{g}}} {3 * n}',
                  f'sparsegate_expert_assignments_total{{{g}}} {9 * n}',
                  f'sparsegate_quality_nll_total{{{g}}} {4 * n}',
                  f'sparsegate_quality_tokens_total{{{g}}} {2 * n}',
                  f'sparsegate_request_experts_per_token_count{{{g}}} {n}',
                  f'sparsegate_request_experts_per_token_sum{{{g}}} {1.5 * n}',
                  f'sparsegate_request_experts_per_token_squares_total{{{g}}} {2.25 * n}']
    return parse_pod_counters("\n".join(lines) + "\n", at=at, gate_version=version)


def _requests_only(d: PodCounters) -> bool:
    """Every counter of a window delta is what its requests make (see :func:`_versions`)."""
    n = d.requests
    return (dict(d.duration_buckets) == {0.1: n, math.inf: n} and d.experts_count == 6 * n
            and d.experts_sum == 9 * n and d.quality_nll == 4 * n and d.quality_tokens == 2 * n
            and (d.request_experts_count, d.request_experts_sum, d.request_experts_squares) == (n, 1.5 * n, 2.25 * n))


def test_a_removed_versions_series_is_not_read_as_a_restart() -> None:
    """A model server drops the series of a long-retired version: the pod's sum over versions goes
    down although no counter was reset. The window counts each version's own delta (it read the
    drop as a restart and counted the pod's whole total, 60 requests, as new)."""
    d = window_delta(start=_versions(0, {"g-old": 1000, "g-new": 50}), end=_versions(10, {"g-new": 60}))
    assert d.requests == 10 and _requests_only(d), d
    # Into the groups of the instances strategy and the fleet qps the same way.
    g = group_from_snapshots(start={"p": _versions(0, {"g-old": 1000, "g-new": 50})},
                             end={"p": _versions(10, {"g-new": 60})}, pods=["p"])
    assert g is not None and g.requests == 10 and g.qps == 1.0


def test_each_versions_delta_new_versions_from_zero_and_its_own_restart() -> None:
    start = _versions(0, {"": 5, "g-a": 100, "g-b": 40})
    # A version first seen in the window counts from 0; one removed adds nothing.
    d = window_delta(start=start, end=_versions(10, {"": 5, "g-b": 45, "g-c": 7}))
    assert d.requests == 12 and _requests_only(d), d
    # A version whose own counter went down restarted it: counted from 0 (the others by delta).
    d = window_delta(start=start, end=_versions(10, {"": 6, "g-a": 3, "g-b": 41}))
    assert d.requests == 1 + 3 + 1 and _requests_only(d), d
    # A restarted pod: every version from 0, as before.
    d = window_delta(start=start, end=_versions(10, {"g-a": 2}))
    assert d.requests == 2 and _requests_only(d), d


def test_the_filtered_path_is_the_versions_own_delta_as_before() -> None:
    start = _versions(0, {"g-old": 1000, "g-new": 50}, version="g-new")
    end = _versions(10, {"g-new": 60}, version="g-new")
    assert not start.by_version and not end.by_version
    d = window_delta(start=start, end=end)
    assert d.requests == 10 and _requests_only(d)
    assert window_delta(start=end, end=_versions(20, {"g-new": 4}, version="g-new")).requests == 4  # its reset
    assert window_delta(start=None, end=end) == end


async def test_direct_scrape_fleet_qps_and_groups_survive_a_removed_version() -> None:
    """DirectScrape (instances strategy, no version split): the fleet qps of a tick and the
    window's groups, across a scrape where a retired version's series were removed."""
    pages = iter(["\n".join(f'sparsegate_requests_total{{code="200",gate_version="{v}"}} {n}'
                            for v, n in counts.items()) + "\n"
                  for counts in ({"g-old": 1000, "g-new": 50}, {"g-new": 60}, {"g-new": 80})])

    class Pods(PodAdmin):
        async def scrape(self, targets: Any, *, names: Any = ()) -> dict[str, str]:
            return {"pod-a": next(pages)}

    scrape = DirectScrape(Pods())
    target = PodTarget(name="pod-a", ip="10.0.0.1", port=8080)

    def at(now: float) -> MeasureRequest:
        return MeasureRequest(namespace="ns", now=now, targets={"pod-a": target}, canary=["pod-a"],
                              stable=[], analysing=True, window_key=("g-new", 1, 0.0))

    await scrape.measure(BUILTIN_CHECK, at(0.0))
    tick = await scrape.measure(BUILTIN_CHECK, at(10.0))
    assert tick.fleet_qps == 1.0 and tick.canary_metrics is not None and tick.canary_metrics.requests == 10
    tick = await scrape.measure(BUILTIN_CHECK, at(20.0))
    assert tick.fleet_qps == 2.0 and tick.canary_metrics is not None and tick.canary_metrics.requests == 30


@pytest.mark.parametrize(("latencies", "within_sla"), [
    ([0.6] * 100, True),                 # every request 600 ms: p99 600 ms, within 800 ms
    ([0.1] * 98 + [0.9] * 2, False),     # 2 % of requests at 900 ms: p99 900 ms, over 800 ms
    ([0.79] * 99 + [5.0], True),         # 99 % at 790 ms
    ([0.1] * 98 + [0.81] * 2, False),    # 2 % just over the SLA
])
def test_the_default_p99_sla_is_judged_exactly_from_the_servers_buckets(latencies, within_sla) -> None:
    """The design article's SLA (p99 <= 800 ms, DEFAULT_SLA_P99_MS) is a bound of the model
    server's latency histogram, so the p99 check decides it from the buckets exactly. Before,
    the buckets jumped from 0.5 s to 1 s and linear interpolation inside that bucket put a
    canary whose every request took 600 ms at p99 995 ms (rolled back), and one with 2 % of its
    requests at 900 ms at p99 750 ms (promoted)."""
    from sparsegate.domain.analysis import histogram_quantile
    from sparsegate.domain.rollout_codec import DEFAULT_SLA_P99_MS

    m = ServerMetrics(n_layers=2, num_experts=8, model_name="m")
    for seconds in latencies:
        m.observe_request(code=200, gate_version="g-aaaaaaaaaaaa", seconds=seconds)
    counters = parse_pod_counters(generate_latest(m.registry).decode(), at=0.0,
                                  gate_version="g-aaaaaaaaaaaa")
    p99_ms = 1000.0 * histogram_quantile(q=0.99, buckets=counters.duration_buckets)
    assert (p99_ms <= DEFAULT_SLA_P99_MS) is within_sla, p99_ms
