"""Fixtures for the rollout e2e tests: one real fleet, on its own control plane, per module.

``rollout_cluster`` is a local control plane of this module's own (etcd, kube-apiserver,
controller-manager, scheduler, kwok) on a pod CIDR no other cluster on this machine uses: pods
must own their loopback IP:port for real model servers to bind them, and another cluster in
the contract's default 127.20.0.0/16 (a demo, another session) would own some of those. It also
keeps other tests' operators (the session operator serves all namespaces) off this fleet.

``fleet`` installs the CRDs, creates a GateConfig and a SparseModel of ``REPLICAS`` pods, runs
the pod runner (one real model server per pod, on the pod's IP), the operator (``sparsegate
run``, 1 s rollout tick) and a loopback load generator, and tears all of it down.

The operator runs with a token of the chart's ServiceAccount (the chart is installed with the
real helm), so the rollout also proves the chart's RBAC: pods list, ``<m>-admin`` Secret get,
GateConfig status patch, Events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from localcluster import LocalCluster, nodes, processes
from localcluster.ports import pick_unused_pod_cidr

from loadgen import BackgroundLoad
from rollout_e2e_support import (ANALYSIS_INTERVAL, BASE_PARAMS, GATE, MODEL, QPS, REPLICAS, REPO, Fleet, Operator,
                                 _wait)

@pytest.fixture(scope="module")
def rollout_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(state_dir=tmp_path_factory.mktemp("rollout-cluster"), pod_cidr=pick_unused_pod_cidr(),
                         node_shape=nodes.NodeShape(count=2, gpu_count=0))
    local.start()
    sys.stderr.write(f"\n[e2e] rollout cluster up in {local.timings['total']:.1f}s, pods in {local.pod_cidr}\n")
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def fleet(rollout_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    cluster = rollout_cluster
    work = tmp_path_factory.mktemp("rollout")
    # The chart with the real helm: CRDs, and the operator's ServiceAccount and RBAC, whose token the
    # operator then runs with — so these tests also prove the chart grants what rollouts need.
    helm = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin")) / "helm"
    if not helm.is_file():
        pytest.fail(f"the real helm binary is required at {helm}; run dev/setup/binaries.sh helm")
    subprocess.run([str(helm), f"--kubeconfig={cluster.kubeconfig}", "upgrade", "--install", "sg",
                    str(REPO / "charts" / "sparsegate"), "-n", "sparsegate-system", "--create-namespace",
                    "--wait=false"], check=True, capture_output=True, text=True, timeout=180)
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
    kubeconfig = cluster.service_account_kubeconfig(namespace="sparsegate-system",
                                                    service_account="sg-sparsegate-operator",
                                                    path=work / "operator.kubeconfig", duration="2h")
    op = Operator(cluster=cluster, namespace=ns, work=work, kubeconfig=kubeconfig)
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
        f.load = BackgroundLoad(f.targets, qps=QPS).start()
        yield f
    finally:
        if f.load is not None:
            f.load.stop()
            sys.stderr.write(f"[e2e] load: {f.load.stats}\n")
        op.stop()
        sys.stderr.write(f"[e2e] rollout operator log tail:\n{op.tail(40)}\n")
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        processes.stop_from_pid_file(work / "podrunner.pid", grace_s=15, popen=runner)
