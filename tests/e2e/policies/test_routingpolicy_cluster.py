"""RoutingPolicy end to end: kubectl → operator → real OPA → allow-list ConfigMap; OPA killed → fail
closed; OPA back → resync without re-applying.

Given the real local control plane (kwok pods with loopback IPs), a real `opa run --server` and the
operator (`sparsegate run`) serving two namespaces: `models` (the policy, the SparseModel pods and
the published allow-list) and `web` (the callers).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from localcluster import processes
from sparsegate.clients.opa import RoutingOpa
from sparsegate_ebpf.policy import parse_policy
from localcluster.health import wait_for

REPO = Path(__file__).resolve().parents[3]
RESYNC_S = 1



def pod(name: str, *, sa: str = "default", labels: dict | None = None, port: int | None = None) -> dict:
    container: dict = {"name": "app", "image": "registry.invalid/app:1"}
    if port:
        container["ports"] = [{"name": "http", "containerPort": port}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"serviceAccountName": sa, "containers": [container]}}


def routing_policy(name: str, spec: dict) -> str:
    return json.dumps({"apiVersion": "sparsegate.dev/v1alpha1", "kind": "RoutingPolicy",
                       "metadata": {"name": name}, "spec": spec})


@pytest.fixture
def web_namespace(kubectl) -> Iterator[str]:
    name = f"e2e-web-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    wait_for(lambda: kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             what="default ServiceAccount")
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def operator(cluster, namespace: str, web_namespace: str, opa_server, tmp_path: Path) -> Iterator[Path]:
    """`sparsegate run` for the two namespaces, the allow-list published in `namespace`."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "charts" / "sparsegate" / "crds"))
    for crd in ("routingpolicies", "sparsemodels", "gateconfigs"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}.sparsegate.dev", "--timeout=60s")
    log = tmp_path / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "SPARSEGATE_OPA_URL": opa_server.url,
           "SPARSEGATE_NAMESPACE": namespace, "SPARSEGATE_POLICY_RESYNC_SECONDS": str(RESYNC_S)}
    argv = [sys.executable, "-m", "sparsegate.cli", "run", "--standalone", "-n", namespace, "-n", web_namespace]
    proc = processes.start(name="operator", argv=argv, log_path=log, pid_file=tmp_path / "operator.pid", env=env,
                           die_with_parent=True)
    try:
        yield log
    finally:
        processes.stop_from_pid_file(tmp_path / "operator.pid", grace_s=10, popen=proc)
        sys.stderr.write(f"[e2e] operator log tail:\n{log.read_text()[-3000:]}\n")


def test_routing_policy_end_to_end(kubectl, namespace: str, web_namespace: str, opa_server, operator: Path) -> None:
    models, web = namespace, web_namespace

    def get(kind: str, name: str, ns: str = models) -> dict:
        return json.loads(kubectl("get", kind, name, "-n", ns, "-o", "json").stdout)

    def condition(name: str, type_: str) -> str | None:
        conds = (get("routingpolicy", name).get("status") or {}).get("conditions") or []
        return next((c["status"] for c in conds if c["type"] == type_), None)

    def allow_list() -> dict | None:
        run = kubectl("get", "configmap", "sparsegate-flow-policy", "-n", models, "-o", "json", check=False)
        return json.loads(json.loads(run.stdout)["data"]["policy.json"]) if run.returncode == 0 else None

    def opa(call: str, *args: object) -> object:
        async def go() -> object:
            client = RoutingOpa(url=opa_server.url)
            try:
                return await getattr(client, call)(*args)
            finally:
                client.close()
        return asyncio.run(go())

    # Given a fresh operator: it publishes a deny-all allow-list before any policy exists
    empty = wait_for(allow_list, what="initial allow-list")
    assert empty["defaultAction"] == "deny" and empty["entries"] == []

    # And callers in `web` and two pods of SparseModel `mixtral` in `models`, all with pod IPs
    kubectl("create", "serviceaccount", "frontend", "-n", web)
    for p, ns in [(pod("fe-0", sa="frontend", labels={"app": "fe"}), web), (pod("other-0"), web),
                  (pod("mixtral-0", labels={"sparsegate.dev/model": "mixtral"}, port=8080), models),
                  (pod("mixtral-1", labels={"sparsegate.dev/model": "mixtral"}, port=8080), models)]:
        kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(p))
    ip: dict[str, str] = {}
    for name, ns in [("fe-0", web), ("other-0", web), ("mixtral-0", models), ("mixtral-1", models)]:
        ip[name] = wait_for(lambda: get("pod", name, ns).get("status", {}).get("podIP"), what=f"{name} IP")

    # When a RoutingPolicy allows web/frontend to reach mixtral on 8080
    kubectl("apply", "-n", models, "-f", "-", input=routing_policy("allow-frontend", {
        "action": "Allow", "priority": 10, "sources": [{"namespace": web, "serviceAccount": "frontend"}],
        "targets": [{"sparseModel": "mixtral"}], "ports": [{"port": 8080}]}))

    # Then OPA holds it, its status says so, and the allow-list has exactly fe-0 → both pods
    status = wait_for(lambda: (s := get("routingpolicy", "allow-frontend").get("status") or {}).get("loadedInOPA")
                      and s.get("decisionCount") == 2 and s, what="loadedInOPA and 2 decisions")
    ready = next((c["status"] for c in status.get("conditions", []) if c["type"] == "Ready"), None)
    assert status["observedGeneration"] == 1 and ready == "True", status
    assert opa("loaded_policies")[f"{models}/allow-frontend"] == {"generation": 1, "rules": 1}
    decision = opa("decide", {"source": {"spiffeID": f"spiffe://cluster.local/ns/{web}/sa/frontend"},
                              "target": {"namespace": models, "sparseModel": "mixtral", "port": 8080}})
    assert decision["allow"] and decision["rule"] == f"{models}/allow-frontend#s0t0"
    doc = wait_for(allow_list, what="allow-list ConfigMap")
    assert doc["defaultAction"] == "deny" and parse_policy(doc).version == doc["version"]  # the agent accepts it
    assert {(e["srcIP"], e["dstIP"], e["dstPort"], e["action"]) for e in doc["entries"]} == {
        (ip["fe-0"], ip["mixtral-0"], 8080, "allow"), (ip["fe-0"], ip["mixtral-1"], 8080, "allow")}
    printed = kubectl("get", "routingpolicies", "-n", models).stdout
    assert "allow-frontend" in printed and "Allow" in printed and "true" in printed  # printer columns

    # And the API server refuses malformed policies with messages that name the field
    bad = kubectl("apply", "-n", models, "-f", "-", check=False, input=routing_policy("bad", {
        "action": "Allow", "sources": [{"spiffeID": "spiffe://cluster.local/ns/a/sa/b", "namespace": "a"}],
        "targets": [{"sparseModel": "mixtral"}], "ports": [{"port": 0}]}))
    assert bad.returncode != 0
    assert "sources[].spiffeID cannot be combined" in bad.stderr and "ports[].port must be between" in bad.stderr

    # When OPA dies and a wider policy (all of web → mixtral) arrives meanwhile
    opa_server.stop()
    kubectl("apply", "-n", models, "-f", "-", input=routing_policy("allow-web", {
        "action": "Allow", "sources": [{"namespace": web}], "targets": [{"sparseModel": "*"}]}))
    # Then both policies turn Degraded and the published allow-list stays exactly as it was
    wait_for(lambda: condition("allow-frontend", "Degraded") == "True" and condition("allow-web", "Degraded") == "True",
             what="Degraded=True on both policies")
    assert condition("allow-web", "Ready") == "False"
    time.sleep(3 * RESYNC_S)
    assert allow_list() == doc

    # When OPA comes back empty (a restart), nobody re-applies anything
    opa_server.start()
    # Then the operator pushes everything again and publishes the decisions of both policies
    wait_for(lambda: condition("allow-web", "Ready") == "True" and condition("allow-frontend", "Ready") == "True"
             and condition("allow-web", "Degraded") == "False", what="Ready again after OPA restart", timeout_s=90)
    assert set(opa("loaded_policies")) == {f"{models}/allow-frontend", f"{models}/allow-web"}
    widened = wait_for(lambda: (d := allow_list()) and len(d["entries"]) == 4 and d, what="4 entries")
    assert {(e["srcIP"], e["dstIP"]) for e in widened["entries"]} == {
        (src, dst) for src in (ip["fe-0"], ip["other-0"]) for dst in (ip["mixtral-0"], ip["mixtral-1"])}

    # When the wide policy is deleted, OPA drops it and its entries go
    kubectl("delete", "routingpolicy", "allow-web", "-n", models, "--timeout=60s", timeout=90)
    assert set(opa("loaded_policies")) == {f"{models}/allow-frontend"}
    final = wait_for(lambda: (d := allow_list()) and len(d["entries"]) == 2 and d, what="2 entries")
    assert {e["srcIP"] for e in final["entries"]} == {ip["fe-0"]}

    # When the last policy goes, nothing is allowed any more (and no finalizer is left behind)
    kubectl("delete", "routingpolicy", "allow-frontend", "-n", models, "--timeout=60s", timeout=90)
    assert opa("loaded_policies") == {}
    wait_for(lambda: (d := allow_list()) is not None and d["entries"] == [], what="empty allow-list")
