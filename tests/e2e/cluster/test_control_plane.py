"""The local control plane behaves like a cluster: Ready fake nodes, scheduled pods with loopback
IPs, garbage collection, and clean shutdown."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from localcluster import LocalCluster, NodeShape, processes
from localcluster.ports import is_port_free, pick_unused_pod_cidr
from localcluster.health import wait_for

pytestmark = pytest.mark.e2e

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
DEV_DIR = Path(__file__).resolve().parents[3] / "dev"



def get_json(kubectl: Callable[..., subprocess.CompletedProcess[str]], *args: str) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


def deployment(name: str, *, replicas: int, resources: dict | None = None) -> str:
    container = {"name": "app", "image": "registry.invalid/app:1", "ports": [{"name": "http", "containerPort": 8080}]}
    if resources:
        container["resources"] = resources
    return json.dumps({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [container]}},
        },
    })


def test_fake_nodes_are_ready_and_gpu_nodes_offer_gpus(kubectl) -> None:
    items = get_json(kubectl, "nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in items) == [f"kwok-node-{i}" for i in range(4)]
    for node in items:
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", node["metadata"]["name"]
        internal = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
        assert ipaddress.ip_address(internal[0]) in ipaddress.ip_network("127.10.0.0/16")
    gpu = [n for n in items if n["metadata"]["labels"].get("nvidia.com/gpu.present") == "true"]
    assert len(gpu) == 2
    assert all(n["status"]["capacity"]["nvidia.com/gpu"] == "8" for n in gpu)
    assert all(n["status"]["allocatable"]["nvidia.com/gpu"] == "8" for n in gpu)


def test_deployment_pods_run_on_kwok_nodes_with_loopback_ips_and_are_garbage_collected(cluster, kubectl, namespace) -> None:
    # Given a plain Deployment
    kubectl("apply", "-n", namespace, "-f", "-", input=deployment("web", replicas=3))
    # Then its pods are scheduled, Running and Ready with pod IPs in the cluster's loopback pod range
    kubectl("rollout", "status", "-n", namespace, "deployment/web", "--timeout=90s", timeout=120)
    pods = get_json(kubectl, "pods", "-n", namespace, "-l", "app=web")["items"]
    assert len(pods) == 3
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        assert pod["spec"]["nodeName"].startswith("kwok-node-")
        assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(cluster.pod_cidr)
        assert ipaddress.ip_network(cluster.pod_cidr).subnet_of(LOOPBACK)
    assert len({p["status"]["podIP"] for p in pods}) == 3
    assert len(get_json(kubectl, "replicasets", "-n", namespace, "-l", "app=web")["items"]) == 1

    # When the Deployment is deleted, the garbage collector removes its ReplicaSet and pods
    kubectl("delete", "-n", namespace, "deployment/web", "--wait=true", "--timeout=60s", timeout=90)
    wait_for(lambda: not get_json(kubectl, "replicasets", "-n", namespace, "-l", "app=web")["items"], what="ReplicaSet GC")
    wait_for(lambda: not get_json(kubectl, "pods", "-n", namespace, "-l", "app=web")["items"], what="pod GC")


def test_gpu_request_is_scheduled_on_a_gpu_node(kubectl, namespace) -> None:
    gpu = {"limits": {"nvidia.com/gpu": "8"}, "requests": {"nvidia.com/gpu": "8"}}
    kubectl("apply", "-n", namespace, "-f", "-", input=deployment("gpu", replicas=2, resources=gpu))
    kubectl("rollout", "status", "-n", namespace, "deployment/gpu", "--timeout=90s", timeout=120)
    pods = get_json(kubectl, "pods", "-n", namespace, "-l", "app=gpu")["items"]
    # Each GPU node has 8: two 8-GPU pods need both GPU nodes.
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["kwok-node-0", "kwok-node-1"]
    kubectl("delete", "-n", namespace, "deployment/gpu", "--wait=false")


def test_service_account_tokens_are_signed_and_rbac_is_enforced(kubectl, namespace) -> None:
    token = kubectl("create", "token", "default", "-n", namespace).stdout.strip()
    assert token.count(".") == 2
    # The default ServiceAccount may not list nodes: RBAC denies it.
    who = f"system:serviceaccount:{namespace}:default"
    assert kubectl("auth", "can-i", "list", "nodes", "--as", who, check=False).stdout.strip() == "no"
    assert kubectl("auth", "can-i", "list", "nodes").stdout.strip() == "yes"


def _component_pids(cluster: LocalCluster) -> dict[str, tuple[int, int]]:
    pids = {}
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
        recorded = processes.read_pid_file(cluster.layout.pid_file(name))
        assert recorded is not None, name
        pids[name] = recorded
    return pids


def _assert_all_gone(pids: dict[str, tuple[int, int]], ports: dict[str, int]) -> None:
    for name, (pid, ticks) in pids.items():
        assert processes.process_start_ticks(pid) != ticks or processes.is_zombie(pid), f"{name} (pid {pid}) still runs"
    for name, port in ports.items():
        assert is_port_free(port), f"port {name}={port} still bound"


def test_second_cluster_runs_beside_the_first_and_stop_leaves_no_process(cluster: LocalCluster, tmp_path: Path) -> None:
    other = LocalCluster(state_dir=tmp_path / "other", node_shape=NodeShape(count=1, gpu_count=0))
    with other:
        assert other.ports is not None and cluster.ports is not None
        assert not set(vars(other.ports).values()) & set(vars(cluster.ports).values())
        assert [n for n in other.kubectl("get", "nodes", "-o", "name").stdout.split()] == ["node/kwok-node-0"]
        pids = _component_pids(other)
        ports = vars(other.ports)
    _assert_all_gone(pids, ports)
    # The session cluster is untouched.
    assert len(cluster.running_components()) == 5


def test_a_restarted_cluster_never_gives_a_new_pod_an_ip_an_old_pod_holds(tmp_path: Path) -> None:
    # kwok keeps its pod-IP pool in memory: after stop/start on the same state dir (`localcluster
    # down` then `up`), pods kept in etcd must not share their IPs with new ones.
    local = LocalCluster(state_dir=tmp_path / "s", node_shape=NodeShape(count=1, gpu_count=0),
                         pod_cidr=pick_unused_pod_cidr())

    def ips() -> list[str]:
        pods = get_json(local.kubectl, "pods", "-A")["items"]
        return [p["status"].get("podIP") for p in pods if p["metadata"]["namespace"] == "default"]

    with local:
        local.kubectl("apply", "-f", "-", input=deployment("before", replicas=3))
        local.kubectl("rollout", "status", "deployment/before", "--timeout=90s", timeout=120)
    with local:
        local.kubectl("apply", "-f", "-", input=deployment("after", replicas=3))
        local.kubectl("rollout", "status", "deployment/after", "--timeout=90s", timeout=120)
        local.kubectl("rollout", "status", "deployment/before", "--timeout=90s", timeout=120)
        found = wait_for(lambda: (lambda got: got if len(got) == 6 and all(got) else None)(ips()),
                         what="6 pods with IPs", timeout_s=90)
        assert len(set(found)) == 6, sorted(found)


def test_cli_up_then_down_from_another_process(tmp_path: Path) -> None:
    state = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(DEV_DIR)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "localcluster", "--state-dir", str(state), *a],  # noqa: E731
                                    env=env, capture_output=True, text=True, timeout=240)
    up = run("up", "--nodes", "1", "--gpu-nodes", "1", "--containers")
    try:
        assert up.returncode == 0, up.stderr
        assert "cluster up in" in up.stdout
        # The CLI process has exited; the components it started keep running.
        assert run("status").returncode == 0
        viewer = LocalCluster(state_dir=state)
        pids = _component_pids(viewer)
        runner = processes.read_pid_file(state / "pids" / "podrunner.pid")
        assert runner is not None and processes.pid_file_alive(state / "pids" / "podrunner.pid")
        pids["podrunner"] = runner
        ports = json.loads((state / "state.json").read_text())["ports"]
        nodes = viewer.kubectl("get", "nodes", "-l", "nvidia.com/gpu.present=true", "-o", "name").stdout.split()
        assert nodes == ["node/kwok-node-0"]
    finally:
        down = run("down")
    assert down.returncode == 0, down.stderr
    assert "kube-apiserver" in down.stdout and "podrunner" in down.stdout
    _assert_all_gone(pids, ports)
    assert run("status").returncode == 1


def test_missing_binary_fails_loudly_naming_it_and_the_setup_command(tmp_path: Path) -> None:
    from localcluster import MissingBinaryError

    with pytest.raises(MissingBinaryError, match=r"etcd.*dev/setup/binaries.sh"):
        LocalCluster(state_dir=tmp_path / "s", bin_directory=tmp_path / "empty-bin").start()
