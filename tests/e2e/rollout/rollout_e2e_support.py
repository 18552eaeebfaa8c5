"""Helpers for the rollout e2e tests (a module of its own: test files cannot import conftest by
name, pytest cannot tell the conftests of different directories apart)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from loadgen import BackgroundLoad
from localcluster import processes
from localcluster.ports import free_port

REPO = Path(__file__).resolve().parents[3]
MODEL = "rollout-m"
GATE = "gate"
REPLICAS = 10  # 5 % → 1 pod, 20 % → 2 pods, 100 % → 10 (each server holds ~320 MB)
QPS = 50.0
ANALYSIS_INTERVAL = "4s"

BASE_PARAMS = {"toolGateThreshold": 0.85, "entropyBeta": 0.1, "confidenceThreshold": 0.6,
               "capacityFactor": 1.25, "minExpertsPerToken": 1, "maxExpertsPerToken": 4,
               "precisionPolicy": "auto"}



@dataclass
class Operator:
    """`sparsegate run` for one namespace; kill() is a crash (SIGKILL), start() a fresh process."""

    cluster: Any
    namespace: str
    work: Path
    kubeconfig: Path | None = None  # the chart ServiceAccount's identity (default: admin)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def log(self) -> Path:
        return self.work / "operator.log"

    def start(self) -> None:
        self.starts += 1
        self.metrics_port = free_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig or self.cluster.kubeconfig),
               "SPARSEGATE_ROLLOUT_TICK_S": "1",
               "SPARSEGATE_ROLLOUT_RESTING_CHECK_S": "3", "POD_NAME": f"rollout-e2e-{self.starts}"}
        argv = [sys.executable, "-m", "sparsegate.cli", "run", "--standalone", "-n", self.namespace,
                f"--metrics-port={self.metrics_port}"]
        self.proc = processes.start(name="operator", argv=argv, log_path=self.log,
                                    pid_file=self.work / "operator.pid", env=env, die_with_parent=True)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"operator exited {self.proc.returncode}:\n{self.tail()}"
            try:
                self.metrics()
                return
            except OSError:
                assert time.monotonic() < deadline, f"operator metrics not up in 60 s:\n{self.tail()}"
                time.sleep(0.3)

    def kill(self) -> None:
        """A crash: SIGKILL to the operator's process group, no chance to clean up."""
        assert self.proc is not None and self.proc.poll() is None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            processes.stop_from_pid_file(self.work / "operator.pid", grace_s=10, popen=self.proc)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
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
        if not self.log.exists():
            return "(no operator log)"
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@dataclass
class Fleet:
    cluster: Any
    namespace: str
    operator: Operator
    load: BackgroundLoad | None = None

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

    def check_pods_are_ours(self) -> None:
        """Each pod IP must be served by this cluster's server: a no-op PUT with the model's token.

        Another local cluster on this machine with the same pod CIDR can own a pod's IP:port
        (its server answers /healthz, but refuses our token). Fail clearly instead of timing out.
        """
        import base64

        token = base64.b64decode(self.get("secret", f"{MODEL}-admin")["data"]["token"]).decode()
        doc = json.dumps(self.gateconfig()["status"]["stable"]).encode()
        for p in self.pods():
            req = urllib.request.Request(f"http://{p['status']['podIP']}:8080/admin/gate", data=doc, method="PUT",
                                         headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    assert resp.status == 200
            except urllib.error.HTTPError as e:
                pytest.fail(f"pod {p['metadata']['name']} at {p['status']['podIP']}:8080 refused this cluster's "
                            f"admin token ({e.code}): another process (another local cluster with the same "
                            f"pod CIDR?) owns that address")

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
        """Poll status.rollout until ``done``; returns the distinct states seen on the way."""
        seen: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            ro = self.rollout()
            state = {k: ro.get(k) for k in ("phase", "step", "canaryInstances", "canaryVersion", "reason")}
            if not seen or seen[-1] != state:
                seen.append(state)
            if done(ro):
                return seen
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; last status.rollout: {json.dumps(ro)[:1500]}\n"
                            f"states seen: {seen}\noperator log:\n{self.operator.tail()}")
            if self.operator.proc is not None and self.operator.proc.poll() is not None:
                pytest.fail(f"operator exited while waiting for {what}:\n{self.operator.tail()}")
            time.sleep(0.25)


def _wait(what: str, probe: Callable[[], Any], *, timeout: float, op: Operator | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}" + (f"\noperator log:\n{op.tail()}" if op else ""))
        time.sleep(0.5)
