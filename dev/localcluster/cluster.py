"""LocalCluster: a real etcd + kube-apiserver + controller-manager + scheduler + kwok on loopback.

Everything a cluster owns lives in its state directory (certs, kubeconfigs, etcd data, logs,
pid files, state.json with its ports), so several clusters can run side by side and ``down``
works from another process. A cluster started again on its state dir keeps its objects, but not its
pods: their controllers make new ones (kwok's pod IPs are not kept across restarts).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import yaml

from localcluster import config, health, nodes, pki, podman, processes
from localcluster.binaries import CONTROL_PLANE_BINARIES, find_binaries
from localcluster.ports import pick_free_ports

STAGES_FILE = Path(__file__).with_name("kwok-stages.yaml")
POD_START_STAGE = Path(__file__).with_name("kwok-stage-pod-start.yaml")
POD_RUNNER = "podrunner"

# The opt-in audit policy: who wrote what and when (Metadata: no bodies), nothing for reads, one
# event per request (at ResponseComplete). Enough to tell which identity wrote and when.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
        {"level": "None"},
    ],
}


class ClusterError(RuntimeError):
    """The cluster could not be started, or is in a state that forbids the request."""


def default_state_dir() -> Path:
    explicit = os.environ.get("SPARSEGATE_STATE")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("SPARSEGATE_CACHE") or str(Path.home() / ".cache" / "sparsegate")
    return Path(cache) / "cluster"


class LocalCluster:
    """One local control plane. Use as a context manager, or ``start()``/``stop()``."""

    def __init__(
        self,
        *,
        state_dir: Path | str | None = None,
        node_shape: nodes.NodeShape | None = None,
        pod_cidr: str = config.DEFAULT_POD_CIDR,
        bin_directory: Path | None = None,
        die_with_parent: bool = True,
        startup_timeout_s: float = 180.0,
        containers: bool = False,
        audit_log: bool = False,
        profiling: bool = False,
    ) -> None:
        self.layout = config.Layout(Path(state_dir) if state_dir is not None else default_state_dir())
        self.node_shape = node_shape or nodes.NodeShape()
        self.pod_cidr = pod_cidr
        self.bin_directory = bin_directory
        self.die_with_parent = die_with_parent
        self.startup_timeout_s = startup_timeout_s
        # Container mode: the pod runner (podrunner.py) runs every pod's containers with podman and
        # reports their readiness; without it, kwok marks pods Ready and nothing runs.
        self.containers = containers
        # Audit log of every write (AUDIT_POLICY) at ``audit_log_path``; off by default (cost).
        self.audit_log = audit_log
        # The API server's /debug/pprof (``apiserver_profile``); off by default, as on real clusters' hardened setups.
        self.profiling = profiling
        self.ports: config.Ports | None = None
        self.timings: dict[str, float] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._bins: dict[str, Path] = {}

    # -- public surface -------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.layout.state_dir

    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    @property
    def audit_log_path(self) -> Path:
        """JSON lines, one audit event per write request (only when started with ``audit_log``)."""
        return self.layout.logs / "audit.log"

    @property
    def server(self) -> str:
        ports = self.ports or self._load_ports()
        return config.apiserver_url(ports)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Starts every component and returns once nodes are Ready and pods can be created."""
        t0 = time.monotonic()
        # Fail before touching anything when a binary is missing (names them and the setup command).
        self._bins = find_binaries(CONTROL_PLANE_BINARIES, directory=self.bin_directory)
        running = self.running_components()
        if running:
            raise ClusterError(f"cluster in {self.state_dir} already running ({', '.join(running)}); stop it first")
        for attempt in (1, 2):
            try:
                self._start(t0)
                return
            except health.StartupError as exc:
                self.stop()
                # Ports are picked, released, then bound by the component: a parallel cluster
                # (or any process) can take one in between. Pick fresh ones once.
                if attempt == 2 or "address already in use" not in str(exc):
                    raise
            except BaseException:
                self.stop()
                raise

    def stop(self, *, grace_s: float = 10.0) -> list[str]:
        """Stops every component (ours or, via pid files, another process's). Returns those stopped."""
        stopped = []
        for name in (POD_RUNNER, *reversed(config.COMPONENTS)):
            # The pod runner stops its containers on the way out: give it the time that takes.
            grace = max(grace_s, 40.0) if name == POD_RUNNER else grace_s
            if processes.stop_from_pid_file(self.layout.pid_file(name), grace_s=grace, popen=self._procs.pop(name, None)):
                stopped.append(name)
        # Containers a killed runner left behind would keep their pod IPs bound: remove them too.
        if (self.state_dir / "podrunner").exists() and shutil.which("podman"):
            if podman.remove_runner_containers(podman.runner_id(self.state_dir / "podrunner")):
                stopped.append("containers")
        return stopped

    def running_components(self) -> list[str]:
        return [name for name in (*config.COMPONENTS, POD_RUNNER) if processes.pid_file_alive(self.layout.pid_file(name))]

    def pids(self) -> dict[str, int]:
        found = {}
        for name in (*config.COMPONENTS, POD_RUNNER):
            pid = processes.pid_file_alive(self.layout.pid_file(name))
            if pid is not None:
                found[name] = pid
        return found

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Runs the built kubectl against this cluster; raises with its stderr when ``check`` fails."""
        proc = subprocess.run(
            [*self._kubectl_argv(), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def _kubectl_argv(self) -> list[str]:
        """The built kubectl with this cluster's kubeconfig (``kubectl`` answers text, ``apiserver_profile`` bytes)."""
        exe = self._bins.get("kubectl") or find_binaries(("kubectl",), directory=self.bin_directory)["kubectl"]
        return [str(exe), f"--kubeconfig={self.kubeconfig}"]

    def apiserver_profile(self, seconds: int) -> bytes:
        """A CPU profile of the API server over the next ``seconds`` (pprof's gzipped protobuf, as
        ``go tool pprof`` reads it). Needs ``profiling=True``."""
        if not self.profiling:
            raise ClusterError("the API server serves /debug/pprof only when the cluster is started with profiling=True")
        proc = subprocess.run([*self._kubectl_argv(), "get", "--raw",
                               f"/debug/pprof/profile?seconds={int(seconds)}"],
                              capture_output=True, timeout=seconds + 60, check=False)
        if proc.returncode != 0:
            raise ClusterError(f"profiling the API server failed ({proc.returncode}): {proc.stderr.decode().strip()}")
        return proc.stdout

    def register_nodes(self, shape: nodes.NodeShape) -> None:
        """Registers the first ``shape.count`` fake nodes (existing ones are kept) and waits until all are Ready."""
        existing = set(self.kubectl("get", "nodes", "-o", "name").stdout.split())
        wanted = nodes.node_list(shape=shape, pod_cidr=self.pod_cidr)
        # Create only the missing ones (status is honoured on create only; one request each).
        wanted["items"] = [n for n in wanted["items"] if f"node/{n['metadata']['name']}" not in existing]
        if wanted["items"]:
            self.kubectl("create", "-f", "-", input=json.dumps(wanted), timeout=180)
        if shape.count:
            self.kubectl("wait", "--for=condition=Ready", "node", "-l", "type=kwok", "--timeout=120s", timeout=150)

    # -- start-up steps ------------------------------------------------------------------

    def _load_ports(self) -> config.Ports:
        try:
            data = json.loads(self.layout.state_file.read_text())
        except FileNotFoundError as exc:
            raise ClusterError(f"no cluster state in {self.state_dir}") from exc
        return config.Ports.from_dict(data["ports"])

    def _lap(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.timings[name] = round(now - since, 3)
        return now

    def _start(self, t0: float) -> None:
        layout = self.layout
        for d in (layout.state_dir, layout.logs, layout.pids):
            d.mkdir(parents=True, exist_ok=True)
        self.ports = ports = config.Ports(**pick_free_ports(config.PORT_NAMES))
        layout.state_file.write_text(
            json.dumps(
                {"ports": vars(ports), "podCIDR": self.pod_cidr, "server": config.apiserver_url(ports), "nodes": vars(self.node_shape)},
                indent=2,
            )
            + "\n"
        )
        self._write_credentials()
        t = self._lap("credentials", t0)

        # A restart over an earlier start's etcd data (`down`, then `up`): see _recycle_pods.
        restarted = layout.etcd_data.exists()
        etcd = self._spawn("etcd", config.etcd_args(layout, ports))
        health.wait_until(
            health.endpoint_ok(config.LOOPBACK, ports.etcd_client, "/health", context=None, expect='"health":"true"'),
            what="etcd", timeout_s=self.startup_timeout_s, proc=etcd, log=layout.log("etcd"),
        )
        t = self._lap("etcd", t)

        apiserver = self._spawn("kube-apiserver", config.apiserver_args(layout, ports, profiling=self.profiling)
                                      + self._audit_args())
        admin_tls = health.client_tls(ca=layout.cert("ca"), cert=layout.cert("admin"), key=layout.key("admin"))
        health.wait_until(
            health.endpoint_ok(config.LOOPBACK, ports.apiserver, "/readyz", context=admin_tls),
            what="kube-apiserver", timeout_s=self.startup_timeout_s, proc=apiserver, log=layout.log("kube-apiserver"),
        )
        t = self._lap("kube-apiserver", t)
        if restarted:
            self._recycle_pods()

        # These three only need the API server; start them together, then check each.
        kcm = self._spawn("kube-controller-manager", config.controller_manager_args(layout, ports))
        sched = self._spawn("kube-scheduler", config.scheduler_args(layout, ports))
        kwok = self._spawn(
            "kwok",
            config.kwok_args(layout, ports, stages_file=self._stages_file(), pod_cidr=self.pod_cidr,
                             node_ip=nodes.node_ip(0)),
        )
        insecure = health.insecure_tls()
        for name, proc, port, ctx in (
            ("kube-controller-manager", kcm, ports.controller_manager, insecure),
            ("kube-scheduler", sched, ports.scheduler, insecure),
            ("kwok", kwok, ports.kwok, None),
        ):
            health.wait_until(
                health.endpoint_ok(config.LOOPBACK, port, "/healthz", context=ctx),
                what=name, timeout_s=self.startup_timeout_s, proc=proc, log=layout.log(name),
            )
        t = self._lap("controllers", t)

        self.register_nodes(self.node_shape)
        t = self._lap("nodes", t)

        # Pods are rejected until the ServiceAccount controller made the namespace's default SA.
        health.wait_until(
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
            what="default ServiceAccount", timeout_s=self.startup_timeout_s, interval_s=0.2,
        )
        t = self._lap("service-account", t)
        if self.containers:
            self._start_pod_runner()
            self._lap("podrunner", t)
        self.timings["total"] = round(time.monotonic() - t0, 3)

    def _recycle_pods(self) -> None:
        """Deletes the pods kept from before a restart, before kwok starts; their controllers make new
        ones. kwok's pod-IP pool lives in its memory: a new kwok hands out the addresses those pods
        still hold again (two pods on one IP, and in container mode two servers on one address)."""
        self.kubectl("delete", "pods", "--all", "--all-namespaces", "--force", "--grace-period=0",
                     "--wait=false", timeout=120)

    def _write_credentials(self) -> None:
        layout = self.layout
        pki.ensure_ca(layout.pki)
        for spec in config.cert_specs():
            pki.ensure_cert(layout.pki, spec)
        pki.ensure_service_account_keys(layout.pki)
        ca_pem = layout.cert("ca").read_bytes()
        assert self.ports is not None
        server = config.apiserver_url(self.ports)

        def kubeconfig_for(cert_name: str, user: str) -> str:
            return config.render_kubeconfig(
                server=server, ca_pem=ca_pem, cert_pem=layout.cert(cert_name).read_bytes(),
                key_pem=layout.key(cert_name).read_bytes(), user=user,
            )

        _write_private(layout.kubeconfig, kubeconfig_for("admin", "admin"))
        for component in ("kube-controller-manager", "kube-scheduler", "kwok"):
            path = layout.component_kubeconfig(component)
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_private(path, kubeconfig_for(component, component))

    def _audit_args(self) -> list[str]:
        if not self.audit_log:
            return []
        policy = self.layout.work_dir("kube-apiserver") / "audit-policy.yaml"
        policy.parent.mkdir(parents=True, exist_ok=True)
        policy.write_text(yaml.safe_dump(AUDIT_POLICY, sort_keys=False))
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log_path}",
            "--audit-log-format=json",
            # Blocking: each event is written in its request's own path, not batched in the
            # background, so the log is current up to the requests just served.
            "--audit-log-mode=blocking",
        ]

    def _stages_file(self) -> Path:
        """kwok's stages; in container mode pod-ready gives way to pod-start (readiness is the runner's)
        and pod-delete is left out (the runner deletes a pod's object once its containers stopped)."""
        if not self.containers:
            return STAGES_FILE
        docs = [d for d in yaml.safe_load_all(STAGES_FILE.read_text())
                if d and d["metadata"]["name"] not in ("pod-ready", "pod-delete")]
        docs.append(yaml.safe_load(POD_START_STAGE.read_text()))
        path = self.layout.work_dir("kwok") / "stages.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        return path

    def _start_pod_runner(self) -> None:
        argv = [sys.executable, "-m", "localcluster", "--state-dir", str(self.state_dir), "podrunner",
                "--work-dir", str(self.state_dir / "podrunner")]
        dev_dir = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (dev_dir, os.environ.get("PYTHONPATH")) if p)}
        log = self.layout.log(POD_RUNNER)
        # The log is appended to across runs on one state dir: only what this runner writes counts.
        offset = log.stat().st_size if log.exists() else 0
        proc = processes.start(
            name=POD_RUNNER, argv=argv, log_path=self.layout.log(POD_RUNNER), pid_file=self.layout.pid_file(POD_RUNNER),
            cwd=self.state_dir, env=env, die_with_parent=self.die_with_parent,
            # SIGTERM, not SIGKILL: a runner killed with its test session would leave its containers
            # running for good (nothing else knows them); on SIGTERM it removes them on the way out.
            parent_death_signal=signal.SIGTERM,
        )
        self._procs[POD_RUNNER] = proc
        # It has no health port: it is up once its first pass over the pods succeeded.
        health.wait_until(
            lambda: b"synced:" in _read_from(log, offset),
            what=POD_RUNNER, timeout_s=60, proc=proc, log=log,
        )

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        # kwok would otherwise read/write ~/.kwok; keep each cluster's files in its own state dir.
        env["HOME"] = str(self.layout.work_dir(name))
        proc = processes.start(
            name=name,
            argv=[str(self._bins[name]), *args],
            log_path=self.layout.log(name),
            pid_file=self.layout.pid_file(name),
            cwd=self.layout.work_dir(name),
            env=env,
            die_with_parent=self.die_with_parent,
        )
        self._procs[name] = proc
        return proc


def _read_from(path: Path, offset: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read()


def _write_private(path: Path, text: str) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.write_text(text)
