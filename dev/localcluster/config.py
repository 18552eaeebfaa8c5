"""Pure rendering of the local cluster: file layout, certificates to make, component flags,
kubeconfigs. No processes, no I/O, so all of it is unit-tested.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

from localcluster.pki import CertSpec

LOOPBACK = "127.0.0.1"
# Pod IPs live inside loopback so a real process can bind them (dev/CONTRACTS.md).
DEFAULT_POD_CIDR = "127.20.0.0/16"
# Virtual only: nothing routes Service IPs here (no kube-proxy); they are never dialled.
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

# Component names double as process names, pid-file stems and log-file stems.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
PORT_NAMES = ("etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok")


@dataclasses.dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> Ports:
        return cls(**{name: int(data[name]) for name in PORT_NAMES})


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one cluster keeps its files under its state directory."""

    state_dir: Path

    @property
    def pki(self) -> Path:
        return self.state_dir / "pki"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pids(self) -> Path:
        return self.state_dir / "pids"

    @property
    def etcd_data(self) -> Path:
        return self.state_dir / "etcd"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig for users, tests and the operator."""
        return self.state_dir / "kubeconfig"

    def component_kubeconfig(self, component: str) -> Path:
        return self.state_dir / "kubeconfigs" / f"{component}.kubeconfig"

    def cert(self, name: str) -> Path:
        return self.pki / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.pki / f"{name}.key"

    def log(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def pid_file(self, component: str) -> Path:
        return self.pids / f"{component}.pid"

    def work_dir(self, component: str) -> Path:
        return self.state_dir / "work" / component


def cert_specs() -> tuple[CertSpec, ...]:
    """The API server's serving certificate and one client identity per component."""
    return (
        CertSpec(
            name="kube-apiserver",
            common_name="kube-apiserver",
            server=True,
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ip_addresses=(LOOPBACK, KUBERNETES_SERVICE_IP),
        ),
        CertSpec(name="admin", common_name="kubernetes-admin", organizations=("system:masters",), client=True),
        CertSpec(name="kube-controller-manager", common_name="system:kube-controller-manager", client=True),
        CertSpec(name="kube-scheduler", common_name="system:kube-scheduler", client=True),
        # kwok plays every kubelet (node status, leases, pod status, deletions): broad rights.
        CertSpec(name="kwok", common_name="kwok-controller", organizations=("system:masters",), client=True),
    )


def apiserver_url(ports: Ports) -> str:
    return f"https://{LOOPBACK}:{ports.apiserver}"


def etcd_url(ports: Ports) -> str:
    return f"http://{LOOPBACK}:{ports.etcd_client}"


def etcd_args(layout: Layout, ports: Ports) -> list[str]:
    peer = f"http://{LOOPBACK}:{ports.etcd_peer}"
    return [
        "--name=default",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={etcd_url(ports)}",
        f"--advertise-client-urls={etcd_url(ports)}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        # A throwaway dev store: durability is not worth an fsync per write on a shared 2-core box.
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def apiserver_args(layout: Layout, ports: Ports, *, profiling: bool = False) -> list[str]:
    """``profiling``: serve /debug/pprof (benchmarks that ask where the API server's CPU goes)."""
    return [
        f"--etcd-servers={etcd_url(ports)}",
        f"--bind-address={LOOPBACK}",
        f"--advertise-address={LOOPBACK}",
        f"--secure-port={ports.apiserver}",
        f"--tls-cert-file={layout.cert('kube-apiserver')}",
        f"--tls-private-key-file={layout.key('kube-apiserver')}",
        f"--client-ca-file={layout.cert('ca')}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={layout.pki / 'sa.pub'}",
        f"--service-account-signing-key-file={layout.pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # The apiserver's own address is loopback, which Endpoints validation rejects.
        "--endpoint-reconciler-type=none",
        "--allow-privileged=true",
        f"--profiling={'true' if profiling else 'false'}",
        f"--cert-dir={layout.work_dir('kube-apiserver')}",
    ]


def controller_manager_args(layout: Layout, ports: Ports) -> list[str]:
    kubeconfig = layout.component_kubeconfig("kube-controller-manager")
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports.controller_manager}",
        f"--cert-dir={layout.work_dir('kube-controller-manager')}",
        f"--service-account-private-key-file={layout.pki / 'sa.key'}",
        f"--root-ca-file={layout.cert('ca')}",
        f"--cluster-signing-cert-file={layout.cert('ca')}",
        f"--cluster-signing-key-file={layout.key('ca')}",
        "--use-service-account-credentials=true",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # EndpointSlice/Endpoints validation rejects loopback addresses, and every pod IP here is
        # one: those controllers could only retry forever. Find model pods by label instead.
        "--controllers=*,-endpoints-controller,-endpointslice-controller",
        # Defaults (20/30) throttle benchmarks with hundreds of pods.
        "--kube-api-qps=200",
        "--kube-api-burst=400",
        "--leader-elect=false",
        "--profiling=false",
    ]


def scheduler_args(layout: Layout, ports: Ports) -> list[str]:
    kubeconfig = layout.component_kubeconfig("kube-scheduler")
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports.scheduler}",
        f"--cert-dir={layout.work_dir('kube-scheduler')}",
        "--leader-elect=false",
        "--profiling=false",
    ]


def kwok_args(layout: Layout, ports: Ports, *, stages_file: Path, pod_cidr: str, node_ip: str) -> list[str]:
    return [
        f"--kubeconfig={layout.component_kubeconfig('kwok')}",
        f"--config={stages_file}",
        # Only nodes we register as fake; a real node (none here) would be left alone.
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        f"--cidr={pod_cidr}",
        f"--node-ip={node_ip}",
        f"--server-address={LOOPBACK}:{ports.kwok}",
        "--node-lease-duration-seconds=40",
    ]


def kubeconfig_document(*, server: str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes, user: str) -> dict:
    """A self-contained kubeconfig (certificates inlined, so it survives being copied)."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "sparsegate-local", "cluster": {"server": server, "certificate-authority-data": b64(ca_pem)}}],
        "users": [{"name": user, "user": {"client-certificate-data": b64(cert_pem), "client-key-data": b64(key_pem)}}],
        "contexts": [{"name": "sparsegate-local", "context": {"cluster": "sparsegate-local", "user": user}}],
        "current-context": "sparsegate-local",
        "preferences": {},
    }


def render_kubeconfig(*, server: str, ca_pem: bytes, cert_pem: bytes, key_pem: bytes, user: str) -> str:
    # JSON is valid YAML: kubectl, client-go and the Python client all read it.
    doc = kubeconfig_document(server=server, ca_pem=ca_pem, cert_pem=cert_pem, key_pem=key_pem, user=user)
    return json.dumps(doc, indent=2) + "\n"
