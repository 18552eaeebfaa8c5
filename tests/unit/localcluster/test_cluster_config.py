"""Rendering of component flags, kubeconfigs and certificates (pure)."""

import base64
import json
from pathlib import Path

from localcluster import config
from localcluster.pki import CertSpec, extensions, subject

PORTS = config.Ports(etcd_client=2379, etcd_peer=2380, apiserver=6443, controller_manager=10257, scheduler=10259, kwok=10247)
LAYOUT = config.Layout(Path("/state"))


def flag(args: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, args)
    return values[0]


def test_etcd_listens_on_loopback_only() -> None:
    args = config.etcd_args(LAYOUT, PORTS)
    assert flag(args, "listen-client-urls") == "http://127.0.0.1:2379"
    assert flag(args, "listen-peer-urls") == "http://127.0.0.1:2380"
    assert flag(args, "initial-cluster") == "default=http://127.0.0.1:2380"
    assert flag(args, "data-dir") == "/state/etcd"


def test_apiserver_secures_loopback_with_rbac_and_service_accounts() -> None:
    args = config.apiserver_args(LAYOUT, PORTS)
    assert flag(args, "bind-address") == "127.0.0.1"
    assert flag(args, "secure-port") == "6443"
    assert flag(args, "etcd-servers") == "http://127.0.0.1:2379"
    assert flag(args, "authorization-mode") == "Node,RBAC"
    assert flag(args, "client-ca-file") == "/state/pki/ca.crt"
    assert flag(args, "service-account-key-file") == "/state/pki/sa.pub"
    assert flag(args, "service-account-signing-key-file") == "/state/pki/sa.key"
    assert flag(args, "service-account-issuer").startswith("https://")


def test_apiserver_profiling_is_off_unless_asked() -> None:
    assert flag(config.apiserver_args(LAYOUT, PORTS), "profiling") == "false"
    assert flag(config.apiserver_args(LAYOUT, PORTS, profiling=True), "profiling") == "true"


def test_controllers_use_their_own_kubeconfigs_and_ports() -> None:
    kcm = config.controller_manager_args(LAYOUT, PORTS)
    assert flag(kcm, "kubeconfig") == "/state/kubeconfigs/kube-controller-manager.kubeconfig"
    assert flag(kcm, "secure-port") == "10257"
    assert flag(kcm, "service-account-private-key-file") == "/state/pki/sa.key"
    assert flag(kcm, "root-ca-file") == "/state/pki/ca.crt"
    sched = config.scheduler_args(LAYOUT, PORTS)
    assert flag(sched, "kubeconfig") == "/state/kubeconfigs/kube-scheduler.kubeconfig"
    assert flag(sched, "secure-port") == "10259"
    kwok = config.kwok_args(LAYOUT, PORTS, stages_file=Path("/s.yaml"), pod_cidr="127.20.0.0/16", node_ip="127.10.0.1")
    assert flag(kwok, "server-address") == "127.0.0.1:10247"
    assert flag(kwok, "cidr") == "127.20.0.0/16"
    assert flag(kwok, "config") == "/s.yaml"


def test_ports_round_trip_through_state_file_dict() -> None:
    assert config.Ports.from_dict(json.loads(json.dumps(vars(PORTS)))) == PORTS


def test_kubeconfig_inlines_credentials() -> None:
    doc = json.loads(
        config.render_kubeconfig(server="https://127.0.0.1:6443", ca_pem=b"CA", cert_pem=b"CRT", key_pem=b"KEY", user="admin")
    )
    assert doc["current-context"] == "sparsegate-local"
    assert doc["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert base64.b64decode(doc["clusters"][0]["cluster"]["certificate-authority-data"]) == b"CA"
    user = doc["users"][0]["user"]
    assert base64.b64decode(user["client-certificate-data"]) == b"CRT"
    assert base64.b64decode(user["client-key-data"]) == b"KEY"


def test_cert_identities_match_kubernetes_conventions() -> None:
    specs = {s.name: s for s in config.cert_specs()}
    assert specs["admin"].organizations == ("system:masters",)
    assert specs["kube-controller-manager"].common_name == "system:kube-controller-manager"
    assert specs["kube-scheduler"].common_name == "system:kube-scheduler"
    assert specs["kube-apiserver"].server and "127.0.0.1" in specs["kube-apiserver"].ip_addresses


def test_subject_and_extensions() -> None:
    assert subject(common_name="u", organizations=("g1", "g2")) == "/O=g1/O=g2/CN=u"
    ext = extensions(CertSpec(name="s", common_name="s", server=True, dns_names=("localhost",), ip_addresses=("127.0.0.1",)))
    assert "extendedKeyUsage=serverAuth" in ext
    assert "subjectAltName=DNS:localhost,IP:127.0.0.1" in ext
    client_ext = extensions(CertSpec(name="c", common_name="c", client=True))
    assert "extendedKeyUsage=clientAuth" in client_ext and "subjectAltName" not in client_ext
