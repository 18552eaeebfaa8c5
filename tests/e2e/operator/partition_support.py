"""Support for the leader-partition e2e test: operator processes on the host, each with its own
ServiceAccount token and its own cuttable TCP proxy to the API server, and the audit log's writes.

Imported by name (like operator_e2e_support): no conftest imports.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from localcluster import LocalCluster
from localcluster.binaries import find_binaries

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "sparsegate"
LEASE = "sparsegate-operator"  # the CLI's default --lease-name (and the chart's)


class CuttableProxy:
    """A TCP relay 127.0.0.1:<port> → the API server that a test can cut and heal.

    Cut: every open connection is torn down, and new connections are either accepted but never
    answered (``blackhole``: the client's TLS handshake hangs until its own timeout, as when
    packets are dropped) or closed at once (``reset``: the client fails fast with a connection
    error, as when the route is refused). Heal: connections relay again.
    TLS passes through untouched (the client still verifies the API server's certificate).
    """

    def __init__(self, target: tuple[str, int], *, mode: str = "blackhole") -> None:
        assert mode in ("blackhole", "reset"), mode
        self.target, self.mode = target, mode
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._held: list[socket.socket] = []
        self._cut = False
        self._closed = False
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._cut and self.mode == "blackhole":
                    self._held.append(client)
                    continue
            if self._cut:
                self._drop(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._drop(s)

    def _drop(self, s: socket.socket) -> None:
        with self._lock:
            self._open.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            victims = list(self._open)
        for s in victims:
            self._drop(s)

    def heal(self) -> None:
        with self._lock:
            self._cut = False
            held, self._held = self._held, []
        for s in held:
            self._drop(s)

    def close(self) -> None:
        self.cut()
        self._listener.close()
        self.heal()


def apiserver_address(cluster: LocalCluster) -> tuple[str, int]:
    host, _, port = cluster.server.removeprefix("https://").rpartition(":")
    return host, int(port)


def grant_chart_rbac(cluster: LocalCluster, *, namespace: str, service_accounts: list[str]) -> None:
    """The chart's own operator RBAC (rendered by helm into ``namespace``), bound to our accounts:
    the processes run with exactly the rights the chart gives the operator."""
    helm = find_binaries(("helm",))["helm"]  # raises naming the setup command when missing
    rendered = subprocess.run([str(helm), "template", "sg", str(CHART), "-n", namespace,
                               "--show-only", "templates/operator/rbac.yaml"],
                              capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    for doc in docs:
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            doc["subjects"] = [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}
                               for sa in service_accounts]
    assert any(d["kind"].endswith("Binding") for d in docs), rendered
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def token_kubeconfig(cluster: LocalCluster, *, path: Path, server: str, namespace: str,
                     service_account: str) -> Path:
    """A kubeconfig that reaches ``server`` (a proxy) as ``service_account`` (a bound token)."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace,
                            "--duration=2h").stdout.strip()
    ca = cluster.layout.cert("ca")
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "op",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": service_account, "user": {"token": token}}],
        "contexts": [{"name": "op", "context": {"cluster": "local", "user": service_account,
                                                 "namespace": namespace}}],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclasses.dataclass
class OperatorProcess:
    """``sparsegate run --leader-elect`` on the host as one identity (POD_NAME) and one kubeconfig."""

    identity: str
    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, *, identity: str, kubeconfig: Path, namespace: str, log: Path) -> OperatorProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update(
            KUBECONFIG=str(kubeconfig),  # read by our Kube client and by Kopf's login alike
            POD_NAME=identity,
            SPARSEGATE_NAMESPACE=namespace,  # the flow-policy ConfigMap (the chart's Role)
            SPARSEGATE_OPA_URL="http://127.0.0.1:9",  # no OPA needed: routing fails closed
            PYTHONUNBUFFERED="1",
        )
        argv = [sys.executable, "-m", "sparsegate.cli", "run", "--leader-elect", "--standalone",
                "--namespace", namespace, "--lease-namespace", namespace, "--log-format", "plain"]
        with log.open("ab") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return cls(identity=identity, proc=proc, log=log)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def leads(self) -> bool:
        return f"leading as {self.identity}" in self.text()

    def stop(self, *, timeout_s: float = 30) -> int | None:
        """SIGTERM (a clean stop: Kopf ends, the Lease is released); SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _time(s: str) -> float:
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


@dataclasses.dataclass(frozen=True)
class Write:
    """One write request as the API server's audit log recorded it (epoch seconds, server clock)."""

    user: str
    verb: str
    resource: str
    name: str
    code: int
    received: float
    completed: float


def audited_writes(cluster: LocalCluster, users: set[str]) -> list[Write]:
    writes = []
    for line in cluster.audit_log_path.read_text().splitlines():
        event: dict[str, Any] = json.loads(line)
        user = event["user"]["username"]
        if user not in users or event.get("stage") not in ("ResponseComplete", "Panic"):
            continue
        ref = event.get("objectRef") or {}
        writes.append(Write(user=user, verb=event["verb"],
                            resource="/".join(p for p in (ref.get("resource"), ref.get("subresource")) if p),
                            name=ref.get("name", ""), code=(event.get("responseStatus") or {}).get("code", 0),
                            received=_time(event["requestReceivedTimestamp"]),
                            completed=_time(event["stageTimestamp"])))
    return sorted(writes, key=lambda w: w.received)


def service_account_user(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"
