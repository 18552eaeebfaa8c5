"""A flow allow-list larger than the capacity: a PolicyTooLarge condition, not a silent freeze.

Given the session's real control plane (kwok gives pods IPs), a real OPA server and the operator
itself (``sparsegate.cli run`` on the host) with a deliberately small map capacity
(``SPARSEGATE_FLOW_POLICY_MAX_RECORDS=6``, documented in ``domain.policy_capacity``): a policy that
fits is published; when more callers make the allow-list outgrow the capacity, the operator keeps
the last allow-list that fit and every RoutingPolicy says Ready=False / Stalled=True reason
PolicyTooLarge with needed vs capacity; when callers go again, the new allow-list is published.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from localcluster import LocalCluster
from localcluster.health import wait_for

from sparsegate_contracts import flowpolicy
from sparsegate_contracts.flowpolicy import ip_entries

pytestmark = pytest.mark.opa
REPO = Path(__file__).resolve().parents[3]
FLOW_POLICY = "sparsegate-flow-policy"
CAPACITY = 6


def _pod(name: str, *, sa: str = "default", labels: dict | None = None, port: int | None = None) -> str:
    container: dict = {"name": "app", "image": "registry.invalid/app:1"}
    if port:
        container["ports"] = [{"name": "http", "containerPort": port}]
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
                       "spec": {"serviceAccountName": sa, "containers": [container]}})


@pytest.fixture
def operator_process(cluster: LocalCluster, namespace: str, opa_server, tmp_path: Path) -> Iterator[Path]:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "charts" / "sparsegate" / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(cluster.kubeconfig), SPARSEGATE_NAMESPACE=namespace, SPARSEGATE_OPA_URL=opa_server.url,
               SPARSEGATE_POLICY_RESYNC_SECONDS="1", SPARSEGATE_FLOW_POLICY_MAX_RECORDS=str(CAPACITY),
               PYTHONUNBUFFERED="1")
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sparsegate.cli", "run", "--standalone", "--namespace", namespace,
                                 "--log-format", "plain"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_allow_list_over_capacity_sets_policy_too_large(cluster: LocalCluster, namespace: str,
                                                         operator_process: Path) -> None:
    ns, kubectl = namespace, cluster.kubectl

    def get(kind: str, name: str) -> dict:
        return json.loads(kubectl("get", kind, name, "-n", ns, "-o", "json").stdout)

    def conditions() -> dict:
        conds = (get("routingpolicy", "allow-frontend").get("status") or {}).get("conditions") or []
        return {c["type"]: c for c in conds}

    def allow_list() -> dict | None:
        run = kubectl("get", "configmap", FLOW_POLICY, "-n", ns, "-o", "json", check=False)
        return json.loads(json.loads(run.stdout)["data"]["policy.json"]) if run.returncode == 0 else None

    def ip(name: str) -> str:
        return wait_for(lambda: get("pod", name).get("status", {}).get("podIP"), what=f"{name} IP")  # type: ignore[return-value]

    try:
        # Given two pods of SparseModel mixtral and one caller, allowed on 8080: 1 identity rule + 2
        # policed destinations + 1 source address = 4 records, within the capacity of 6
        kubectl("create", "serviceaccount", "frontend", "-n", ns)
        for name in ("mixtral-0", "mixtral-1"):
            kubectl("apply", "-n", ns, "-f", "-",
                    input=_pod(name, labels={"sparsegate.dev/model": "mixtral"}, port=8080))
        kubectl("apply", "-n", ns, "-f", "-", input=_pod("fe-0", sa="frontend"))
        ips = {name: ip(name) for name in ("mixtral-0", "mixtral-1", "fe-0")}
        kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({
            "apiVersion": "sparsegate.dev/v1alpha1", "kind": "RoutingPolicy", "metadata": {"name": "allow-frontend"},
            "spec": {"action": "Allow", "sources": [{"serviceAccount": "frontend"}],
                     "targets": [{"sparseModel": "mixtral"}], "ports": [{"port": 8080}]}}))
        wait_for(lambda: conditions().get("Ready", {}).get("status") == "True", what="Ready", timeout_s=90,
                 interval_s=0.5)
        published = wait_for(lambda: (d := allow_list()) and len(ip_entries(d)) == 2 and d, what="2 IP pairs")
        assert {e["srcIP"] for e in ip_entries(published)} == {ips["fe-0"]}  # type: ignore[arg-type]

        # When three more callers join (same class: still 1 rule): + 3 source addresses = 7 records > 6
        for i in (1, 2, 3):
            kubectl("apply", "-n", ns, "-f", "-", input=_pod(f"fe-{i}", sa="frontend"))
        for i in (1, 2, 3):
            ip(f"fe-{i}")
        # Then the policy says so with the numbers, rather than Ready over a frozen allow-list
        wait_for(lambda: conditions().get("Ready", {}).get("reason") == "PolicyTooLarge", what="PolicyTooLarge",
                 timeout_s=60, interval_s=0.5)
        c = conditions()
        assert c["Ready"]["status"] == "False" and c["Stalled"]["status"] == "True"
        assert c["Stalled"]["reason"] == "PolicyTooLarge" and c["Degraded"]["status"] == "True"
        assert f"needs 7 policy map records, capacity {CAPACITY}" in c["Ready"]["message"]
        # and the published allow-list is the last one that fit (the callers get their IPs one by
        # one: with 2 or 3 callers it still fits), never a truncated or oversized one
        now = allow_list()
        assert now is not None and flowpolicy.map_records(now) <= CAPACITY, now
        callers = {e["srcIP"] for e in ip_entries(now)}
        assert ips["fe-0"] in callers and len(callers) < 4, now

        # When the extra callers go: the allow-list fits again, is published and the policy is Ready
        kubectl("delete", "pod", "fe-1", "fe-2", "fe-3", "-n", ns, "--grace-period=0", "--force")
        wait_for(lambda: conditions().get("Ready", {}).get("status") == "True", what="Ready again", timeout_s=60,
                 interval_s=0.5)
        assert conditions()["Stalled"]["status"] == "False"
        final = allow_list()
        assert final is not None and ip_entries(final) == ip_entries(published)  # type: ignore[arg-type]
        assert final["policedDestinations"] == published["policedDestinations"]  # type: ignore[index]
    except BaseException:
        sys.stderr.write(operator_process.read_text(errors="replace")[-6000:])
        raise
