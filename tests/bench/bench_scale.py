"""Operator at scale: 200 SparseModels, 1,000 pods, 100 kwok nodes (a benchmark, not a test).

    python tests/bench/bench_scale.py [--models 200] [--replicas 5] [--nodes 100] [--gateconfigs 20]

Starts its own local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok)
with ``--nodes`` fake nodes, installs the CRDs, runs the operator (``sparsegate run``, one
namespace, rollout tick 1 s) and creates ``--gateconfigs`` GateConfigs and ``--models``
SparseModels of ``--replicas`` pods each, spread over the GateConfigs. Pods are kwok pods only
(no model-server processes: 1,000 of those would need ~320 GB), so /healthz checks are refused
at once on the unbound loopback IPs, the cheap failure path. ``--headless``: every model asks for
a headless Service (``spec.service.headless``), so the API server allocates no virtual IP per model
(that allocation slows as Services accumulate).

Reports, side by side:
- time from the first create until every SparseModel is Ready (pods Running on kwok nodes);
- operator reconcile latency p50/p99 per kind, from its own histogram
  (``sparsegate_operator_reconcile_duration_seconds``), and the rollout tick p50/p99
  (``sparsegate_rollout_tick_duration_seconds``, one tick checks every pod of a GateConfig), and
  how long model work waited for a thread of its pool (reconciles: the model pool; status
  refreshes: the status pool), by work (``sparsegate_operator_model_pool_wait_seconds``);
- operator memory: peak RSS (VmHWM) and RSS at the end;
- the operator's own API requests (``sparsegate_operator_kube_requests_total``) by verb and
  resource, in all and per SparseModel, and by answer code (409: a status write that lost a race
  and was read again), with each kind's p50/p99 duration: where the API server's work and a
  reconcile's time go;
- ``--idle`` seconds (default 60) right after all are Ready: the operator's API requests per second
  and CPU (cores), and each control-plane process's CPU, while nothing changes;
- then one GateConfig change at scale: time for the controller to choose and record the first
  step (the pods cannot answer, so the step waits; that part is measured by the e2e tests);
- then steady state (``--changes``, default 200, ``--change-rate`` a second, default 10): models
  spread over the fleet scaled by one replica while the rest stay settled; the reconcile latency of
  just those changes (the histogram's difference over the phase), each kind of request's duration
  and the CPU of the operator and of each control-plane process over the phase, and per model, from
  a watch, seconds from the PATCH until its status shows the new generation and until it is Ready
  with the new count. Everything above is from before this phase, but for the operator's memory
  (peak and end RSS are read after it). ``--apiserver-cost`` adds, per
  change, the API server's requests by verb and resource, its watch events by kind, its writes by
  writer (an audit log) and a CPU profile sorted by work (``apiserver_cost.py``); the audit log and
  the profile cost the API server CPU themselves, so compare such runs' CPU only with each other.
  ``--operator-profile`` adds a py-spy profile of the operator over the phase, summed by package
  and function (``operator_profile.py``).
Results also go to tests/bench/results/bench_scale.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev"))

import apiserver_cost  # noqa: E402
import operator_profile  # noqa: E402
from benchstats import nearest_rank  # noqa: E402
from localcluster import LocalCluster, nodes, processes  # noqa: E402
from localcluster.ports import free_port  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

NS = "bench"



def histogram_buckets(text: str, name: str, want: dict[str, str]) -> tuple[dict[float, float], float]:
    """A histogram's cumulative buckets (le → count) and count, summed over samples with every label of ``want``."""
    buckets: dict[float, float] = {}
    count = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if any(s.labels.get(k) != v for k, v in want.items()):
                continue
            if s.name == f"{name}_bucket":
                buckets[float(s.labels["le"])] = buckets.get(float(s.labels["le"]), 0.0) + s.value
            elif s.name == f"{name}_count":
                count += s.value
    return buckets, count


def histogram_quantiles(text: str, name: str, label: tuple[str, str] | None,
                        labels: dict[str, str] | None = None, *, since: str | None = None) -> dict[str, float | None]:
    """p50/p99 of a histogram's samples with ``label`` (name, value) and every one of ``labels``;
    with ``since`` (an earlier scrape of the same process), of the observations made after it."""
    want = {**({label[0]: label[1]} if label else {}), **(labels or {})}
    buckets, count = histogram_buckets(text, name, want)
    if since is not None:
        earlier, earlier_count = histogram_buckets(since, name, want)
        buckets = {le: c - earlier.get(le, 0.0) for le, c in buckets.items()}
        count -= earlier_count
    out: dict[str, float | None] = {"count": count}
    for q in (0.5, 0.99):
        rank, prev_le, prev_c, value = q * count, 0.0, 0.0, None
        for le, c in sorted(buckets.items()):
            if count and c >= rank:
                value = prev_le if math.isinf(le) else prev_le + (le - prev_le) * (rank - prev_c) / max(c - prev_c, 1e-9)
                break
            prev_le, prev_c = le, c
        out[f"p{int(q * 100)}"] = value
    if 1.0 in buckets and count:
        out["shareUnder1s"] = round(buckets[1.0] / count, 4)
    return out


def histogram_sum(text: str, name: str, want: dict[str, str]) -> float:
    """A histogram's ``_sum`` over samples with every label of ``want``."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == f"{name}_sum" and all(s.labels.get(k) == v for k, v in want.items()))


def gc_pauses(text: str, *, since: str | None = None) -> dict[str, dict[str, float | None]]:
    """The operator's cyclic garbage collections by generation (``sparsegate_operator_gc_pause_seconds``):
    how many, p99, and seconds in all that every thread waited; with ``since``, after that scrape."""
    name, out = "sparsegate_operator_gc_pause_seconds", {}
    for g in ("0", "1", "2"):
        q = histogram_quantiles(text, name, ("generation", g), since=since)
        total = histogram_sum(text, name, {"generation": g}) - (histogram_sum(since, name, {"generation": g})
                                                                if since is not None else 0.0)
        out[g] = {"count": q["count"], "p99": None if q["p99"] is None else round(q["p99"], 3),
                  "sumSeconds": round(total, 2)}
    return out


def rounded(quantiles: dict[str, float | None]) -> dict[str, float | None]:
    return {k: v if v is None else round(v, 3) for k, v in quantiles.items()}


def counter_by(text: str, name: str, labels: tuple[str, ...]) -> dict[str, float]:
    """A counter's samples summed by the given labels ("verb resource" → count), largest first."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{name}_total":
                key = " ".join(s.labels.get(label, "") for label in labels)
                out[key] = out.get(key, 0.0) + s.value
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def counter_delta(later: str, earlier: str, name: str, labels: tuple[str, ...]) -> dict[str, float]:
    """What a counter grew by between two scrapes of the same process, by the given labels (keys
    that did not grow left out)."""
    before = counter_by(earlier, name, labels)
    return {k: v - before.get(k, 0.0) for k, v in counter_by(later, name, labels).items() if v > before.get(k, 0.0)}


def rss_kib(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmHWM"].split()[0]), int(fields["VmRSS"].split()[0])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CHANGED_LABEL = "bench.sparsegate.dev/changed"


def changed_names(models: int, gateconfigs: int, count: int) -> list[str]:
    """``count`` models spread over the fleet, none on gate-0 (whose pods the GateConfig change uses)."""
    eligible = [i for i in range(models) if i % gateconfigs != 0]
    step = max(1, len(eligible) // max(count, 1))
    return [f"m-{i:03d}" for i in eligible[::step][:count]]


def steady_changes(cluster: LocalCluster, *, names: list[str], rate: float, replicas: int,
                   timeout: float) -> dict[str, Any]:
    """Scale ``names`` from ``replicas`` to ``replicas + 1``, ``rate`` a second, once the fleet is
    settled (a user or a GitOps sync changing some models among many). Per model, seconds from its
    PATCH until its status shows the operator acted on that generation (``observedGeneration``),
    and until it is Ready with the new count (the Deployment controller, the scheduler and kwok
    included), both from a watch of the changed models (the PATCH also labels them)."""
    from kubernetes import client, watch

    from sparsegate.clients.kube import Kube, path_for

    kube = Kube.from_kubeconfig(str(cluster.kubeconfig))
    api = client.CustomObjectsApi(kube._api)
    seen: dict[str, list[tuple[float, dict]]] = {}  # name → (monotonic time, status) of each watch event
    stream = watch.Watch()

    stopping = threading.Event()
    failed: list[BaseException] = []

    def follow() -> None:
        try:
            for event in stream.stream(api.list_namespaced_custom_object, "sparsegate.dev", "v1alpha1", NS,
                                       "sparsemodels", label_selector=f"{CHANGED_LABEL}=1",
                                       timeout_seconds=int(timeout) + 60):
                obj = event["object"]
                seen.setdefault(obj["metadata"]["name"], []).append((time.monotonic(), obj.get("status") or {}))
        except Exception as e:  # noqa: BLE001 - stopping closes the stream under it
            if not stopping.is_set():
                failed.append(e)

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    time.sleep(1)  # the watch is open before the first change
    patched: dict[str, tuple[float, int]] = {}  # name → (time of the PATCH, generation it made)

    def change(name: str) -> None:
        t = time.monotonic()
        body = kube.request("PATCH", path_for("SparseModel", namespace=NS, name=name),
                            body={"metadata": {"labels": {CHANGED_LABEL: "1"}}, "spec": {"replicas": replicas + 1}},
                            content_type="application/merge-patch+json")
        patched[name] = (t, int(body["metadata"]["generation"]))

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = []
        for i, name in enumerate(names):
            time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            futures.append(pool.submit(change, name))
        for f in futures:
            f.result()  # a failed PATCH fails the bench
    sent_s = time.monotonic() - t0

    def first(name: str, done: Callable[[dict], bool]) -> float | None:
        t_patch, _ = patched[name]
        return next((t - t_patch for t, st in list(seen.get(name, ())) if t >= t_patch and done(st)), None)

    def acted(name: str) -> Callable[[dict], bool]:
        return lambda st: (st.get("observedGeneration") or 0) >= patched[name][1]

    def ready(name: str) -> Callable[[dict], bool]:
        return lambda st: acted(name)(st) and st.get("readyReplicas", 0) >= replicas + 1 and any(
            c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))

    while time.monotonic() - t0 < timeout and not failed and not all(first(n, ready(n)) is not None for n in patched):
        time.sleep(1)
    stopping.set()
    stream.stop()
    if failed:
        raise RuntimeError(f"the watch of the changed models failed: {failed[0]!r}")
    acted_s = sorted(x for n in patched if (x := first(n, acted(n))) is not None)
    ready_s = sorted(x for n in patched if (x := first(n, ready(n))) is not None)

    def quantiles(xs: list[float]) -> dict[str, float | int | None]:
        pick = (lambda q: round(nearest_rank(xs, q), 3)) if xs else (lambda q: None)
        return {"count": len(xs), "p50": pick(0.5), "p99": pick(0.99), "max": pick(1.0)}

    return {"changes": len(names), "patched": len(patched), "ratePerSecond": rate, "sentSeconds": round(sent_s, 1),
            "patchToObservedGeneration": quantiles(acted_s), "patchToReady": quantiles(ready_s)}


class CpuMeter:
    """The CPU (cores) each named process has used since the meter was made."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.t0 = pids, time.monotonic()
        self.cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}

    def cores(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        return {name: round((cpu_seconds(pid) - self.cpu0[name]) / elapsed, 3) for name, pid in self.pids.items()}


class ApiserverCost:
    """Where the API server's work goes over the steady phase: its requests by verb and resource
    (its own /metrics), the writes by writer (audit log), and a CPU profile of ``seconds`` taken
    from now, sorted by work (``apiserver_cost``)."""

    def __init__(self, cluster: LocalCluster, *, seconds: float) -> None:
        self.cluster, self.since = cluster, datetime.datetime.now(datetime.timezone.utc)
        self.metrics = cluster.kubectl("get", "--raw", "/metrics", timeout=120).stdout
        self.profiler = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.profile = self.profiler.submit(cluster.apiserver_profile, int(math.ceil(seconds)))

    def result(self, *, changes: int, models: int) -> dict[str, Any]:
        until = datetime.datetime.now(datetime.timezone.utc)
        # Everything before the phase (the create burst, the idle window, the GateConfig change), then the phase.
        before, writes = apiserver_cost.audited_writes(
            self.cluster.audit_log_path,
            edges=[datetime.datetime.min.replace(tzinfo=datetime.timezone.utc), self.since, until])
        later = self.cluster.kubectl("get", "--raw", "/metrics", timeout=120).stdout
        requests = counter_delta(later, self.metrics, "apiserver_request", ("verb", "resource", "subresource"))
        # Events sent to watchers (each watcher of a kind gets each event: the fan-out).
        events = counter_delta(later, self.metrics, "apiserver_watch_events", ("kind", "resource"))
        out_dir = REPO / "tests" / "bench" / "results"
        out_dir.mkdir(parents=True, exist_ok=True)
        profile = apiserver_cost.profile_breakdown(self.profile.result(), out_dir / "bench_scale-apiserver.pprof")
        self.profiler.shutdown()
        per_change = max(changes, 1)
        return {"requestsPerChange": {k.strip(): round(v / per_change, 2) for k, v in requests.items()
                                      if v / per_change >= 0.05},
                "writesPerChange": {k: round(v / per_change, 2) for k, v in writes.items() if v / per_change >= 0.05},
                "writesInAllPerChange": round(sum(writes.values()) / per_change, 2),
                "watchEventsPerChange": {k.strip(): round(v / per_change, 2) for k, v in events.items()
                                         if v / per_change >= 0.05},
                "cpuProfile": profile,
                "writesPerModelBeforePhase": {k: round(v / max(models, 1), 2) for k, v in before.items()
                                              if v / max(models, 1) >= 0.05}}


def check_operator(proc: subprocess.Popen, log: Path) -> None:
    """RuntimeError with the end of its log if the operator has exited: waiting on a dead
    operator would only run out the bench's timeout."""
    if proc.poll() is not None:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"the operator exited ({proc.returncode}); {log} ends:\n{tail}")


def start_operator(cluster: LocalCluster, state: Path,
                   extra_args: Sequence[str] = ()) -> tuple[subprocess.Popen, int]:
    """CRDs, namespace ``NS`` and the operator (``sparsegate run``, standalone, rollout tick 1 s)
    on a started cluster; answers the operator's process and metrics port."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "charts" / "sparsegate" / "crds"))
    for crd in ("sparsemodels", "gateconfigs"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}.sparsegate.dev", "--timeout=60s")
    cluster.kubectl("create", "namespace", NS)
    while cluster.kubectl("get", "serviceaccount", "default", "-n", NS, check=False).returncode != 0:
        time.sleep(0.2)
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "SPARSEGATE_ROLLOUT_TICK_S": "1"}
    proc = processes.start(name="operator", argv=[sys.executable, "-m", "sparsegate.cli", "run", "--standalone",
                                                  "-n", NS, f"--metrics-port={port}", *extra_args],
                           log_path=state / "operator.log", pid_file=state / "operator.pid", env=env,
                           die_with_parent=True)
    time.sleep(3)
    check_operator(proc, state / "operator.log")
    return proc, port


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", type=int, default=200)
    p.add_argument("--replicas", type=int, default=5)
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--gateconfigs", type=int, default=20)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--idle", type=float, default=60, help="seconds of idle measured after all are Ready")
    p.add_argument("--pod-cidr", default="127.42.0.0/16")
    p.add_argument("--changes", type=int, default=200,
                   help="models scaled by one replica once all are Ready and the GateConfig change is recorded")
    p.add_argument("--change-rate", type=float, default=10, help="changes a second")
    p.add_argument("--operator-arg", action="append", default=[],
                   help="one more argument for `sparsegate run` (repeatable), e.g. --operator-arg=--gc-freeze-interval=0")
    p.add_argument("--apiserver-cost", action="store_true",
                   help="over the steady phase, also the API server's writes by writer (audit log) and a CPU "
                        "profile of it sorted by work (apiserver_cost.py); both add to its CPU")
    p.add_argument("--operator-profile", action="store_true",
                   help="over the steady phase, also a py-spy profile of the operator (samples holding the "
                        "GIL) summed by package and function (operator_profile.py)")
    p.add_argument("--headless", action="store_true",
                   help="models with spec.service.headless (no virtual IP allocated per model)")
    args = p.parse_args()
    if args.operator_profile:
        operator_profile.py_spy()  # missing: fail now, not after the burst

    state = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    # A pod CIDR of its own: the default 127.20.0.0/16 may be served by another local cluster.
    cluster = LocalCluster(state_dir=state, pod_cidr=args.pod_cidr,
                           node_shape=nodes.NodeShape(count=args.nodes, gpu_count=0, max_pods=110),
                           audit_log=args.apiserver_cost, profiling=args.apiserver_cost)
    t0 = time.monotonic()
    cluster.start()
    print(f"cluster up in {time.monotonic() - t0:.1f}s with {args.nodes} nodes ({state})", flush=True)
    op_proc = None
    try:
        op_proc, port = start_operator(cluster, state, args.operator_arg)
        gcs = [{"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig", "metadata": {"name": f"gate-{i}"},
                "spec": {"params": {"toolGateThreshold": 0.85}, "rollout": {"analysisInterval": "5s"}}}
               for i in range(args.gateconfigs)]
        models = [{"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "metadata": {"name": f"m-{i:03d}"},
                   "spec": {"image": "ghcr.io/sparsegate/model-server:0.1.0", "replicas": args.replicas,
                            "gateConfigRef": {"name": f"gate-{i % args.gateconfigs}"},
                            "model": {"dModel": 128, "experts": 4, "maxExpertsPerToken": 2},
                            **({"service": {"headless": True}} if args.headless else {})}}
                  for i in range(args.models)]
        t_create = time.monotonic()
        for chunk in range(0, len(gcs) + len(models), 50):
            items = (gcs + models)[chunk:chunk + 50]
            cluster.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                            "items": items}), timeout=120)
        created_s = time.monotonic() - t_create
        print(f"created {len(gcs)} GateConfigs + {len(models)} SparseModels in {created_s:.1f}s", flush=True)

        ready_s = None
        while time.monotonic() - t_create < args.timeout:
            check_operator(op_proc, state / "operator.log")
            out = json.loads(cluster.kubectl("get", "sparsemodels", "-n", NS, "-o", "json", timeout=120).stdout)
            ready = sum(1 for m in out["items"] if any(c["type"] == "Ready" and c["status"] == "True"
                                                       for c in (m.get("status") or {}).get("conditions", [])))
            if ready == len(models):
                ready_s = time.monotonic() - t_create
                break
            print(f"  {ready}/{len(models)} Ready after {time.monotonic() - t_create:.0f}s", flush=True)
            # Every 5 s, less often past 1,000 models: listing them all is itself load on the same cores.
            time.sleep(max(5.0, 1.5 * len(models) / 1000))
        pods = json.loads(cluster.kubectl("get", "pods", "-n", NS, "-o", "json", timeout=120).stdout)["items"]
        running = sum(1 for x in pods if x["status"].get("phase") == "Running")
        # Who lags when models are not all Ready: the controller-manager (Deployments not yet
        # available) or the operator (Deployments available, model status not yet written)?
        deployments = json.loads(cluster.kubectl("get", "deployments", "-n", NS, "-o", "json",
                                                 timeout=120).stdout)["items"]
        available = {d["metadata"]["name"] for d in deployments
                     if (d.get("status") or {}).get("availableReplicas", 0) >= d["spec"].get("replicas", 1)}
        out = json.loads(cluster.kubectl("get", "sparsemodels", "-n", NS, "-o", "json", timeout=120).stdout)
        ready_names = {m["metadata"]["name"] for m in out["items"] if any(
            c["type"] == "Ready" and c["status"] == "True" for c in (m.get("status") or {}).get("conditions", []))}
        lag = {"deployments": len(deployments), "deploymentsAvailable": len(available),
               "modelsReady": len(ready_names),
               "availableButModelNotReady": len(available - ready_names),
               "modelReadyButDeploymentNotAvailable": len(ready_names - available)}
        print(f"at the cut: {lag}", flush=True)

        # Idle: nothing changes once all are Ready; what does the operator still send and burn?
        time.sleep(5)  # the last Ready events' own work
        url = f"http://127.0.0.1:{port}/metrics"
        before = urllib.request.urlopen(url, timeout=10).read().decode()
        t_idle, idle_meter = time.monotonic(), CpuMeter({"operator": op_proc.pid, **cluster.pids()})
        time.sleep(args.idle)
        after = urllib.request.urlopen(url, timeout=10).read().decode()
        idle_s = time.monotonic() - t_idle
        idle_control_cpu = idle_meter.cores()
        idle_cpu = idle_control_cpu.pop("operator")
        idle_requests = counter_delta(after, before, "sparsegate_operator_kube_requests", ("verb", "resource"))

        # One GateConfig change at scale: time until the first step is chosen and recorded.
        gc = "gate-0"
        cluster.kubectl("patch", "gateconfig", gc, "-n", NS, "--type=merge", "-p",
                        json.dumps({"spec": {"params": {"toolGateThreshold": 0.8}}}))
        t_change = time.monotonic()
        first_step_s = None
        while time.monotonic() - t_change < 60:
            ro = (json.loads(cluster.kubectl("get", "gateconfig", gc, "-n", NS, "-o", "json").stdout)
                  .get("status") or {}).get("rollout") or {}
            if ro.get("step") == 1 and ro.get("canaryInstances"):
                first_step_s = time.monotonic() - t_change
                break
            time.sleep(0.2)
        time.sleep(3)  # a few ticks at 1,000-pod scale for the tick histogram
        metrics = urllib.request.urlopen(url, timeout=10).read().decode()
        # Steady state: a few models change among many settled ones; the reconciles of just those.
        changes: dict[str, Any] | None = None
        if args.changes:
            meter = CpuMeter({"operator": op_proc.pid, **cluster.pids()})
            phase_s = args.changes / args.change_rate + 5
            cost = ApiserverCost(cluster, seconds=phase_s) if args.apiserver_cost else None
            profile_path = REPO / "tests" / "bench" / "results" / "bench_scale-operator.pyspy.txt"
            if args.operator_profile:
                profile_path.parent.mkdir(parents=True, exist_ok=True)
                profiler = operator_profile.start(op_proc.pid, seconds=int(math.ceil(phase_s)), output=profile_path)
            changes = steady_changes(cluster, names=changed_names(args.models, args.gateconfigs, args.changes),
                                     rate=args.change_rate, replicas=args.replicas, timeout=300)
            if cost is not None:
                changes["apiserver"] = cost.result(changes=args.changes, models=args.models)
            if args.operator_profile:
                changes["operatorProfile"] = operator_profile.result(profiler, profile_path)
            later = urllib.request.urlopen(url, timeout=10).read().decode()
            # The operator's CPU over the phase (cores; ~1 means its GIL is the queue), the control
            # plane's, and each kind of request's duration over the phase: where a steady reconcile's
            # time goes.
            changes["controlPlaneCpuCores"] = meter.cores()
            changes["operatorCpuCores"] = changes["controlPlaneCpuCores"].pop("operator")
            changes["apiRequests"] = counter_delta(later, metrics, "sparsegate_operator_kube_requests",
                                                   ("verb", "resource"))
            changes["apiRequestSeconds"] = {
                key: rounded(histogram_quantiles(later, "sparsegate_operator_kube_request_duration_seconds", None,
                                                 labels={"verb": key.split()[0], "resource": key.split()[1]},
                                                 since=metrics))
                for key in changes["apiRequests"]}
            changes["apiRequestsByCode"] = {
                key: n for key, n in counter_delta(later, metrics, "sparsegate_operator_kube_requests",
                                                   ("verb", "resource", "code")).items()
                if not key.endswith(" 200")}
            changes["reconcileSparseModel"] = rounded(histogram_quantiles(
                later, "sparsegate_operator_reconcile_duration_seconds", ("kind", "SparseModel"), since=metrics))
            changes["reconcileService"] = rounded(histogram_quantiles(
                later, "sparsegate_operator_reconcile_duration_seconds", ("kind", "Service"), since=metrics))
            changes["modelPoolWait"] = rounded(histogram_quantiles(
                later, "sparsegate_operator_model_pool_wait_seconds", ("work", "reconcile"), since=metrics))
            changes["operatorGcPauses"] = gc_pauses(later, since=metrics)
            print(f"steady-state changes: {json.dumps(changes)}", flush=True)
        hwm, rss = rss_kib(op_proc.pid)
        requests = counter_by(metrics, "sparsegate_operator_kube_requests", ("verb", "resource"))
        reconciles = counter_by(metrics, "sparsegate_operator_reconciles", ("kind", "outcome"))
        result = {
            "models": args.models, "headless": args.headless, "replicas": args.replicas, "pods": len(pods), "podsRunning": running,
            "nodes": args.nodes, "gateconfigs": args.gateconfigs,
            "createSeconds": round(created_s, 2),
            "allReadySeconds": None if ready_s is None else round(ready_s, 2),
            "readiness": lag,
            "reconcileSparseModel": histogram_quantiles(metrics, "sparsegate_operator_reconcile_duration_seconds",
                                                        ("kind", "SparseModel")),
            # The models' Service applies, which a reconcile starts and does not wait for
            # (modelsync.PendingService); their wait for a thread is modelPoolWait's service_apply.
            "reconcileService": histogram_quantiles(metrics, "sparsegate_operator_reconcile_duration_seconds",
                                                    ("kind", "Service")),
            "reconcileGateConfig": histogram_quantiles(metrics, "sparsegate_operator_reconcile_duration_seconds",
                                                       ("kind", "GateConfig")),
            "rolloutTick": histogram_quantiles(metrics, "sparsegate_rollout_tick_duration_seconds", None),
            # How long model work queued for a thread of its pool, by work: a long wait here with
            # short work means the pool (not the API server) is the queue.
            "modelPoolWait": {work: histogram_quantiles(metrics, "sparsegate_operator_model_pool_wait_seconds",
                                                        ("work", work))
                              for work in ("reconcile", "deployment_changed", "pod_stuck", "read_and_reconcile",
                                           "service_apply")},
            "firstStepRecordedSeconds": None if first_step_s is None else round(first_step_s, 2),
            "canaryInstances": ro.get("canaryInstances"),
            "operatorPeakRssMiB": round(hwm / 1024, 1), "operatorRssMiB": round(rss / 1024, 1),
            # Python's cyclic collections until the GateConfig change (each stops every thread).
            "operatorGcPauses": gc_pauses(metrics),
            # Where the API server's work comes from: the operator's own requests (not Kopf's
            # watches), in all and per SparseModel, by verb and resource.
            "apiRequests": sum(requests.values()),
            "apiRequestsPerModel": round(sum(requests.values()) / max(args.models, 1), 1),
            "apiRequestsByVerbResource": requests,
            "apiRequestsByCode": counter_by(metrics, "sparsegate_operator_kube_requests", ("code",)),
            # How long each kind of request took (p50/p99 from the operator's histogram): a
            # reconcile's time is the sum of its requests'.
            "apiRequestSeconds": {
                key: {k: v if k == "count" else round(v, 3) for k, v in histogram_quantiles(
                    metrics, "sparsegate_operator_kube_request_duration_seconds",
                    None, labels={"verb": key.split()[0], "resource": key.split()[1]}).items() if v is not None}
                for key in requests},
            "reconciles": reconciles,
            # The idle window right after all were Ready: requests per second and the operator's CPU
            # (cores) with nothing to do.
            "idleSeconds": round(idle_s, 1),
            "idleRequestsPerSecond": round(sum(idle_requests.values()) / idle_s, 2),
            "idleRequestsByVerbResource": idle_requests,
            "idleCpuCores": round(idle_cpu, 3),
            "idleControlPlaneCpuCores": idle_control_cpu,
            # --changes models scaled once the fleet is settled (the figures above are from before).
            "steadyChanges": changes,
        }
        print(json.dumps(result, indent=2))
        out_dir = REPO / "tests" / "bench" / "results"
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_scale.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0 if ready_s is not None else 1
    finally:
        if op_proc is not None:
            processes.stop_from_pid_file(state / "operator.pid", grace_s=10, popen=op_proc)
        cluster.stop()
        subprocess.run(["rm", "-rf", str(state)], check=False)


if __name__ == "__main__":
    sys.exit(main())
