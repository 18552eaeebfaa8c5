"""Flow allow-list size: IP-level entries (before identities) vs identity rules, side by side.

    python tests/bench/bench_flow_policy_size.py [--pods 1000 10000] [--identity-only-pods 50000 100000]

For each pod count N, a synthetic cluster: 10% model pods (10 SparseModels, N/100 pods each) and
90% callers in identity classes of 50 pods (same namespace, service account, labels), each class
allowed one model on 8080 (OPA's answers stand in as decisions: this measures the document, not
OPA). Both forms come from the same decisions: the operator's `flow_document` (identity form) and
its expansion to IP-level entries (`flowpolicy.ip_entries`, what the operator published before).
Per form: rows (entries or rules), agent map records (identity form: `flowpolicy.map_records`;
entries form: what the agent wrote before identities, one per entry), `policy.json`
bytes (one ConfigMap's worth), how it is published (`flowpolicy_shards.split` at the real 1 MiB less
headroom per ConfigMap: shard ConfigMaps, 0 = one ConfigMap; bytes written, head + shards), whether it
fits the map (65,536 less the agent's reserve) and the shard limit, the operator's build time (entries
form: the identity build plus its expansion, which stands in for the old operator's build), the
split time (operator) and rebuild time (`flowpolicy_shards.join`, agent) when sharded, and the agent's
parse + compile time where it fits. The entries form (never published now) is sized only: rows,
records and bytes, not sharded, judged for fit or parsed (its "fits" column reads "-").
`--identity-only-pods`: sizes measured in the identity form only (the entries form there has tens of
millions of entries). `--map-records N`: the agents' policy map size (chart `agent.policyMapRecords`;
default 65,536): what fits, and what the agent parses and compiles against. `--load` (root, BCC):
also load the XDP program with maps of that size and swap each fitting identity document in, as the
agent does (`PolicySwapper.apply`: fill the inactive map, flip the outer slot), reporting fill and
swap times and the map's kernel memory (`memlock` in its fdinfo; the maps are not preallocated).
`--publish`: also start a local control plane (dev/localcluster, cached binaries) and publish each
identity document as the operator does (`FlowPolicyConfigMap.publish`: shards first, head last),
timing it and reading it back (it must come back equal).
Writes tests/bench/results/bench_flow_policy_size.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sparsegate.domain.policy import Port
from sparsegate.domain.policy_capacity import DEFAULT_MAX_BYTES, MAP_RECORDS_ENV, Capacity, Footprint
from sparsegate.domain.policy_compile import PodInfo, QueryKey, flow_document
from sparsegate_contracts import flowpolicy, flowpolicy_shards
from sparsegate_ebpf.policy import compile_policy, parse_policy

RESULTS = Path(__file__).resolve().parent / "results" / "bench_flow_policy_size.json"
MODELS = 10
CLASS_SIZE = 50


def ip(i: int) -> str:
    return f"10.{100 + i // 65536}.{i // 256 % 256}.{i % 256}"


def cluster(n: int) -> tuple[list[PodInfo], dict[QueryKey, dict[str, Any]]]:
    per_model = max(1, n // 100)
    pods = [PodInfo(namespace="models", name=f"m{m}-{i}", ip=ip(m * per_model + i), service_account="default",
                    labels=(("sparsegate.dev/model", f"model-{m}"),), ports=(Port(8080),))
            for m in range(MODELS) for i in range(per_model)]
    callers = n - len(pods)
    decisions = {}
    for c in range(callers):
        cls = c // CLASS_SIZE
        labels = (("app", f"caller-{cls}"),)
        pods.append(PodInfo(namespace="web", name=f"c-{c}", ip=ip(MODELS * per_model + c), service_account="client",
                            labels=labels))
        key = QueryKey(namespace="web", service_account="client", labels=labels, target_namespace="models",
                       model=f"model-{cls % MODELS}", port=8080, protocol="tcp")
        decisions[key] = {"allow": True, "rule": f"models/allow-{cls % MODELS}#s0t0"}
    return pods, decisions


class Publish:
    """A local control plane and the operator's ConfigMap writer (`--publish`)."""

    def __init__(self) -> None:
        import kubernetes

        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dev"))
        from localcluster import LocalCluster, nodes

        from sparsegate.clients.flow_policy import FlowPolicyConfigMap

        self.state = Path(tempfile.mkdtemp(prefix="bench-policy-publish-"))
        self.cluster = LocalCluster(state_dir=self.state, pod_cidr="127.43.0.0/16",
                                    node_shape=nodes.NodeShape(count=1, gpu_count=0))
        self.cluster.start()
        self.cluster.kubectl("create", "namespace", "sparsegate-system")
        client = kubernetes.config.new_client_from_config(config_file=str(self.cluster.kubeconfig))
        self.store = FlowPolicyConfigMap(namespace="sparsegate-system", api_client=client)

    def publish(self, document: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        asyncio.run(self.store.publish(document))
        elapsed = time.perf_counter() - t0
        assert asyncio.run(self.store.read()) == document, "published document does not read back equal"
        return {"publish_s": elapsed}

    def close(self) -> None:
        self.cluster.stop()
        shutil.rmtree(self.state, ignore_errors=True)


class Swap:
    """The agent's maps, loaded once (`--load`): each fitting document swapped in as the agent does."""

    def __init__(self, map_records: int) -> None:
        from sparsegate_ebpf.policyswap import PolicySwapper
        from sparsegate_ebpf.testing import require_program

        self.prog = require_program(enforce=True, policy_records=map_records)
        self.swapper = PolicySwapper(bpf=self.prog.bpf)
        self.empty = _memlock(self.prog, "policy_a")
        self.map_records = map_records

    def swap(self, document: dict[str, Any]) -> dict[str, Any]:
        if flowpolicy.map_records(document) + 1 > self.map_records:
            return {}
        result = self.swapper.apply(parse_policy(document, max_records=self.map_records))
        return {"fill_s": result.fill_seconds, "swap_s": result.swap_seconds,
                "map_bytes": _memlock(self.prog, result.slot), "empty_map_bytes": self.empty}

    def close(self) -> None:
        self.prog.close()


def _memlock(prog: Any, table: str) -> int:
    """Kernel memory of one map (its fdinfo `memlock`: what is charged for it)."""
    with open(f"/proc/self/fdinfo/{prog.table(table).get_fd()}") as f:
        return int(dict(line.split(":\t", 1) for line in f.read().splitlines())["memlock"])


def old_agent_records(document: dict[str, Any]) -> int:
    """Records the agent wrote for an entries-form document before identities: one per entry tuple,
    policed destination and allowed source (no per-source identity records)."""
    tuples = {(e["srcIP"], e["dstIP"], e["dstPort"], e["protocol"]) for e in document["entries"]}
    return len(tuples) + len(flowpolicy.policed_of(document)) + len(document.get(flowpolicy.ALLOWED_SOURCES) or ())


def measure(document: dict[str, Any], build_s: float, *, capacity: Capacity, map_records: int,
            shard: bool = True) -> dict[str, Any]:
    records = old_agent_records(document) if "entries" in document else flowpolicy.map_records(document)
    size = flowpolicy.document_bytes(document)
    out: dict[str, Any] = {
        "rows": len(flowpolicy.rows_of(document)), "identities": len(document.get(flowpolicy.IDENTITIES) or ()),
        "map_records": records, "bytes": size, "fits_map": records <= capacity.max_records,
        "operator_build_s": build_s,
    }
    if shard:
        t0 = time.perf_counter()
        layout = flowpolicy_shards.split(document, max_bytes=DEFAULT_MAX_BYTES, max_shards=1 << 30)
        out["split_s"] = time.perf_counter() - t0
        out["shards"] = len(layout.shards)
        out["published_bytes"] = len(layout.head) + sum(len(t) for _, t in layout.shards)
        out["largest_configmap_bytes"] = max([len(layout.head), *(len(t) for _, t in layout.shards)])
        out["fits_shards"] = out["shards"] <= Capacity().max_shards
        assert Footprint.of(document).shards == out["shards"]
        if layout.shards:
            t0 = time.perf_counter()
            rebuilt = flowpolicy_shards.join(json.loads(layout.head), dict(layout.shards))
            out["agent_join_s"] = time.perf_counter() - t0
            assert rebuilt == document
    if out["fits_map"] and out.get("fits_shards", False):
        text = flowpolicy.document_text(document)  # what the agent reads (written by the operator)
        t0 = time.perf_counter()
        compile_policy(parse_policy(text, max_records=map_records), generation=1, max_records=map_records)
        out["agent_parse_compile_s"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--identity-only-pods", type=int, nargs="*", default=[50000, 100000])
    ap.add_argument("--map-records", type=int, default=flowpolicy.MAP_MAX_ENTRIES)
    ap.add_argument("--load", action="store_true", help="swap each fitting document into real BPF maps (root)")
    ap.add_argument("--publish", action="store_true", help="publish each document to a local control plane")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    capacity = Capacity.from_env({MAP_RECORDS_ENV: str(args.map_records)})
    size = dict(capacity=capacity, map_records=args.map_records)
    swapper = Swap(args.map_records) if args.load else None
    publisher = Publish() if args.publish else None
    try:
        results = run(args, size, swapper, publisher)
    finally:
        if swapper is not None:
            swapper.close()
        if publisher is not None:
            publisher.close()
    report(args, capacity, results)
    return 0


def run(args: argparse.Namespace, size: dict[str, Any], swapper: Swap | None, publisher: Publish | None
        ) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for n in [*args.pods, *args.identity_only_pods]:
        pods, decisions = cluster(n)
        models = [("models", f"model-{m}") for m in range(MODELS)]
        t0 = time.perf_counter()
        identity = flow_document(decisions=decisions, pods=pods, policed_models=models, allowed_sources=[])
        t1 = time.perf_counter()
        if n in args.identity_only_pods:
            results[str(n)] = {"identity form (now)": measure(identity, t1 - t0, **size)}
            extras(results[str(n)]["identity form (now)"], identity, swapper, publisher)
            continue
        entries = flowpolicy.build_document(entries=flowpolicy.ip_entries(identity),
                                            policed_destinations=identity[flowpolicy.POLICED_DESTINATIONS],
                                            allowed_sources=[])
        t2 = time.perf_counter()
        # The entries form is what was published before identities: sized, not sharded (never sent now).
        results[str(n)] = {"entries form (before)": measure(entries, t2 - t1 + t1 - t0, shard=False, **size),
                           "identity form (now)": measure(identity, t1 - t0, **size)}
        extras(results[str(n)]["identity form (now)"], identity, swapper, publisher)
    return results


def extras(row: dict[str, Any], identity: dict[str, Any], swapper: Swap | None, publisher: Publish | None) -> None:
    if publisher is not None and row.get("fits_shards"):
        row.update(publisher.publish(identity))
    if swapper is not None:
        row.update(swapper.swap(identity))


def report(args: argparse.Namespace, capacity: Capacity, results: dict[str, Any]) -> None:
    print(f"limits: {capacity.max_records} map records (maps of {args.map_records}); {DEFAULT_MAX_BYTES} bytes per "
          f"ConfigMap, {capacity.max_shards} shards")
    print(f"{'pods':>6} {'form':<22} {'rows':>7} {'records':>8} {'bytes':>10} {'shards':>6} {'written':>10} "
          f"{'largest':>8} {'fits':>8} {'build s':>8} {'split s':>8} {'join s':>7} {'agent s':>8}")
    for n, forms in results.items():
        for form, r in forms.items():
            sharded = "shards" in r
            fits = ("-" if not sharded else "yes" if r["fits_map"] and r["fits_shards"]
                    else "no:map" if not r["fits_map"] else "no:cms")
            agent = f"{r['agent_parse_compile_s']:.3f}" if "agent_parse_compile_s" in r else "-"
            join = f"{r['agent_join_s']:.3f}" if "agent_join_s" in r else "-"
            print(f"{n:>6} {form:<22} {r['rows']:>7} {r['map_records']:>8} {r['bytes']:>10} "
                  f"{r.get('shards', '-'):>6} {r.get('published_bytes', '-'):>10} "
                  f"{r.get('largest_configmap_bytes', '-'):>8} "
                  f"{fits:>8} {r['operator_build_s']:>8.3f} {r.get('split_s', 0):>8.3f} {join:>7} {agent:>8}")
        if "entries form (before)" not in forms:
            continue
        old, new = forms["entries form (before)"], forms["identity form (now)"]
        print(f"{'':>6} ratio before/now: records {old['map_records'] / new['map_records']:.1f}x, "
              f"bytes {old['bytes'] / new['bytes']:.1f}x")
    if args.publish:
        print("\nPublished to a local control plane (FlowPolicyConfigMap.publish; shards, then the head):")
        print(f"{'pods':>6} {'shards':>6} {'publish s':>9}")
        for n, forms in results.items():
            r = forms["identity form (now)"]
            if "publish_s" in r:
                print(f"{n:>6} {r['shards']:>6} {r['publish_s']:>9.3f}")
    if args.load:
        print(f"\nSwapped into real BPF maps of {args.map_records} records (agent: parse, compile, fill, flip):")
        print(f"{'pods':>6} {'records':>8} {'parse+compile s':>15} {'fill s':>7} {'flip ms':>8} {'map MiB':>8} "
              f"{'empty map MiB':>13}")
        for n, forms in results.items():
            r = forms["identity form (now)"]
            if "fill_s" in r:
                print(f"{n:>6} {r['map_records']:>8} {r['agent_parse_compile_s']:>15.3f} {r['fill_s']:>7.3f} "
                      f"{r['swap_s'] * 1e3:>8.2f} {r['map_bytes'] / 2**20:>8.1f} {r['empty_map_bytes'] / 2**20:>13.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"map_records": args.map_records, "pods": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
