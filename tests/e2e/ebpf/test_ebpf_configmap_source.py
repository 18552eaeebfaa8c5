"""The agent's ConfigMap policy source against the real local kube-apiserver (watch, not poll)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policysource import POLICY_KEY, watch_configmap

CRDS = Path(__file__).resolve().parents[3] / "charts" / "sparsegate" / "crds"


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


def test_deleted_routing_policy_loses_its_allow_entries_without_the_operator(cluster, kube_api_client,
                                                                            namespace: str) -> None:
    """No operator runs here at all: the agent's own RoutingPolicy watch drops the deleted policy's access."""
    from kubernetes import client

    from sparsegate_ebpf.policysource import LivePolicyFilter, watch_routing_policies

    cluster.kubectl("apply", "-f", str(CRDS / "routingpolicies.yaml"))
    custom = client.CustomObjectsApi(kube_api_client)
    for name in ("keep", "gone"):
        policy = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "RoutingPolicy", "metadata": {"name": name},
                  "spec": {"action": "Allow", "sources": [{"namespace": namespace, "serviceAccount": "default"}],
                           "targets": [{"sparseModel": "m"}], "ports": [{"port": 8080}]}}
        _wait_created(lambda: custom.create_namespaced_custom_object("sparsegate.dev", "v1alpha1", namespace,
                                                                     "routingpolicies", policy))
    published = json.dumps({"defaultAction": "deny", "entries": [
        {"srcIP": "10.0.0.1", "dstIP": "10.0.0.9", "dstPort": 8080, "protocol": "tcp", "action": "allow",
         "rule": f"{namespace}/keep#0"},
        {"srcIP": "10.0.0.2", "dstIP": "10.0.0.9", "dstPort": 8080, "protocol": "tcp", "action": "allow",
         "rule": f"{namespace}/gone#0"}]})
    client.CoreV1Api(kube_api_client).create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="sparsegate-flow-policy"), data={POLICY_KEY: published}))

    seen: list[str] = []
    live_filter = LivePolicyFilter(seen.append)
    stop = threading.Event()
    threads = [
        threading.Thread(target=watch_configmap, daemon=True, kwargs={
            "namespace": namespace, "name": "sparsegate-flow-policy", "on_document": live_filter.document,
            "stop": stop, "api_client": kube_api_client}),
        threading.Thread(target=watch_routing_policies, daemon=True, kwargs={
            "on_policies": live_filter.policies, "stop": stop, "namespaces": [namespace],
            "api_client": kube_api_client})]
    for t in threads:
        t.start()
    try:
        def allowed_rules() -> list[str]:
            return [e.rule for e in parse_policy(seen[-1]).entries if e.action == "allow"] if seen else []

        _wait(lambda: allowed_rules() == [f"{namespace}/keep#0", f"{namespace}/gone#0"], "both policies enforced")
        t0 = time.monotonic()
        custom.delete_namespaced_custom_object("sparsegate.dev", "v1alpha1", namespace, "routingpolicies", "gone")
        # No finalizer holds the deletion (no operator runs), and the agent narrows within the watch latency.
        _wait(lambda: allowed_rules() == [f"{namespace}/keep#0"], "the deleted policy's entries dropped", timeout=10)
        print(f"\n[liveness] deleted policy's allow entries dropped by the agent in {time.monotonic() - t0:.2f}s")
        assert live_filter.dropped_entries == 1
    finally:
        stop.set()


def _wait_created(create) -> None:
    """The CRD may take a moment to be served after `kubectl apply`."""
    from kubernetes.client import ApiException

    deadline = time.monotonic() + 30
    while True:
        try:
            create()
            return
        except ApiException as e:
            if e.status != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _identity_doc(port: int, callers: int) -> dict:
    from sparsegate_contracts import flowpolicy

    ids = [{"identity": 256, "ips": ["10.0.0.9", "fd00::9"]},
           {"identity": 257, "ips": [f"10.1.{j // 256}.{j % 256}" for j in range(callers)]}]
    rules = [{"srcIdentity": 257, "dstIdentity": 256, "dstPort": port, "protocol": "tcp", "action": "allow",
              "rule": "models/p#0"}]
    return flowpolicy.build_document(rules=rules, identities=ids, allowed_sources=["10.9.0.1"])


def test_sharded_policy_published_by_the_operator_reaches_the_agent_whole(kube_api_client, namespace: str) -> None:
    """The operator's publisher shards a large document (ConfigMaps lowered to 4 KiB by
    SPARSEGATE_FLOW_POLICY_MAX_BYTES), the agent's source rebuilds it; a half-updated set (a shard
    rewritten, its head not) is not forwarded; the API server sees the shards written before the head
    and the stale shards emptied after it; a small document goes back to one ConfigMap."""
    import asyncio

    from kubernetes import client, watch

    from sparsegate.clients.flow_policy import FlowPolicyConfigMap
    from sparsegate.domain.policy_capacity import MAX_BYTES_ENV, Capacity
    from sparsegate_contracts import flowpolicy_shards

    api = client.CoreV1Api(kube_api_client)
    max_bytes = Capacity.from_env({MAX_BYTES_ENV: "4096"}).max_bytes
    store = FlowPolicyConfigMap(namespace=namespace, max_bytes=max_bytes, api_client=kube_api_client)
    v1, v2, small = _identity_doc(8080, 1200), _identity_doc(9090, 400), _identity_doc(7070, 3)
    seen: list[str] = []
    stop = threading.Event()
    t = threading.Thread(target=watch_configmap, daemon=True, kwargs={
        "namespace": namespace, "name": "sparsegate-flow-policy", "on_document": seen.append, "stop": stop,
        "api_client": kube_api_client})

    def shard_data(name: str) -> dict:
        return api.read_namespaced_config_map(name, namespace).data or {}

    try:
        asyncio.run(store.publish(v1))
        assert len(store.shards) > 2, store.shards
        t.start()
        _wait(lambda: len(seen) >= 1, "the sharded document")
        policy = parse_policy(seen[0])
        assert policy.version == v1["version"] and len(dict(policy.identities)[257]) == 1200
        assert flowpolicy_shards.is_head(json.loads(api.read_namespaced_config_map(
            "sparsegate-flow-policy", namespace).data[POLICY_KEY]))
        assert all(len(text.encode()) <= 4096 for name in store.shards for text in shard_data(name).values())

        # Half-updated: shard 0 already holds v2's first slice, the head still names v1's digests.
        v2_layout = flowpolicy_shards.split(v2, max_bytes=max_bytes)
        first_name, first_text = v2_layout.shards[0]
        api.patch_namespaced_config_map(first_name, namespace, {"data": {flowpolicy_shards.SHARD_KEY: first_text}})
        api.patch_namespaced_config_map("sparsegate-flow-policy", namespace,
                                        {"metadata": {"labels": {"touched": "yes"}}})  # the agent re-reads the set
        time.sleep(2.5)
        assert len(seen) == 1, "a half-updated set must not reach the agent"

        v1_shards = list(store.shards)
        # The API server's own order of writes (resourceVersion order of one watch): shards, head, clears.
        since = api.list_namespaced_config_map(namespace).metadata.resource_version
        asyncio.run(store.publish(v2))
        writes: list[tuple[str, dict]] = []
        w = watch.Watch()
        for event in w.stream(api.list_namespaced_config_map, namespace, resource_version=since,
                              timeout_seconds=10):
            writes.append((event["object"].metadata.name, event["object"].data or {}))
            if len(writes) == len(v1_shards) + 1:
                w.stop()
        head_at = [name for name, _ in writes].index("sparsegate-flow-policy")
        assert sorted(name for name, _ in writes[:head_at]) == sorted(store.shards)
        assert all(data == {} for _, data in writes[head_at + 1:])
        assert sorted(name for name, _ in writes[head_at + 1:]) == sorted(set(v1_shards) - set(store.shards))
        _wait(lambda: len(seen) >= 2, "the v2 document")
        assert parse_policy(seen[-1]).version == v2["version"] and parse_policy(seen[-1]).rules[0].dst_port == 9090
        assert len(store.shards) < len(v1_shards)
        for name in v1_shards[len(store.shards):]:
            assert shard_data(name) == {}, f"stale shard {name} emptied"

        asyncio.run(store.publish(small))
        _wait(lambda: len(seen) >= 3, "the small document")
        head_text = api.read_namespaced_config_map("sparsegate-flow-policy", namespace).data[POLICY_KEY]
        assert head_text == seen[-1] and json.loads(head_text)["version"] == small["version"]  # single layout
        assert all(shard_data(name) == {} for name in v1_shards)
        # The operator reads back what it published, in either layout.
        assert asyncio.run(store.read()) == small
        asyncio.run(store.publish(v1))
        assert asyncio.run(FlowPolicyConfigMap(namespace=namespace, max_bytes=max_bytes,
                                               api_client=kube_api_client).read()) == v1
    finally:
        stop.set()
