"""The chart's Roles, applied to the real API server, are enough for a sharded flow policy and no more:
the operator's ServiceAccount publishes head + shards and empties stale shards, the agent's
ServiceAccount rebuilds the policy from them, and neither reads a ConfigMap it is not granted."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))


def chart_roles(namespace: str) -> dict[str, dict]:
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    proc = subprocess.run([str(exe), "template", "rel", str(CHART), "--namespace", namespace,
                           "--set", "agent.enabled=true"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(proc.stdout)
            if d and d["kind"] == "Role" and d["metadata"].get("namespace") == namespace}


def as_service_account(cluster, namespace: str, name: str):  # -> kubernetes.client.ApiClient
    from kubernetes import config as kube_config

    api_client = kube_config.new_client_from_config(config_file=str(cluster.kubeconfig))
    api_client.set_default_header("Impersonate-User", f"system:serviceaccount:{namespace}:{name}")
    return api_client


def test_chart_roles_let_operator_publish_and_agent_read_shards(cluster, kube_api_client, namespace: str) -> None:
    from kubernetes import client

    from sparsegate.clients.flow_policy import FlowPolicyConfigMap
    from sparsegate_contracts import flowpolicy
    from sparsegate_ebpf.policy import parse_policy
    from sparsegate_ebpf.policysource import watch_configmap

    rbac = client.RbacAuthorizationV1Api(kube_api_client)
    core = client.CoreV1Api(kube_api_client)
    roles = chart_roles(namespace)
    for role, sa in (("rel-sparsegate-agent", "agent"), ("rel-sparsegate-operator-release", "operator")):
        body = roles[role]
        body["metadata"].pop("labels", None)
        rbac.create_namespaced_role(namespace, body)
        rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": role}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                     "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "other"}, "data": {"x": "y"}})
    operator_api = as_service_account(cluster, namespace, "operator")
    agent_api = as_service_account(cluster, namespace, "agent")

    ids = [{"identity": 256, "ips": ["10.0.0.9"]},
           {"identity": 257, "ips": [f"10.1.{j // 256}.{j % 256}" for j in range(1200)]}]
    rules = [{"srcIdentity": 257, "dstIdentity": 256, "dstPort": 8080, "protocol": "tcp", "action": "allow",
              "rule": "models/p#0"}]
    big = flowpolicy.build_document(rules=rules, identities=ids)
    small = flowpolicy.build_document(rules=rules, identities=[ids[0], {"identity": 257, "ips": ["10.1.0.1"]}])
    store = FlowPolicyConfigMap(namespace=namespace, max_bytes=4096, api_client=operator_api)
    deadline = time.monotonic() + 30
    while True:  # RBAC caches may take a moment to see the new bindings
        try:
            asyncio.run(store.publish(big))
            break
        except client.ApiException as e:
            if e.status != 403 or time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    assert len(store.shards) >= 3

    seen: list[str] = []
    stop = threading.Event()
    t = threading.Thread(target=watch_configmap, daemon=True, kwargs={
        "namespace": namespace, "name": flowpolicy.CONFIGMAP_NAME, "on_document": seen.append, "stop": stop,
        "api_client": agent_api})
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not seen:
            assert time.monotonic() < deadline, "the agent's ServiceAccount never rebuilt the sharded policy"
            time.sleep(0.1)
        assert parse_policy(seen[0]).version == big["version"]
        shards = list(store.shards)
        asyncio.run(store.publish(small))  # back to one ConfigMap: the operator empties its shards
        assert all((core.read_namespaced_config_map(n, namespace).data or {}) == {} for n in shards)
        while len(seen) < 2:
            assert time.monotonic() < deadline, "the small document never reached the agent"
            time.sleep(0.1)
        assert json.loads(seen[-1])["version"] == small["version"]
    finally:
        stop.set()
    # Least privilege: neither reads a ConfigMap outside its names, the operator deletes nothing.
    for api_client in (agent_api, operator_api):
        with pytest.raises(client.ApiException) as denied:
            client.CoreV1Api(api_client).read_namespaced_config_map("other", namespace)
        assert denied.value.status == 403
    with pytest.raises(client.ApiException) as denied:
        client.CoreV1Api(operator_api).delete_namespaced_config_map(shards[0], namespace)
    assert denied.value.status == 403
    with pytest.raises(client.ApiException) as denied:
        client.CoreV1Api(agent_api).read_namespaced_config_map(f"{flowpolicy.CONFIGMAP_NAME}-16", namespace)
    assert denied.value.status == 403
