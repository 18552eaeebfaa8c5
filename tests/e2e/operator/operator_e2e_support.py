"""Helpers shared by the operator e2e tests and their fixtures (imported by name: no conftest
imports, which pytest cannot tell apart across directories)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from localcluster.ports import free_port

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "sparsegate"
EXAMPLES = REPO / "examples"
RELEASE = "sg"
RELEASE_NS = "sparsegate-system"
SERVICE_ACCOUNT = "sg-sparsegate-operator"  # <release>-sparsegate-operator (chart helpers)
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))



def helm_binary() -> Path:
    exe = BIN / "helm"
    if not exe.is_file():
        pytest.fail(f"the real helm binary is required at {exe}; run dev/setup/binaries.sh helm")
    return exe


def service_account_kubeconfig(cluster, path: Path) -> Path:
    """The admin kubeconfig's server and CA, but the chart ServiceAccount's token as identity."""
    return cluster.service_account_kubeconfig(namespace=RELEASE_NS, service_account=SERVICE_ACCOUNT,
                                              path=path, duration="2h")


@dataclasses.dataclass
class OperatorProcess:
    proc: subprocess.Popen
    log: Path
    metrics_port: int
    liveness_port: int

    def get(self, port: int, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def get_json(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def wait_for(what: str, probe, *, timeout: float = 90.0, interval: float = 0.5, op=None):
    """Poll ``probe()`` until it returns a truthy value; fail with ``what`` and the operator log."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    log = f"\noperator log:\n{op.tail()}" if op is not None else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what}{log}")
