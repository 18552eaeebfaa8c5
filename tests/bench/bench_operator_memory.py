"""What the operator keeps in memory per watched object, by kind, measured without a cluster.

Issue 13 asks, where the 10,000-model RSS goal is missed, where the memory goes per object. This
builds the objects of N models as the API server sends them (a SparseModel, its Deployment,
ReplicaSet and R pods, its Service and gate ConfigMap where the operator watches those; a GateConfig
per 5 models; each JSON-decoded on its own, as each watch event is) and runs on each one exactly what the operator's process keeps for it between events:

- Kopf's per-object record (``ResourceMemories.recall`` with the operator's memo, which Kopf
  copies per object), and
- every index handler the operator registers for that resource, through Kopf's own
  ``index_resource`` with the operator's registry and settings (``sparsegate.main.configure``).

It then drops the decoded bodies and reports, with ``tracemalloc``, the bytes still held per
object of each kind and per model. It does not count what handlers keep elsewhere (the status
inputs of each model, rollout caches of GateConfigs in a rollout), in-flight events, or the
allocator's fragmentation: the RSS measured by ``bench_scale.py`` is the whole.

``--baseline-rev REV`` measures a checkout of REV (a git worktree) the same way in a subprocess
and prints both side by side with the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
NS = "bench"
# What a kubeconfig needs for the operator's client to be built; nothing connects to it.
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:9", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def _uid() -> str:
    return str(uuid.uuid4())


def _ref(obj: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def model_objects(i: int, *, replicas: int, gate: str, ip_base: int) -> dict[str, list[dict[str, Any]]]:
    """One model's objects, shaped as the API server serves them (the pods as kwok reports them)."""
    from sparsegate.domain import render
    from sparsegate_contracts import names
    from sparsegate_contracts import gate as gatedoc

    name = f"m-{i:05d}"
    model = {"apiVersion": f"{names.GROUP}/{names.VERSION}", "kind": "SparseModel",
             "metadata": {"name": name, "namespace": NS, "uid": _uid(), "generation": 1,
                          "resourceVersion": str(1000 + i), "creationTimestamp": "2026-12-05T20:00:00Z"},
             "spec": {"image": "ghcr.io/sparsegate/model-server:0.1.0", "replicas": replicas,
                      "gateConfigRef": {"name": gate},
                      "model": {"dModel": 128, "experts": 4, "maxExpertsPerToken": 2}}}
    document = gatedoc.make_document({**gatedoc.DEFAULT_PARAMS, "toolGateThreshold": 0.85})
    deployment = render.render_deployment(model, document)
    deployment["metadata"].update(namespace=NS, uid=_uid(), generation=1, resourceVersion=str(2000 + i))
    model["status"] = {"observedGeneration": 1, "gateVersion": document.version, "replicas": replicas,
                       "readyReplicas": replicas, "phase": "Ready",
                       "conditions": [{"type": t, "status": s, "reason": r, "message": r,
                                       "lastTransitionTime": "2026-12-05T20:00:05Z", "observedGeneration": 1}
                                      for t, s, r in (("Ready", "True", "Available"),
                                                      ("Reconciling", "False", "Reconciled"),
                                                      ("Stalled", "False", "Reconciled"),
                                                      ("Degraded", "False", "Healthy"))]}
    deployment["status"] = {"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
                            "readyReplicas": replicas, "availableReplicas": replicas,
                            "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                                           {"type": "Progressing", "status": "True",
                                            "reason": "NewReplicaSetAvailable"}]}
    template = deployment["spec"]["template"]
    hash_ = f"{i:010x}"
    rs_labels = {**template["metadata"]["labels"], "pod-template-hash": hash_}
    replicaset = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
                  "metadata": {"name": f"{name}-{hash_}", "namespace": NS, "uid": _uid(), "generation": 1,
                               "labels": rs_labels, "ownerReferences": [_ref(deployment)],
                               "annotations": {"deployment.kubernetes.io/revision": "1"}},
                  "spec": {"replicas": replicas, "selector": {"matchLabels": rs_labels},
                           "template": {"metadata": {"labels": rs_labels}, "spec": template["spec"]}},
                  "status": {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas}}
    pods = []
    for r in range(replicas):
        ip = ip_base + i * replicas + r
        pod_ip = f"10.{(ip >> 16) & 255}.{(ip >> 8) & 255}.{ip & 255}"
        pods.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": f"{name}-{hash_}-{r:05d}", "namespace": NS, "uid": _uid(),
                                  "labels": rs_labels, "ownerReferences": [_ref(replicaset)],
                                  "generateName": f"{name}-{hash_}-"},
                     "spec": {**template["spec"], "nodeName": f"kwok-node-{ip % 200}",
                              "serviceAccountName": "default"},
                     "status": {"phase": "Running", "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
                                "hostIP": "10.0.0.1",
                                "conditions": [{"type": t, "status": "True"}
                                               for t in ("Initialized", "Ready", "ContainersReady",
                                                         "PodScheduled")],
                                "containerStatuses": [{"name": render.CONTAINER_NAME, "ready": True,
                                                       "restartCount": 0, "image": model["spec"]["image"],
                                                       "state": {"running": {"startedAt": "2026-12-05T20:00:03Z"}}}]}})
    owned = []
    for obj in (render.render_service(model), render.render_configmap(model, document)):
        obj["metadata"].update(namespace=NS, uid=_uid(), resourceVersion=str(3000 + i),
                               ownerReferences=[{**_ref(model), "controller": True}])
        owned.append(obj)
    return {"sparsemodels": [model], "deployments": [deployment], "replicasets": [replicaset], "pods": pods,
            "services": owned[:1], "configmaps": owned[1:]}


def gate_object(j: int) -> dict[str, Any]:
    from sparsegate_contracts import names
    from sparsegate_contracts import gate as gatedoc

    document = gatedoc.make_document({**gatedoc.DEFAULT_PARAMS, "toolGateThreshold": 0.85})
    return {"apiVersion": f"{names.GROUP}/{names.VERSION}", "kind": "GateConfig",
            "metadata": {"name": f"gate-{j}", "namespace": NS, "uid": _uid(), "generation": 1},
            "spec": {"params": {"toolGateThreshold": 0.85}, "rollout": {"analysisInterval": "5s"}},
            "status": {"stable": document.to_json(), "observedGeneration": 1}}


RESOURCES = {  # plural → (group, version, kind)
    "sparsemodels": ("sparsegate.dev", "v1alpha1", "SparseModel"),
    "gateconfigs": ("sparsegate.dev", "v1alpha1", "GateConfig"),
    "deployments": ("apps", "v1", "Deployment"),
    "replicasets": ("apps", "v1", "ReplicaSet"),
    "pods": ("", "v1", "Pod"),
    "services": ("", "v1", "Service"),  # a model's own: counted only where the operator watches them
    "configmaps": ("", "v1", "ConfigMap"),
}


async def measure(models: int, replicas: int, gates: int) -> dict[str, Any]:
    """Bytes held per object of each kind after Kopf's record and the operator's indexes."""
    import kopf
    from kopf._cogs.structs import bodies, references
    from kopf._core.engines import indexing
    from kopf._core.intents import registries
    from kopf._core.reactor import inventory

    import sparsegate.main as operator_main

    registry = registries.get_default_registry()
    settings = kopf.OperatorSettings()
    try:  # the memo `sparsegate run` gives Kopf (a baseline revision may predate it)
        from sparsegate.memo import OperatorMemo
        memo: kopf.Memo = OperatorMemo()
    except ImportError:
        memo = kopf.Memo()
    operator_main.configure(settings=settings, memo=memo)
    indexers = indexing.OperatorIndexers()
    indexers.ensure(registry._indexing.get_all_handlers())
    logger = logging.getLogger("bench")
    logger.disabled = True

    # Objects as text first: each event's body is decoded on its own, as a watch stream does.
    texts: dict[str, list[str]] = {plural: [] for plural in RESOURCES}
    for j in range(gates):
        texts["gateconfigs"].append(json.dumps(gate_object(j)))
    for i in range(models):
        for plural, objs in model_objects(i, replicas=replicas, gate=f"gate-{i % gates}", ip_base=1 << 8).items():
            texts[plural].extend(json.dumps(o) for o in objs)

    kinds: dict[str, Any] = {}
    keep: list[Any] = []  # nothing of the bodies is kept here: only counts
    gc.collect()
    tracemalloc.start()
    for plural, items in texts.items():
        group, version, kind = RESOURCES[plural]
        resource = references.Resource(group=group, version=version, plural=plural, kind=kind, namespaced=True)
        if not any(r.has_handlers(resource=resource) for r in (
                registry._watching, registry._changing, registry._indexing, registry._spawning)):
            continue  # not watched by this revision: the operator holds nothing for these
        memories = inventory.ResourceMemories()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for text in items:
            raw_body = json.loads(text)
            raw_event = {"type": None, "object": raw_body}
            memory = await memories.recall(raw_body, memobase=memo, noticed_by_listing=True)
            await indexing.index_resource(indexers=indexers, registry=registry, settings=settings,
                                          resource=resource, raw_event=raw_event, memory=memory.indexing_memory,
                                          logger=logger, memo=memory.memo, body=bodies.Body(raw_body))
            del raw_body, raw_event, memory
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        keep.append(memories)
        kinds[plural] = {"objects": len(items), "bytesPerObject": round(held / max(len(items), 1))}
    tracemalloc.stop()
    total = sum(k["bytesPerObject"] * k["objects"] for k in kinds.values())
    return {"models": models, "replicas": replicas, "gateconfigs": gates, "kinds": kinds,
            "bytesPerModel": round(total / models), "totalMiB": round(total / 2**20, 1)}


def run_here(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".kubeconfig", delete=False) as f:
        f.write(KUBECONFIG)
    os.environ["KUBECONFIG"] = f.name
    try:
        return asyncio.run(measure(args.models, args.replicas, args.gateconfigs))
    finally:
        os.unlink(f.name)


def run_baseline(rev: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same measurement of REV: its packages first on the path, in a subprocess."""
    tree = Path(tempfile.mkdtemp(prefix="bench-opmem-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(tree), rev],
                   check=True, capture_output=True)
    try:
        path = os.pathsep.join(str(tree / p) for p in ("operator", "ebpf", "workloads"))
        env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
        out = subprocess.run([sys.executable, __file__, "--json", "--models", str(args.models),
                              "--replicas", str(args.replicas), "--gateconfigs", str(args.gateconfigs)],
                             env=env, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", type=int, default=2000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--gateconfigs", type=int, default=400)
    p.add_argument("--baseline-rev", help="also measure this git revision and print the ratio")
    p.add_argument("--json", action="store_true", help="print only the result as one JSON line")
    args = p.parse_args()

    result = run_here(args)
    if args.json:
        print(json.dumps(result))
        return 0
    base = run_baseline(args.baseline_rev, args) if args.baseline_rev else None
    print(f"{args.models} models x {args.replicas} pods, {args.gateconfigs} GateConfigs: bytes held per object "
          "(Kopf's record + the operator's indexes)")
    head = f"{'kind':<14}{'objects':>9}{'bytes/object':>14}"
    print(head + (f"{'baseline':>10}{'ratio':>8}" if base else ""))
    for plural, k in result["kinds"].items():
        line = f"{plural:<14}{k['objects']:>9}{k['bytesPerObject']:>14}"
        if base:
            b = base["kinds"].get(plural, {}).get("bytesPerObject")
            line += f"{b:>10}{k['bytesPerObject'] / max(b, 1):>8.2f}" if b is not None else f"{'unwatched':>10}"
        print(line)
    line = f"{'per model':<23}{result['bytesPerModel']:>14}"
    if base:
        line += f"{base['bytesPerModel']:>10}{result['bytesPerModel'] / max(base['bytesPerModel'], 1):>8.2f}"
    print(line)
    print(f"at 10,000 models: {result['bytesPerModel'] * 10_000 / 2**20:.0f} MiB"
          + (f" (baseline {base['bytesPerModel'] * 10_000 / 2**20:.0f} MiB)" if base else ""))
    out_dir = REPO / "tests" / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_operator_memory.json").write_text(
        json.dumps({"result": result, "baseline": base, "baselineRev": args.baseline_rev}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
