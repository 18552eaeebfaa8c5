"""Fixtures for the operator e2e tests: the chart installed with the real helm, and the operator
run as a local process under the chart's ServiceAccount token (which proves the chart's RBAC).

Given the session `cluster` (tests/e2e/conftest.py), `sparsegate_release` runs `helm install`
(CRDs from charts/sparsegate/crds, the only copy); `operator` starts `sparsegate run` with a
kubeconfig holding a token from `kubectl create token`, and stops it (and its children) after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from operator_e2e_support import (CHART, RELEASE, RELEASE_NS, OperatorProcess, free_port,
                                  helm_binary, service_account_kubeconfig)


@pytest.fixture(scope="session")
def sparsegate_release(cluster) -> Iterator[str]:
    """`helm install` of the chart (CRDs + operator RBAC); uninstalled at the end."""
    helm = helm_binary()
    base = [str(helm), f"--kubeconfig={cluster.kubeconfig}"]
    proc = subprocess.run([*base, "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NS,
                           "--create-namespace", "--wait=false", "--timeout=120s"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"helm install failed: {proc.stderr}"
    for crd in ("sparsemodels", "gateconfigs", "telemetryprobes"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}.sparsegate.dev",
                        "--timeout=60s", timeout=90)
    yield RELEASE
    subprocess.run([*base, "uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait=false"],
                   capture_output=True, text=True, timeout=120)


# Module scope: this operator serves every namespace, so it must be gone before other areas' tests
# (e.g. tests/e2e/policies) run their own operator on the same cluster — two controllers would both
# write one RoutingPolicy's status.
@pytest.fixture(scope="module")
def operator(cluster, sparsegate_release, tmp_path_factory) -> Iterator[OperatorProcess]:
    work = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cluster, work / "kubeconfig")
    metrics_port, liveness_port = free_port(), free_port()
    log = work / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAME": "e2e-operator",
           "SPARSEGATE_NAMESPACE": RELEASE_NS}
    # The console script itself (pyproject [project.scripts]), from the running venv.
    argv = [str(Path(sys.executable).with_name("sparsegate")), "run", "--standalone", "--all-namespaces",
            f"--metrics-port={metrics_port}", f"--liveness=http://127.0.0.1:{liveness_port}/healthz",
            "--leader-elect", f"--lease-namespace={RELEASE_NS}"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    op = OperatorProcess(proc=proc, log=log, metrics_port=metrics_port, liveness_port=liveness_port)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"operator exited {proc.returncode}:\n{op.tail()}"
        try:
            status, _ = op.get(liveness_port, "/healthz")
            if status == 200 and b"leading as" in log.read_bytes():
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, f"operator not live in 60s:\n{op.tail()}"
        time.sleep(0.5)
    sys.stderr.write(f"[e2e] operator pid {proc.pid}, log {log}\n")
    try:
        yield op
    finally:
        # Its own session: signal the whole group (the operator and anything it spawned).
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        sys.stderr.write(f"[e2e] operator log tail:\n{op.tail(30)}\n")


