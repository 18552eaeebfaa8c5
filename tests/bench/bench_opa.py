"""Routing decision latency at 10 … 10,000 rules: OPA REST API vs the compiled allow-list; and the
allow-list build, per-question batches vs one evaluation.

    python tests/bench/bench_opa.py [--sizes 10,100,1000,10000] [--queries 2000] [--build-repeats 3]

Side by side, per rule count N:
- indexed: our Rego (policies/routing/src.rego) + data indexed by target and identity, queried over
  one keep-alive HTTP connection (client-observed latency, and OPA's own eval time from ?metrics);
- naive: the same rules as a flat array scanned by a Rego rule (what OPA cannot index), the shape
  that makes decision time grow with N;
- compiled: the published flow allow-list (OPA's decisions for the current pods, as identities and
  identity rules) looked up in-process, source and destination IP → identity → rule, as the data
  plane does per flow.
- allow-list build (what the operator's sync does once rules or pods change), old vs new in the same
  run, alternating, median of --build-repeats: old = `candidate_queries` asked through
  `batch_decisions` in batches of 25 (`RoutingOpa.decide_many`); new = one POST of
  `flow_decisions` (`flow_question` → `RoutingOpa.flow_decisions`); both then `flow_document`. The two
  documents must be identical (asserted), so the ratio compares equal work.
Then the log-log slope of p50/p99 against N (0 = flat, 1 = linear). A widely reported figure for a
naive engine is 680 ms at 2,000 rules with O(n²) growth; our target is p99 < 1 ms at 10,000 rules.
Cross-check: `opa bench` on the same policy, data and one input, at the largest N.
OPA runs with the chart's Go collector settings (`opa.gogc`, `opa.goMemLimit` in
charts/sparsegate/values.yaml), as the sidecar does; `--go-defaults` runs it with Go's defaults.
Results also go to tests/bench/results/bench_opa.json.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchstats import nearest_rank
from sparsegate.clients.opa import RoutingOpa
from sparsegate.gc_pause import gc_paused
from sparsegate.domain.policy import PolicySource, Port, build_opa_data
from sparsegate.domain.policy_compile import (
    FlowTable,
    PodInfo,
    candidate_queries,
    decision_counts,
    flow_document,
    flow_question,
)

REPO = Path(__file__).resolve().parents[2]
REGO = (REPO / "policies" / "routing" / "src.rego").read_text()
TD = "cluster.local"

NAIVE_REGO = """package naive

# Every rule in one array, matched field by field: OPA cannot index `rules[_].x == input...`.
spiffe := sprintf("spiffe://%s/ns/%s/sa/%s", ["cluster.local", input.source.namespace, input.source.serviceAccount])

hits contains r if {
	some r in data.naive_rules.rules
	r.target == concat("/", [input.target.namespace, input.target.sparseModel])
	r.identity == spiffe
	some p in r.ports
	p.port == input.target.port
}

allow if {
	some r in hits
	r.action == "allow"
	not deny
}

deny if {
	some r in hits
	r.action == "deny"
}

default decision := {"allow": false}

decision := {"allow": true} if allow
"""


def chart_go_env() -> dict[str, str]:
    """GOGC / GOMEMLIMIT as the chart sets them on the OPA sidecar (empty values: unset)."""
    import yaml

    opa = yaml.safe_load((Path(__file__).resolve().parents[2] / "charts/sparsegate/values.yaml").read_text())["opa"]
    return {k: str(v) for k, v in (("GOGC", opa.get("gogc")), ("GOMEMLIMIT", opa.get("goMemLimit"))) if v}


def opa_binary() -> str:
    path = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache/sparsegate/bin")) / "opa"
    found = str(path) if path.is_file() else shutil.which("opa")
    if not found:
        sys.exit("the real opa binary is required; run dev/setup.sh")
    return found


def scenario(n: int, rng: random.Random) -> tuple[list[PolicySource], list[PodInfo], list[dict]]:
    """N rules, ~10 per model, each for one caller identity (1 in 10 a Deny); one pod per identity
    and per model; probe inputs half hits, half misses."""
    models = max(1, n // 10)
    sources, pods, probes = [], [], []
    for i in range(models):
        pods.append(PodInfo(namespace="models", name=f"m{i}-0", ip=f"127.21.{i // 250}.{i % 250 + 1}",
                            service_account="srv", labels=(("sparsegate.dev/model", f"m{i}"),), ports=(Port(8080),)))
    for i in range(n):
        ns, sa, model = f"ns{i % 20}", f"sa{i}", f"m{i % models}"
        sources.append(PolicySource(namespace="models", name=f"r{i}", generation=1, spec={
            "action": "Deny" if i % 10 == 9 else "Allow", "priority": i % 7,
            "sources": [{"namespace": ns, "serviceAccount": sa}], "targets": [{"sparseModel": model}],
            "ports": [{"port": 8080}]}))
        pods.append(PodInfo(namespace=ns, name=f"c{i}", ip=f"127.20.{i // 250}.{i % 250 + 1}", service_account=sa,
                            labels=()))
    for _ in range(512):
        i = rng.randrange(n)
        model = f"m{i % models}" if rng.random() < 0.5 else f"m{rng.randrange(models)}"
        probes.append({"source": {"namespace": f"ns{i % 20}", "serviceAccount": f"sa{i}", "labels": {}},
                       "target": {"namespace": "models", "sparseModel": model, "port": 8080, "protocol": "tcp"}})
    return sources, pods, probes


def naive_data(sources: list[PolicySource]) -> dict:
    rules = []
    for s in sources:
        src, tgt = s.spec["sources"][0], s.spec["targets"][0]
        rules.append({"id": s.key, "action": s.spec["action"].lower(), "target": f"models/{tgt['sparseModel']}",
                      "identity": f"spiffe://{TD}/ns/{src['namespace']}/sa/{src['serviceAccount']}",
                      "ports": [{"port": 8080}]})
    return {"rules": rules}


class Opa:
    def __init__(self, binary: str, *, go_env: dict[str, str] | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("GOGC", "GOMEMLIMIT")} | (go_env or {})
        self.proc = subprocess.Popen([binary, "run", "--server", "--addr", f"127.0.0.1:{self.port}", "--log-level",
                                      "error", "--disable-telemetry"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True, env=env)
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=0.5)
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("opa did not become healthy")

    def put(self, path: str, body: str | bytes, content_type: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        # http.client sends a str as Latin-1: the Rego's non-ASCII comments would reach OPA as
        # invalid UTF-8 ("illegal utf-8 character").
        data = body.encode("utf-8") if isinstance(body, str) else body
        conn.request("PUT", path, body=data, headers={"Content-Type": content_type})
        r = conn.getresponse()
        payload = r.read()
        assert r.status in (200, 204), payload[:500]
        conn.close()

    def delete(self, path: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("DELETE", path)
        r = conn.getresponse()
        payload = r.read()
        assert r.status in (200, 204), payload[:500]
        conn.close()

    def latencies(self, path: str, probes: list[dict], count: int, *, metrics: bool) -> tuple[list[float], list[bool]]:
        """Per-decision latencies (µs) over one keep-alive connection, and the answers. With
        `metrics`, OPA's own eval time (timer_rego_query_eval_ns); without, what the client sees
        (asking for metrics would add to it)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        bodies = [json.dumps({"input": p}).encode() for p in probes]
        url = f"{path}?metrics=true" if metrics else path
        out, allowed = [], []
        for i in range(count + 50):
            body = bodies[i % len(bodies)]
            t0 = time.perf_counter_ns()
            conn.request("POST", url, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            doc = json.loads(r.read())
            t1 = time.perf_counter_ns()
            if i < 50:
                continue  # warm-up
            out.append(doc["metrics"]["timer_rego_query_eval_ns"] / 1e3 if metrics else (t1 - t0) / 1e3)
            allowed.append(bool(doc["result"]["allow"]))
        conn.close()
        return out, allowed

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=10)


def slope(xs: list[int], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def compiled_latencies(table: FlowTable, flows: list[tuple[str, str, int]], count: int) -> list[float]:
    out = []
    clock = time.perf_counter_ns
    overhead = min(-(clock() - clock()) for _ in range(1000))
    for i in range(count):
        src, dst, port = flows[i % len(flows)]
        t0 = clock()
        table.allows(src_ip=src, dst_ip=dst, port=port)
        out.append(max(0, clock() - t0 - overhead) / 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000,10000")
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--naive-queries", type=int, default=300)
    parser.add_argument("--build-repeats", type=int, default=3)
    parser.add_argument("--go-defaults", action="store_true", help="run OPA without the chart's GOGC/GOMEMLIMIT")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(7)
    binary = opa_binary()
    go_env = {} if args.go_defaults else chart_go_env()
    print(f"OPA with {go_env or 'Go defaults'}")
    opa = Opa(binary, go_env=go_env)
    rows = []
    try:
        for n in sizes:
            sources, pods, probes = scenario(n, rng)
            data, _ = build_opa_data(sources=sources, trust_domain=TD, rego=REGO)
            opa.put("/v1/policies/sparsegate-routing", REGO, "text/plain")
            opa.put("/v1/data/sparsegate/policies", json.dumps(data), "application/json")
            opa.put("/v1/policies/naive", NAIVE_REGO, "text/plain")
            opa.put("/v1/data/naive_rules", json.dumps(naive_data(sources)), "application/json")

            indexed, naive = "/v1/data/sparsegate/routing/decision", "/v1/data/naive/decision"
            client, allowed = opa.latencies(indexed, probes, args.queries, metrics=False)
            server, _ = opa.latencies(indexed, probes, args.queries, metrics=True)
            n_client, n_allowed = opa.latencies(naive, probes, args.naive_queries, metrics=False)
            n_server, _ = opa.latencies(naive, probes, args.naive_queries, metrics=True)
            # Both engines saw the same probe sequence: their answers must agree.
            assert n_allowed == allowed[: len(n_allowed)], "naive and indexed policies disagree"

            ropa = RoutingOpa(url=f"http://127.0.0.1:{opa.port}", timeout=60)
            old_s, new_s = [], []
            try:
                for _ in range(args.build_repeats):  # alternate, so load changes hit both paths alike
                    t0 = time.perf_counter()
                    queries = candidate_queries(targets=data["targets"], pods=pods, trust_domain=TD)
                    answers = asyncio.run(ropa.decide_many([q.opa_input(trust_domain=TD) for q in queries]))
                    document = flow_document(decisions=dict(zip(queries, answers)), pods=pods)
                    old_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    with gc_paused():  # as PolicySync.sync runs it
                        question = flow_question(targets=data["targets"], pods=pods, trust_domain=TD)
                    answers = asyncio.run(ropa.flow_decisions(question.input))
                    with gc_paused():
                        one = flow_document(decisions=question.decisions(answers), pods=pods)
                    new_s.append(time.perf_counter() - t0)
                    assert one == document, "one evaluation and the per-question path disagree"
            finally:
                ropa.close()
            compile_s, build_s = nearest_rank(old_s, 0.5), nearest_rank(new_s, 0.5)
            table = FlowTable.from_document(document)
            ip = {(p.namespace, p.service_account): p.ip for p in pods}
            model_ip = {p.model: p.ip for p in pods if p.model}
            flows = [(ip[(p["source"]["namespace"], p["source"]["serviceAccount"])], model_ip[p["target"]["sparseModel"]],
                      8080) for p in probes]
            compiled = compiled_latencies(table, flows, 100_000)
            rows.append({"n": n, "rest": client, "eval": server, "naive": n_client, "naive_eval": n_server,
                         "compiled": compiled, "entries": sum(decision_counts(document).values()), "queries": len(queries),
                         "compile_s": compile_s, "build_s": build_s, "allowed": sum(allowed)})
            print(f"  N={n}: done ({len(queries)} OPA questions → {rows[-1]['entries']} IP-level entries; build "
                  f"{compile_s:.2f}s → {build_s:.2f}s)", file=sys.stderr)
        go_cmp = compare_go_defaults(binary, opa, data, probes, args.queries) if go_env else None
    finally:
        opa.stop()

    print(f"\nMachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end (p99 is sensitive to it)")
    print("Routing decision latency, µs (p50 / p99). indexed = policies/routing/src.rego; naive = array scan;")
    print("REST = client-observed over one keep-alive HTTP connection; eval = OPA's timer_rego_query_eval_ns.\n")
    head = f"{'rules':>6} | {'indexed REST':>16} | {'indexed eval':>14} | {'naive REST':>18} | {'naive eval':>18} | {'compiled lookup':>15} | {'naive/indexed p50':>17}"
    print(head)
    print("-" * len(head))
    for r in rows:
        def pp(v: list[float], w: int) -> str:
            return f"{nearest_rank(v, 0.5):.1f} / {nearest_rank(v, 0.99):.1f}".rjust(w)
        ratio = nearest_rank(r["naive"], 0.5) / nearest_rank(r["rest"], 0.5)
        print(f"{r['n']:>6} | {pp(r['rest'], 16)} | {pp(r['eval'], 14)} | {pp(r['naive'], 18)} | {pp(r['naive_eval'], 18)} | "
              f"{pp(r['compiled'], 15)} | {ratio:>16.1f}x")
    print("\nAllow-list build (questions → identical documents), median seconds; old = batches of 25 through")
    print("batch_decisions, new = one flow_decisions evaluation; both include flow_document.\n")
    bhead = f"{'rules':>6} | {'questions':>9} | {'entries':>7} | {'old (batches)':>13} | {'new (one eval)':>14} | {'old/new':>7}"
    print(bhead)
    print("-" * len(bhead))
    for r in rows:
        print(f"{r['n']:>6} | {r['queries']:>9} | {r['entries']:>7} | {r['compile_s']:>12.3f}s | {r['build_s']:>13.3f}s | "
              f"{r['compile_s'] / r['build_s']:>6.1f}x")
    if len(rows) >= 2:
        ns = [r["n"] for r in rows]
        print("\nGrowth exponent (log-log slope of latency vs rules; 0 = flat, 1 = linear, 2 = quadratic):")
        for label, key in [("indexed REST", "rest"), ("indexed eval", "eval"), ("naive REST", "naive"),
                           ("naive eval", "naive_eval"), ("compiled lookup", "compiled")]:
            print(f"  {label:16} p50 {slope(ns, [nearest_rank(r[key], 0.5) for r in rows]):+.2f}   "
                  f"p99 {slope(ns, [nearest_rank(r[key], 0.99) for r in rows]):+.2f}")
        last = rows[-1]
        verdict = "MET" if nearest_rank(last["rest"], 0.99) < 1000 else "NOT MET"
        under = sum(1 for v in last["rest"] if v < 1000) / len(last["rest"])
        print(f"\nTarget p99 < 1 ms at {last['n']} rules through the REST API: {nearest_rank(last['rest'], 0.99):.0f} µs → {verdict} "
              f"({under:.1%} of decisions under 1 ms; p90 {nearest_rank(last['rest'], 0.9):.0f} µs)")
        build_verdict = "MET" if last["build_s"] < 0.5 else "NOT MET"
        print(f"Target allow-list build < 0.5 s at {last['n']} rules: {last['build_s']:.2f} s → {build_verdict} "
              f"(old path {last['compile_s']:.2f} s)")
        if go_cmp is not None:
            ours, plain = go_cmp
            print(f"Same {last['n']} rules, REST p50 / p99 side by side (alternating): chart's {go_env} "
                  f"{nearest_rank(ours, 0.5):.0f} / {nearest_rank(ours, 0.99):.0f} µs vs Go defaults {nearest_rank(plain, 0.5):.0f} / "
                  f"{nearest_rank(plain, 0.99):.0f} µs (p99 ratio {nearest_rank(ours, 0.99) / nearest_rank(plain, 0.99):.2f})")
    cross_check(binary, sizes[-1])
    save(rows)


def compare_go_defaults(binary: str, opa: Opa, data: dict, probes: list[dict], queries: int
                        ) -> tuple[list[float], list[float]]:
    """REST latency of `opa` (the chart's GOGC/GOMEMLIMIT) and of a second OPA with Go's defaults,
    same policy, data and probes, in alternating chunks so machine noise hits both alike. The naive
    scan's policy and rules leave `opa` first: both then hold the same (what the sidecar holds), so
    neither's collector works on a heap the other does not have."""
    opa.delete("/v1/policies/naive")
    opa.delete("/v1/data/naive_rules")
    plain = Opa(binary, go_env={})
    try:
        plain.put("/v1/policies/sparsegate-routing", REGO, "text/plain")
        plain.put("/v1/data/sparsegate/policies", json.dumps(data), "application/json")
        path = "/v1/data/sparsegate/routing/decision"
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(4):
            ours += opa.latencies(path, probes, queries // 4, metrics=False)[0]
            theirs += plain.latencies(path, probes, queries // 4, metrics=False)[0]
        return ours, theirs
    finally:
        plain.stop()


def save(rows: list[dict]) -> None:
    keys = ("rest", "eval", "naive", "naive_eval", "compiled")
    out = {
        "machine": {"cpus": os.cpu_count(), "loadavg_1m_end": round(os.getloadavg()[0], 2)},
        "rows": [{"rules": r["n"], "allowListEntries": r["entries"], "allowListQuestions": r["queries"],
                  "allowListBuildSeconds": {"batches": round(r["compile_s"], 3), "oneEvaluation": round(r["build_s"], 3)},
                  **{f"{k}_us": {"p50": round(nearest_rank(r[k], 0.5), 1), "p99": round(nearest_rank(r[k], 0.99), 1)} for k in keys}}
                 for r in rows],
    }
    if len(rows) >= 2:
        ns = [r["n"] for r in rows]
        out["loglogSlope"] = {k: {"p50": round(slope(ns, [nearest_rank(r[k], 0.5) for r in rows]), 3),
                                  "p99": round(slope(ns, [nearest_rank(r[k], 0.99) for r in rows]), 3)} for k in keys}
    path = REPO / "tests" / "bench" / "results" / "bench_opa.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


def cross_check(binary: str, n: int) -> None:
    """`opa bench` (in-process, no HTTP) on the same policy, data and one probe."""
    sources, _, probes = scenario(n, random.Random(3))
    data, _ = build_opa_data(sources=sources, trust_domain=TD, rego=REGO)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "src.rego").write_text(REGO)
        (root / "data").mkdir()
        (root / "data" / "sparsegate" / "policies").mkdir(parents=True)
        (root / "data" / "sparsegate" / "policies" / "data.json").write_text(json.dumps(data))
        (root / "input.json").write_text(json.dumps(probes[0]))
        run = subprocess.run([binary, "bench", "--format", "json", "--count", "1", "-d", str(root / "src.rego"),
                              "-d", str(root / "data"), "-i", str(root / "input.json"),
                              "data.sparsegate.routing.decision"], capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            print(f"\nopa bench failed: {run.stderr[-500:]}")
            return
        result = json.loads(run.stdout)
        extra = result.get("Extra") or {}
        mean_us = result["T"] / result["N"] / 1e3
        p50 = extra.get("histogram_timer_rego_query_eval_ns_median", 0) / 1e3
        p99 = extra.get("histogram_timer_rego_query_eval_ns_99%", 0) / 1e3
        print(f"\nCross-check `opa bench` at {n} rules (in-process, no HTTP, {result['N']} evaluations): "
              f"{mean_us:.1f} µs/op, eval p50 {p50:.1f} µs, p99 {p99:.1f} µs")


if __name__ == "__main__":
    main()
