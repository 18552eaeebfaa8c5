"""Helpers for the rollout e2e tests (a module of its own: test files cannot import conftest by
name, pytest cannot tell the conftests of different directories apart).

The operator here is the chart's, running in-cluster from its image (Deployment
``sparsegate-operator`` in ``sparsegate-system``, container ``operator``, OPA as its sidecar) on the
dev stack (``dev/devstack.py``); :class:`Operator` reads and crashes it the way a cluster user
would: logs of the container, metrics at the pod IP, SIGKILL to the container (the pod runner
restarts it, as a kubelet does).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from devstack import Stack
from loadgen import BackgroundLoad
from localcluster import podman
from localcluster.health import wait_for

REPO = Path(__file__).resolve().parents[3]
NAMESPACE = "rollout"  # the one namespace the operator serves here (chart operator.watchNamespaces)
MODEL = "rollout-m"
GATE = "gate"
REPLICAS = 10  # 5 % → 1 pod, 20 % → 2 pods, 100 % → 10 (each server holds ~320 MB)
QPS = 50.0
ANALYSIS_INTERVAL = "4s"
METRICS_PORT = 9090  # the chart's operator.metrics.port, bound on the pod IP

# The fleet's p99 SLA and the latency a "slow" bad change adds. Ten model servers, the control plane and
# the load generator share two cores: a good change's p99 reached 913 ms in CI (the histogram's
# 0.5-1 s bucket), so 800 ms judged the machine, not the change. The injected latency stays well above
# the SLA (it lands in the 2.5-5 s bucket), so the latency rollback still has one cause only.
SLA_P99_MS = 2500
ADDED_LATENCY_MS = 4000

BASE_PARAMS = {"toolGateThreshold": 0.85, "entropyBeta": 0.1, "confidenceThreshold": 0.6,
               "capacityFactor": 1.25, "minExpertsPerToken": 1, "maxExpertsPerToken": 4,
               "precisionPolicy": "auto"}


def _operator_container(pod: dict) -> dict:
    return next((c for c in (pod.get("status") or {}).get("containerStatuses") or [] if c["name"] == "operator"), {})


@dataclass
class Operator:
    """The in-cluster operator: kill() is a crash (SIGKILL to its container), wait_restarted() waits
    for the fresh process the pod runner starts in its place."""

    stack: Stack
    # Restarts of the operator container accounted for: those before the tests began, plus one per
    # kill(). Any other restart (a crash of its own, a failed liveness probe) fails the waits.
    expected_restarts: int = 0
    restarts_at_kill: int = 0

    def pod(self) -> dict:
        """The Ready operator pod (waits for one)."""
        return self.stack.wait_operator_ready()

    def restart_count(self) -> int:
        return sum(_operator_container(p).get("restartCount", 0) for p in self.stack.operator_pods())

    def kill(self) -> None:
        """A crash: SIGKILL to the operator container, no chance to clean up; returns once it is dead."""
        pod = self.pod()
        name = self.stack.container_name(pod, "operator")
        started = self._state(name).get("StartedAt")
        self.restarts_at_kill = _operator_container(pod).get("restartCount", 0)
        self.expected_restarts += 1
        self.stack.kill_container(pod, "operator")
        # Dead (or already started again by the runner, which restarts a long-lived container at once).
        def dead_or_restarted() -> bool:
            state = self._state(name)
            return state.get("StartedAt") != started or not state.get("Running")

        wait_for(dead_or_restarted, what="the operator container to die", timeout_s=30, interval_s=0.1)

    def wait_restarted(self, timeout_s: float = 120) -> dict:
        """The pod runner restarted the killed container (restartCount up, exit 137) and the new
        process serves its metrics; returns the container's status."""
        def restarted() -> dict | None:
            for p in self.stack.operator_pods():
                c = _operator_container(p)
                if c.get("restartCount", 0) > self.restarts_at_kill and c.get("ready"):
                    return c
            return None

        try:
            status: dict = wait_for(restarted, what="the operator container restarted by the pod runner",  # type: ignore[assignment]
                                    timeout_s=timeout_s, interval_s=0.5)
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{self.stack.diagnose()}")
        assert status["lastState"]["terminated"]["exitCode"] == 137, status
        wait_for(self._metrics_up, what="the restarted operator's metrics", timeout_s=60, interval_s=0.3)
        return status

    def _metrics_up(self) -> bool:
        try:
            self.metrics()
            return True
        except OSError:
            return False

    @staticmethod
    def _state(name: str) -> dict:
        """podman's State of one container ({} when there is none)."""
        proc = podman.podman("inspect", "--format", "{{json .State}}", name, check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else {}

    def unexpected_restarts(self) -> int:
        """Restarts of the operator container that no kill() of this module caused."""
        return self.restart_count() - self.expected_restarts

    def metrics(self) -> str:
        ip = self.pod()["status"]["podIP"]
        with urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Value of one sample of the operator's own /metrics (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.metrics()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def tail(self, n: int = 60) -> str:
        pods = self.stack.operator_pods()
        if not pods:
            return "(no operator pod)"
        return self.stack.logs(pods[0], "operator", n) or "(no operator log)"


@dataclass
class Fleet:
    stack: Stack
    namespace: str
    operator: Operator
    load: BackgroundLoad | None = None

    @property
    def cluster(self) -> Any:
        """The stack's LocalCluster (``kubectl``)."""
        return self.stack.cluster

    # ---------------------------------------------------------------- reading
    def get(self, *args: str) -> dict:
        return json.loads(self.cluster.kubectl("get", *args, "-n", self.namespace, "-o", "json").stdout)

    def gateconfig(self) -> dict:
        return self.get("gateconfig", GATE)

    def rollout(self) -> dict:
        return (self.gateconfig().get("status") or {}).get("rollout") or {}

    def stable_version(self) -> str:
        return self.gateconfig()["status"]["stable"]["version"]

    def pods(self) -> list[dict]:
        items = self.get("pods", "-l", f"sparsegate.dev/model={MODEL}")["items"]
        return [p for p in items if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")]

    def targets(self) -> list[str]:
        return [f"{p['status']['podIP']}:8080" for p in self.pods()]

    def pod_versions(self) -> dict[str, str | None]:
        """What every pod's /healthz says right now (None: no answer)."""
        out: dict[str, str | None] = {}
        for p in self.pods():
            try:
                with urllib.request.urlopen(f"http://{p['status']['podIP']}:8080/healthz", timeout=3) as resp:
                    out[p["metadata"]["name"]] = json.loads(resp.read())["gateVersion"]
            except OSError:
                out[p["metadata"]["name"]] = None
        return out

    def wait_serving(self, replicas: int, what: str, timeout_s: float = 300) -> None:
        """Waits until `replicas` pods are Ready (the pod runner's readiness probe, /readyz: the model
        is built) and answer /healthz with a gate version (/healthz alone answers while the model
        still loads); fails the test with the stack's diagnosis otherwise."""
        def all_serving() -> bool:
            pods = self.pods()
            ready = len(pods) == replicas and all(
                any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
                for p in pods)
            versions = self.pod_versions() if ready else {}
            return ready and len(versions) == replicas and all(versions.values())

        try:
            wait_for(all_serving, what=what, timeout_s=timeout_s, interval_s=1.0)
        except AssertionError as exc:
            pytest.fail(f"{exc}\n{self.stack.diagnose()}")

    def check_pods_are_ours(self) -> None:
        """Each pod IP must be served by this cluster's server: a GET /admin/gate over TLS that
        trusts only this model's certificate (from Secret <model>-admin) and sends its token.

        Another local cluster on this machine with the same pod CIDR can own a pod's IP:port
        (its server answers /healthz, but holds another certificate and token). Fail clearly
        instead of timing out.
        """
        import asyncio
        import base64

        import aiohttp

        from sparsegate.clients.admin_credentials import client_context
        from sparsegate_contracts import names

        data = {k: base64.b64decode(v).decode() for k, v in self.get("secret", f"{MODEL}-admin")["data"].items()}
        ctx = client_context(data[names.ADMIN_TLS_CERT_KEY])
        server_name = names.admin_server_name(model=MODEL, namespace=NAMESPACE)

        async def check(ip: str) -> int:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
                async with session.get(f"https://{ip}:{names.DEFAULT_ADMIN_PORT}/admin/gate", ssl=ctx,
                                       server_hostname=server_name, timeout=aiohttp.ClientTimeout(total=5),
                                       headers={"Authorization": f"Bearer {data[names.ADMIN_TOKEN_KEY]}"}) as resp:
                    return resp.status

        for p in self.pods():
            ip = p["status"]["podIP"]
            try:
                status = asyncio.run(check(ip))
            except (aiohttp.ClientError, OSError) as e:
                pytest.fail(f"pod {p['metadata']['name']} at {ip}:{names.DEFAULT_ADMIN_PORT} is not this "
                            f"model's admin listener ({type(e).__name__}: {e}): another process (another local "
                            f"cluster with the same pod CIDR?) owns that address")
            assert status == 200, f"pod {p['metadata']['name']} refused this model's admin token ({status})"

    def events(self) -> list[dict]:
        return self.get("events", "--field-selector", f"involvedObject.kind=GateConfig,involvedObject.name={GATE}")["items"]

    # ---------------------------------------------------------------- writing
    def set_params(self, **changes: Any) -> str:
        """Replace spec.params with BASE_PARAMS + changes; returns the new content-addressed version."""
        from sparsegate_workload import gateparams

        params = {**BASE_PARAMS, **changes}
        self.cluster.kubectl("patch", "gateconfig", GATE, "-n", self.namespace, "--type=json", "-p",
                             json.dumps([{"op": "replace", "path": "/spec/params", "value": params}]))
        # The CRD's defaults fill in omitted fields (e.g. faultInjection.addedLatencyMs): the
        # version is that of the params as stored.
        return gateparams.version_of(self.gateconfig()["spec"]["params"])

    def set_rollout(self, **fields: Any) -> None:
        self.cluster.kubectl("patch", "gateconfig", GATE, "-n", self.namespace, "--type=merge", "-p",
                             json.dumps({"spec": {"rollout": fields}}))

    def annotate(self, key: str) -> None:
        self.cluster.kubectl("annotate", "gateconfig", GATE, "-n", self.namespace, f"{key}=now", "--overwrite")

    # ---------------------------------------------------------------- waiting
    def watch(self, what: str, done: Callable[[dict], bool], *, timeout: float = 120.0) -> list[dict]:
        """Poll status.rollout until ``done``; returns the distinct states seen on the way. Fails at
        once if the operator container restarted without a kill() (checked every 2 s)."""
        seen: list[dict] = []
        last_check = [time.monotonic()]

        def reached() -> bool:
            ro = self.rollout()
            state = {k: ro.get(k) for k in ("phase", "step", "canaryInstances", "canaryVersion", "reason")}
            if not seen or seen[-1] != state:
                seen.append(state)
            if done(ro):
                return True
            if time.monotonic() - last_check[0] >= 2.0:
                last_check[0] = time.monotonic()
                if self.operator.unexpected_restarts() > 0:
                    pytest.fail(f"the operator container restarted while waiting for {what}:\n"
                                f"{self.stack.diagnose()}")
            return False

        try:
            wait_for(reached, what=what, timeout_s=timeout, interval_s=0.25)
        except AssertionError as exc:
            pytest.fail(f"{exc}; last status.rollout: {json.dumps(self.rollout())[:1500]}\n"
                        f"states seen: {seen}\noperator log:\n{self.operator.tail()}")
        return seen
