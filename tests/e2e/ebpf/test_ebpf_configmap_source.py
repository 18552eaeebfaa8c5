"""The agent's ConfigMap policy source against the real local kube-apiserver (watch, not poll)."""
from __future__ import annotations

import json
import threading
import time

from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policysource import POLICY_KEY, watch_configmap


def doc(version: str, port: int) -> str:
    return json.dumps({"version": version, "defaultAction": "deny", "entries": [
        {"srcIP": "10.0.0.1", "dstIP": "10.0.0.2", "dstPort": port, "protocol": "tcp", "action": "allow",
         "rule": "ns/p#0"}]})


def test_configmap_watch_delivers_created_and_updated_documents(kube_api_client, namespace: str) -> None:
    from kubernetes import client

    api = client.CoreV1Api(kube_api_client)
    seen: list[str] = []
    stop = threading.Event()
    t = threading.Thread(target=watch_configmap, daemon=True, kwargs={
        "namespace": namespace, "name": "sparsegate-flow-policy", "on_document": seen.append, "stop": stop,
        "api_client": kube_api_client})
    t.start()
    try:
        time.sleep(0.5)  # not created yet: the source retries with backoff
        body = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="sparsegate-flow-policy"),
                                  data={POLICY_KEY: doc("v1", 8080)})
        api.create_namespaced_config_map(namespace, body)
        _wait(lambda: len(seen) >= 1, "first document")
        api.patch_namespaced_config_map("sparsegate-flow-policy", namespace, {"metadata": {"labels": {"x": "y"}}})
        api.patch_namespaced_config_map("sparsegate-flow-policy", namespace, {"data": {POLICY_KEY: doc("v2", 9090)}})
        _wait(lambda: len(seen) >= 2, "updated document")
        time.sleep(0.5)
    finally:
        stop.set()
    # The label-only change did not re-emit the same content.
    assert [parse_policy(s).version for s in seen] == ["v1", "v2"]
    assert parse_policy(seen[1]).entries[0].dst_port == 9090


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
