"""A rollout across 1,000 pods (issue 13 item 6; a benchmark, not a test).

    python tests/bench/bench_rollout_scale.py [--pods 1000] [--nodes 11] [--qps 40]

Starts its own local control plane with kwok nodes, installs the CRDs, runs the operator
(``sparsegate run``, rollout tick 1 s) and creates one GateConfig and one SparseModel of
``--pods`` replicas. kwok runs no containers, so this bench runs the model server that the
Deployment describes *once*, as a process, with the Deployment's own arguments, gate ConfigMap
and admin Secret (TLS certificate and token), listening on 0.0.0.0: every kwok pod has a
loopback IP (``--pod-cidr``, 127.43.0.0/16), so that one process answers every pod's /healthz,
admin push and /metrics, over a TLS connection per pod address, as 1,000 servers would.
What this measures is the control plane: the operator's health checks, pushes, scrapes, status
writes and step decisions for 1,000 pod addresses. What it does not: 1,000 model servers'
own work (all pushes land on one process, and the analysis sums that process's counters once
per pod, so request counts are ×pods: error rate and p99 are unchanged, but drift's standard error
would be √pods too small, so the bench's GateConfig does not judge drift; the p99 SLA is loose,
as that process also answers every pod's control traffic).

Then, with ``--qps`` of inference load on the first 10 pod addresses, one GateConfig change is
rolled out by the default request-level strategy (steps 5 → 20 → 100 %) and the bench reports:
- seconds from the change to each step and to Succeeded (the new version stable);
- the rollout tick p50/p99 and the operator's API requests during the rollout;
- admin pushes the operator sent (``sparsegate_rollout_gate_pushes``, in all and per pod) and the
  server received (``sparsegate_gate_config_applies_total``, in all: every pod address reaches it);
- the operator's CPU (cores) during the rollout, and its peak RSS over the whole run (VmHWM: the
  fleet's creation included) and RSS at the end;
- the load's answers (every request answered 200: a hot reload drops nothing).
Needs ports 8443 (the admin port every pod declares) and ``--serving-port`` free on 0.0.0.0.
Results also go to tests/bench/results/bench_rollout_scale.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_scale import NS, REPO, counter_by, cpu_seconds, histogram_quantiles, rss_kib, start_operator

from localcluster import LocalCluster, nodes, processes  # noqa: E402  (bench_scale put dev/ on the path)
from localcluster.ports import free_port  # noqa: E402
from loadgen import BackgroundLoad  # noqa: E402

from sparsegate.domain.render import ADMIN_DIR, GATE_DIR, admin_secret_name, gate_configmap_name
from sparsegate_contracts import names

MODEL, GATE = "m", "gate"


def kubectl_json(cluster: LocalCluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-n", NS, "-o", "json", timeout=120).stdout)


def wait(what: str, done, *, timeout_s: float, interval_s: float = 2.0):
    """Poll ``done()`` until it answers something truthy; prints progress, fails at the timeout."""
    t0 = time.monotonic()
    while True:
        value = done()
        if value:
            print(f"  {what}: {time.monotonic() - t0:.1f}s", flush=True)
            return value
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def server_argv(deployment: dict, *, admin_dir: Path, gate_dir: Path) -> list[str]:
    """The Deployment's model-server command line, run here: the pod's volume paths mapped to local
    files, and --host 0.0.0.0 in place of the pod IP."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = []
    for a in container["args"]:
        if a.startswith("--host="):
            a = "--host=0.0.0.0"
        args.append(a.replace(ADMIN_DIR, str(admin_dir)).replace(GATE_DIR, str(gate_dir)))
    return [sys.executable, "-m", "sparsegate_workload.server", *args]


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=30).read().decode()


def pushes(text: str) -> dict[str, float]:
    return counter_by(text, "sparsegate_gate_config_applies", ("result",))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pods", type=int, default=1000)
    p.add_argument("--nodes", type=int, default=None, help="kwok nodes (default: pods / 100 + 1)")
    p.add_argument("--qps", type=float, default=40.0)
    p.add_argument("--analysis-interval", default="10s")
    p.add_argument("--sla-p99-ms", type=float, default=10000.0,
                   help="the GateConfig's p99 SLA (loose: one process serves every pod address)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds for the rollout itself")
    p.add_argument("--serving-port", type=int, default=0, help="0: a free port")
    p.add_argument("--pod-cidr", default="127.43.0.0/16")
    args = p.parse_args()
    n_nodes = args.nodes or args.pods // 100 + 1
    serving_port = args.serving_port or free_port()

    state = Path(tempfile.mkdtemp(prefix="bench-rollout-scale-"))
    cluster = LocalCluster(state_dir=state, pod_cidr=args.pod_cidr,
                           node_shape=nodes.NodeShape(count=n_nodes, gpu_count=0, max_pods=110))
    t0 = time.monotonic()
    cluster.start()
    print(f"cluster up in {time.monotonic() - t0:.1f}s with {n_nodes} nodes ({state})", flush=True)
    op_proc = server = load = None
    try:
        op_proc, op_port = start_operator(cluster, state)
        op_url = f"http://127.0.0.1:{op_port}/metrics"
        # The SLA is loose: the one server also answers 1,000 pods' health checks, pushes and
        # scrapes, so its request latency is not what one pod's would be. Drift is not judged
        # (maxDrift 10, the most the CRD allows): the analysis counts that server's requests once
        # per pod, so its standard error would be √pods too small and a few real requests'
        # noise would read as significant.
        gateconfig = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig", "metadata": {"name": GATE},
                      "spec": {"params": {"toolGateThreshold": 0.85},
                               "rollout": {"analysisInterval": args.analysis_interval,
                                           "slaP99LatencyMs": args.sla_p99_ms, "maxDrift": 10}}}
        model = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "metadata": {"name": MODEL},
                 "spec": {"image": "ghcr.io/sparsegate/model-server:0.1.0", "replicas": args.pods,
                          "servingPort": serving_port, "gateConfigRef": {"name": GATE},
                          "model": {"dModel": 64, "experts": 4, "maxExpertsPerToken": 2}}}
        t_create = time.monotonic()
        cluster.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                        "items": [gateconfig, model]}))

        # The one model-server process, from what the operator rendered for the pods.
        deployment = wait("Deployment rendered", lambda: _get(cluster, "deployment", MODEL), timeout_s=120)
        secret = wait("admin Secret", lambda: _get(cluster, "secret", admin_secret_name(MODEL)), timeout_s=120)
        gate_cm = wait("gate ConfigMap", lambda: _get(cluster, "configmap", gate_configmap_name(MODEL)), timeout_s=120)
        admin_dir, gate_dir = state / "admin", state / "gate"
        admin_dir.mkdir()
        gate_dir.mkdir()
        for key in names.ADMIN_SECRET_KEYS:
            (admin_dir / key).write_bytes(base64.b64decode(secret["data"][key]))
        for key, value in gate_cm["data"].items():
            (gate_dir / key).write_text(value)
        server = processes.start(name="model-server", argv=server_argv(deployment, admin_dir=admin_dir,
                                                                         gate_dir=gate_dir),
                                 log_path=state / "model-server.log", pid_file=state / "model-server.pid",
                                 die_with_parent=True)
        server_url = f"http://127.0.0.1:{serving_port}"
        wait("model server answering", lambda: _ok(f"{server_url}/healthz"), timeout_s=180, interval_s=0.5)

        def pod_ips() -> list[str]:
            items = kubectl_json(cluster, "pods", "-l", f"{names.MODEL_LABEL}={MODEL}")["items"]
            return [x["status"]["podIP"] for x in items if x["status"].get("podIP") and any(
                c["type"] == "Ready" and c["status"] == "True" for c in x["status"].get("conditions", []))]

        wait(f"{args.pods} pods Ready", lambda: len(pod_ips()) >= args.pods, timeout_s=1200, interval_s=5)
        ready_s = time.monotonic() - t_create
        wait("GateConfig initialised (Succeeded)", lambda: _rollout(cluster).get("phase") == "Succeeded",
             timeout_s=600)
        ips = pod_ips()
        targets = [f"{ip}:{serving_port}" for ip in ips[:10]]
        load = BackgroundLoad(lambda: targets, qps=args.qps).start()
        time.sleep(5)  # baseline traffic before the change

        old_stable = _status(cluster)["stable"]["version"]
        before_ops, before_push = scrape(op_url), pushes(scrape(f"{server_url}/metrics"))
        requests0 = counter_by(before_ops, "sparsegate_operator_kube_requests", ("verb", "resource"))
        pushes0 = counter_by(before_ops, "sparsegate_rollout_gate_pushes", ("result",))
        cpu0 = cpu_seconds(op_proc.pid)
        cluster.kubectl("patch", "gateconfig", GATE, "-n", NS, "--type=merge", "-p",
                        json.dumps({"spec": {"params": {"toolGateThreshold": 0.8}}}))
        t_change = time.monotonic()
        timeline: list[dict] = []
        outcome = None
        while time.monotonic() - t_change < args.timeout:
            status = _status(cluster)
            ro = status.get("rollout") or {}
            seen = {k: ro.get(k) for k in ("phase", "step", "canaryWeight", "canaryInstances", "reason")}
            if not timeline or {k: v for k, v in timeline[-1].items() if k != "seconds"} != seen:
                timeline.append({**seen, "seconds": round(time.monotonic() - t_change, 1)})
                print(f"  +{timeline[-1]['seconds']:.1f}s {seen}", flush=True)
            promoted = ro.get("phase") == "Succeeded" and status["stable"]["version"] != old_stable
            if promoted or ro.get("phase") in ("RolledBack", "Aborted"):
                outcome = ro.get("phase")
                break
            time.sleep(1.0)
        rollout_s = time.monotonic() - t_change
        cpu = (cpu_seconds(op_proc.pid) - cpu0) / rollout_s
        load.stop()
        load_stats, load = load.stats, None
        after_ops, after_push = scrape(op_url), pushes(scrape(f"{server_url}/metrics"))
        requests1 = counter_by(after_ops, "sparsegate_operator_kube_requests", ("verb", "resource"))
        operator_pushes = {k: v - pushes0.get(k, 0.0) for k, v in counter_by(
            after_ops, "sparsegate_rollout_gate_pushes", ("result",)).items() if v - pushes0.get(k, 0.0) > 0}
        during = {k: v - requests0.get(k, 0.0) for k, v in requests1.items() if v - requests0.get(k, 0.0) > 0}
        pushed = {k: v - before_push.get(k, 0.0) for k, v in after_push.items() if v - before_push.get(k, 0.0) > 0}
        hwm, rss = rss_kib(op_proc.pid)
        result = {
            "pods": args.pods, "podsReady": len(ips), "nodes": n_nodes, "podsReadySeconds": round(ready_s, 1),
            "qps": args.qps, "analysisInterval": args.analysis_interval,
            "outcome": outcome, "message": ro.get("message"), "rolloutSeconds": round(rollout_s, 1), "timeline": timeline,
            "rolloutTick": histogram_quantiles(after_ops, "sparsegate_rollout_tick_duration_seconds", None,
                                               since=before_ops),
            # PUT /admin/gate: what the operator sent (by its result) and what the server received
            # (applied, or unchanged: already held — every pod address reaches the same process).
            "pushesSent": operator_pushes, "pushesReceived": pushed,
            "pushesPerPod": round(sum(operator_pushes.values()) / max(len(ips), 1), 2),
            "apiRequestsDuringRollout": during, "apiRequestsDuringRolloutTotal": sum(during.values()),
            "operatorCpuCoresDuringRollout": round(cpu, 3),
            "operatorPeakRssMiB": round(hwm / 1024, 1), "operatorRssMiB": round(rss / 1024, 1),
            "load": load_stats,
        }
        print(json.dumps(result, indent=2))
        out_dir = REPO / "tests" / "bench" / "results"
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_rollout_scale.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0 if outcome == "Succeeded" else 1
    finally:
        if load is not None:
            load.stop()
        if server is not None:
            processes.stop_from_pid_file(state / "model-server.pid", grace_s=10, popen=server)
        if op_proc is not None:
            processes.stop_from_pid_file(state / "operator.pid", grace_s=10, popen=op_proc)
        cluster.stop()
        subprocess.run(["rm", "-rf", str(state)], check=False)


def _get(cluster: LocalCluster, kind: str, name: str) -> dict | None:
    out = cluster.kubectl("get", kind, name, "-n", NS, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _status(cluster: LocalCluster) -> dict:
    return (_get(cluster, "gateconfig", GATE) or {}).get("status") or {}


def _rollout(cluster: LocalCluster) -> dict:
    return _status(cluster).get("rollout") or {}


def _ok(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=5).status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
