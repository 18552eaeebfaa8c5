"""Helpers shared by the operator e2e tests (imported by name: no conftest imports, which pytest
cannot tell apart across directories).

The operator under test is the chart's Deployment on the shared dev stack (``stack`` in
tests/e2e/conftest.py): in-cluster from its image, as the chart's ServiceAccount, electing a leader
on the chart's Lease. These helpers find and read it; waits go through ``localcluster.health.wait_for``.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from devstack import RELEASE, RELEASE_NS, Stack
from localcluster.health import wait_for

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"
# <fullname>-operator, where fullname is the release name when it contains the chart's name.
OPERATOR = f"{RELEASE}-operator"
SERVICE_ACCOUNT = OPERATOR
LEASE = "sparsegate-operator"  # values.yaml operator.leaderElection.leaseName
METRICS_PORT, LIVENESS_PORT = 9090, 8081  # values.yaml operator.metrics.port, operator.liveness.port


def get_json(stack: Stack, *args: str) -> dict:
    return json.loads(stack.kubectl("get", *args, "-o", "json").stdout)


def lease_holder(stack: Stack) -> str | None:
    run = stack.kubectl("get", "lease", LEASE, "-n", RELEASE_NS, "-o", "json", check=False)
    return (json.loads(run.stdout).get("spec") or {}).get("holderIdentity") if run.returncode == 0 else None


def pod_ip(pod: dict[str, Any]) -> str:
    return pod["status"]["podIP"]


def http_get(pod: dict[str, Any], port: int, path: str, *, timeout: float = 5) -> tuple[int, str]:
    """GET ``path`` on the pod's IP (pods bind their own loopback IP on the host network)."""
    with urllib.request.urlopen(f"http://{pod_ip(pod)}:{port}{path}", timeout=timeout) as resp:
        return resp.status, resp.read().decode()


def kopf_live(pod: dict[str, Any]) -> bool:
    """Kopf itself answers the pod's liveness endpoint (its probe results, not a standby's reply)."""
    try:
        return json.loads(http_get(pod, LIVENESS_PORT, "/healthz", timeout=2)[1]).get("handlers") == "ok"
    except (OSError, ValueError):
        return False


def leader(stack: Stack, *, timeout_s: float = 90) -> dict[str, Any]:
    """The operator pod that holds the Lease, once it is Ready and Kopf answers its liveness."""
    def probe() -> dict[str, Any] | None:
        holder = lease_holder(stack)
        pod = next((p for p in stack.operator_pods() if p["metadata"]["name"] == holder), None)
        ready = pod is not None and any(c["type"] == "Ready" and c["status"] == "True"
                                        for c in pod["status"].get("conditions") or [])
        return pod if ready and kopf_live(pod) else None
    return wait_for(probe, what="a Ready operator pod holding the Lease, Kopf live", timeout_s=timeout_s,
                    interval_s=0.5)  # type: ignore[return-value]


def operator_restarts(stack: Stack) -> dict[str, int]:
    """``pod/container`` → restartCount for every operator pod (a crash shows up here)."""
    return {f"{p['metadata']['name']}/{c['name']}": c["restartCount"]
            for p in stack.operator_pods() for c in p["status"].get("containerStatuses") or []}
