"""What one model's Service costs the API server as Services accumulate (a benchmark, not a test).

    python tests/bench/bench_service_create.py [--levels 0,2500,5000,7500,10000] [--sample 300]

Starts its own local control plane (the one bench_scale.py and the e2e tests run), and at each
level of existing ClusterIP Services (filled up with more ClusterIP Services: the API server keeps
one IPAddress object per allocated virtual IP) times, side by side and interleaved, ``--sample``
server-side applies each of: a ClusterIP Service as the operator renders it for a model, the same
Service headless (``spec.service.headless``: clusterIP None), and a ConfigMap of the size of the
model's gate ConfigMap, ``--workers`` at a time (the operator's apply pool sends a model's objects
at once). Prints p50/p99 per kind and the ClusterIP ÷ headless ratio at each level. Every object
is applied through the operator's own client (``clients.kube.Kube.apply``) from the operator's
own renderer (``domain.render.render_service``). Results also go to
tests/bench/results/bench_service_create.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev"))
sys.path.insert(0, str(REPO / "operator"))

from benchstats import nearest_rank  # noqa: E402
from localcluster import LocalCluster, nodes  # noqa: E402
from sparsegate.clients.kube import Kube  # noqa: E402
from sparsegate.domain import render  # noqa: E402

NS = "default"


def model(name: str, *, headless: bool) -> dict[str, Any]:
    return {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel",
            "metadata": {"name": name, "namespace": NS, "uid": "00000000-0000-0000-0000-000000000000"},
            "spec": {"model": {"dModel": 128, "experts": 4}, "service": {"headless": headless}}}


def configmap(name: str) -> dict[str, Any]:
    # About the size of a model's gate ConfigMap (gate.json).
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": NS},
            "data": {"gate.json": "x" * 600}}


def timed_applies(kube: Kube, objects: list[dict[str, Any]], workers: int) -> list[float]:
    def one(obj: dict[str, Any]) -> float:
        start = time.perf_counter()
        kube.apply(obj)
        return time.perf_counter() - start
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, objects))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="0,2500,5000,7500,10000",
                   help="existing ClusterIP Services at which to measure")
    p.add_argument("--sample", type=int, default=300, help="applies of each kind per level")
    p.add_argument("--workers", type=int, default=8)
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]

    state = Path(tempfile.mkdtemp(prefix="bench-svc-"))
    cluster = LocalCluster(state_dir=state, node_shape=nodes.NodeShape(count=1, gpu_count=0))
    cluster.start()
    kube = Kube.from_kubeconfig(str(cluster.kubeconfig))
    made = 0  # ClusterIP Services existing
    serial = iter(range(10**9))
    rows = []
    try:
        for level in levels:
            fill = [render.render_service(model(f"fill-{next(serial)}", headless=False))
                    for _ in range(max(0, level - made))]
            timed_applies(kube, fill, args.workers)
            made += len(fill)
            kinds: dict[str, Callable[[int], dict[str, Any]]] = {
                "clusterip": lambda i: render.render_service(model(f"c-{i}", headless=False)),
                "headless": lambda i: render.render_service(model(f"h-{i}", headless=True)),
                "configmap": lambda i: configmap(f"cm-{i}"),
            }
            times: dict[str, list[float]] = {k: [] for k in kinds}
            # Interleaved in rounds, so load drifting during the level hits every kind alike.
            for _ in range(0, args.sample, 50):
                for kind, make in kinds.items():
                    objs = [make(next(serial)) for _ in range(50)]
                    times[kind] += timed_applies(kube, objs, args.workers)
            made += len(times["clusterip"])
            row = {"existingClusterIPServices": level}
            for kind, ts in times.items():
                row[kind] = {"p50_ms": round(nearest_rank(ts, 0.5) * 1000, 1),
                             "p99_ms": round(nearest_rank(ts, 0.99) * 1000, 1)}
            row["clusteripOverHeadlessP50"] = round(row["clusterip"]["p50_ms"] / row["headless"]["p50_ms"], 2)
            rows.append(row)
            print(f"{level:>6} existing: ClusterIP p50 {row['clusterip']['p50_ms']:7.1f} ms p99 "
                  f"{row['clusterip']['p99_ms']:7.1f} | headless p50 {row['headless']['p50_ms']:6.1f} p99 "
                  f"{row['headless']['p99_ms']:6.1f} | ConfigMap p50 {row['configmap']['p50_ms']:6.1f} p99 "
                  f"{row['configmap']['p99_ms']:6.1f} | ClusterIP/headless {row['clusteripOverHeadlessP50']:.2f}",
                  flush=True)
    finally:
        cluster.stop()
    out_dir = REPO / "tests" / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_service_create.json").write_text(
        json.dumps({"workers": args.workers, "sample": args.sample, "levels": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
