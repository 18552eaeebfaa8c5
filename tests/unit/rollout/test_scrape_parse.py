"""The direct scrape's exposition parser (clients.metrics_source.parse_samples) reads the samples
the analysis needs exactly as prometheus_client's parser does, and skips the rest."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sparsegate.clients.metrics_source import PARSED_SAMPLES, SCRAPED_SAMPLES, parse_pod_counters, parse_samples
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
