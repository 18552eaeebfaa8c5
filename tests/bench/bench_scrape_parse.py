"""The direct scrape's cost per pod: reading a model server's /metrics (a benchmark, not a test).

    python tests/bench/bench_scrape_parse.py [--pods 1000]

One tick of a step under analysis scrapes every pod and reads each exposition into counters,
on the operator's event loop. Side by side on the same exposition (a model server's registry
after traffic of two gate versions, 8 experts × 2 layers), ``--pods`` times each:
- prometheus_client's parser (what the operator used), then the counters;
- ``metrics_source.parse_samples`` on the whole exposition (skips unwanted lines unparsed);
- ``parse_samples`` on what the operator now asks for (``?name[]=…``, the restricted registry);
with the bytes of both expositions. Results also go to tests/bench/results/bench_scrape_parse.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sparsegate.clients.metrics_source import PARSED_SAMPLES, SCRAPED_SAMPLES, parse_samples, pod_counters
from sparsegate_workload.metrics import ServerMetrics

REPO = Path(__file__).resolve().parents[2]


def exposition_registry(experts: int, layers: int) -> ServerMetrics:
    m = ServerMetrics(n_layers=layers, num_experts=experts, model_name="m")
    for i in range(200):
        version = "g-aaaaaaaaaaaa" if i % 3 else "g-bbbbbbbbbbbb"
        m.observe_request(code=200 if i % 17 else 503, gate_version=version, seconds=0.002 * i)
        m.observe_routing(num_tokens=8, expert_counts=[[(i + e) % 3 for e in range(experts)]] * layers,
                          active=1.5, dropped=0, entropy=0.3, gate_version=version)
    return m


def library(text: str) -> list:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in PARSED_SAMPLES]


def timed(fn, texts: list[str]) -> float:
    t0 = time.perf_counter()
    for text in texts:
        samples = fn(text)
        for version in (None, "g-aaaaaaaaaaaa", "g-bbbbbbbbbbbb"):  # all, canary, stable: as DirectScrape reads
            pod_counters(samples, at=0.0, gate_version=version)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pods", type=int, default=1000)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    m = exposition_registry(args.experts, args.layers)
    full = generate_latest(m.registry).decode()
    narrow = generate_latest(m.registry.restricted_registry(SCRAPED_SAMPLES)).decode()
    # Same samples as the library, and the same counters from what the operator asks for.
    assert library(full) == parse_samples(full)
    for version in (None, "g-aaaaaaaaaaaa"):
        assert pod_counters(parse_samples(full), at=0, gate_version=version) == pod_counters(
            parse_samples(narrow), at=0, gate_version=version)
    old = timed(library, [full] * args.pods)
    new_full = timed(parse_samples, [full] * args.pods)
    new_narrow = timed(parse_samples, [narrow] * args.pods)
    result = {
        "pods": args.pods, "experts": args.experts, "layers": args.layers,
        "exposition_bytes": len(full), "restricted_bytes": len(narrow),
        "library_parse_s": round(old, 4), "parse_samples_full_s": round(new_full, 4),
        "parse_samples_restricted_s": round(new_narrow, 4),
        "speedup_full": round(old / new_full, 1), "speedup_restricted": round(old / new_narrow, 1),
    }
    print(json.dumps(result, indent=2))
    out = REPO / "tests" / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_scrape_parse.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
