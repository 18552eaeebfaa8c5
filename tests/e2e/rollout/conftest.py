"""Fixtures for the rollout e2e tests: one real fleet per module.

Given the session control plane (tests/e2e/conftest.py), ``fleet`` installs the CRDs, creates a
namespace with a GateConfig and a SparseModel of ``REPLICAS`` pods, runs the pod runner (one
real model server per pod, on the pod's loopback IP), the operator (``sparsegate run``, this
namespace only, 1 s rollout tick) and a loopback load generator, and tears all of it down.

Why the operator runs with the admin kubeconfig: the rollout controller reads each model's
``<m>-admin`` Secret for the pod admin token, which the chart's RBAC does not grant yet.

Ordering: these tests run before tests/e2e/operator, whose session-scoped operator serves every
namespace until the session ends; two controllers on one GateConfig would make these tests
about their interplay instead of the rollout.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from localcluster import processes

from rollout_e2e_support import (ANALYSIS_INTERVAL, BASE_PARAMS, GATE, MODEL, REPLICAS, REPO, Fleet, Load,
                                 Operator, _wait)

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run this directory's tests before tests/e2e/operator (see the module docstring)."""
    mine = [i for i in items if HERE in Path(str(i.fspath)).parents]
    if not mine:
        return
    rest = [i for i in items if i not in mine]
    operator_dir = HERE.parent / "operator"
    at = next((n for n, i in enumerate(rest) if operator_dir in Path(str(i.fspath)).parents), len(rest))
    items[:] = rest[:at] + mine + rest[at:]


@pytest.fixture(scope="module")
def fleet(cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("rollout")
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "charts" / "sparsegate" / "crds"))
    for crd in ("sparsemodels", "gateconfigs"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}.sparsegate.dev", "--timeout=60s")
    ns = f"rollout-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    _wait("default ServiceAccount", lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", ns,
                                                            check=False).returncode == 0, timeout=60)
    gateconfig = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig", "metadata": {"name": GATE},
                  "spec": {"params": BASE_PARAMS,
                           "rollout": {"steps": [5, 20, 100], "analysisInterval": ANALYSIS_INTERVAL,
                                       "slaP99LatencyMs": 800, "maxDrift": 0.2, "autoRollback": True}}}
    model = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "metadata": {"name": MODEL},
             "spec": {"image": "ghcr.io/sparsegate/model-server:0.1.0", "replicas": REPLICAS,
                      "gateConfigRef": {"name": GATE},
                      "model": {"dModel": 128, "experts": 4, "maxExpertsPerToken": 2}}}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                    "items": [gateconfig, model]}))
    op = Operator(cluster=cluster, namespace=ns, work=work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "dev"), os.environ.get("PYTHONPATH", "")])}
    runner_dir = work / "podrunner"
    runner = processes.start(
        name="podrunner",
        argv=[sys.executable, "-m", "localcluster", "--state-dir", str(cluster.state_dir), "podrunner",
              "--work-dir", str(runner_dir), "--selector", f"sparsegate.dev/model={MODEL}"],
        log_path=work / "podrunner.log", pid_file=work / "podrunner.pid", env=env, die_with_parent=True)
    f = Fleet(cluster=cluster, namespace=ns, operator=op)
    try:
        op.start()

        def all_serving() -> bool:
            versions = f.pod_versions()
            return len(versions) == REPLICAS and all(versions.values())
        _wait(f"{REPLICAS} model servers answering /healthz", all_serving, timeout=240, op=op)
        f.check_pods_are_ours()
        f.watch("the GateConfig to be initialised", lambda ro: ro.get("phase") == "Succeeded", timeout=60)
        f.load = Load(f.targets)
        f.load.start()
        yield f
    finally:
        if f.load is not None:
            f.load.stop()
            sys.stderr.write(f"[e2e] load: {dict(f.load.gen.stats) if f.load.gen else {}}\n")
        op.stop()
        sys.stderr.write(f"[e2e] rollout operator log tail:\n{op.tail(40)}\n")
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        processes.stop_from_pid_file(work / "podrunner.pid", grace_s=15, popen=runner)
