"""Fixtures for the rollout e2e tests: one dev stack, with a real fleet, per module.

``stack`` is the dev stack (``dev/devstack.py``) of this module's own: the project's images, a
container-mode local control plane (etcd, kube-apiserver, controller-manager, scheduler, kwok;
the pod runner runs every pod's containers from their images with podman) on a pod CIDR no
other cluster on this machine uses — pods own their loopback IP:port, and another cluster in
the contract's default 127.20.0.0/16 (a demo, another session) would own some of those — and
the chart installed with helm, so the operator runs in-cluster from its image with the chart's
ServiceAccount and RBAC (pods list, ``<m>-admin`` Secret get, GateConfig status patch, Events,
the leader Lease), OPA as its sidecar. Chart values: a 1 s rollout tick and
``operator.watchNamespaces`` = the tests' namespace (a Role and RoleBinding there).

``fleet`` applies a GateConfig and a SparseModel of ``REPLICAS`` pods without ``spec.image``
(the chart's ``modelServer.image``: one model-server container per pod, bound on the pod's
IP), waits until every server answers, checks the pod IPs are served by this cluster's
servers, and runs a loopback load generator across the tests.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import pytest
from devstack import Stack
from loadgen import BackgroundLoad
from localcluster import nodes
from localcluster.health import wait_for
from localcluster.ports import pick_unused_pod_cidr

from rollout_e2e_support import (ANALYSIS_INTERVAL, BASE_PARAMS, GATE, MODEL, NAMESPACE, QPS, REPLICAS, SLA_P99_MS,
                                 Fleet, Operator)

# Operator env the tests need (see CONTRACTS: rollout controller): a 1 s tick instead of 5 s, so
# each rollout takes seconds. The resting check keeps its default (300 s): a resting GateConfig
# that must act again (a restarted or new pod) is woken by its pods' events, as in production.
OPERATOR_ENV = {"SPARSEGATE_ROLLOUT_TICK_S": "1"}




@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(state_dir=tmp_path_factory.mktemp("rollout-stack"), pod_cidr=pick_unused_pod_cidr(),
              node_shape=nodes.NodeShape(count=2, gpu_count=0), operator_env=OPERATOR_ENV,
              extra_values=["--set", f"operator.watchNamespaces={{{NAMESPACE}}}"])
    t0 = time.monotonic()
    try:
        s.build_images()
        t_images = time.monotonic()
        s.start_cluster()
        # The namespace first: the chart puts the operator's Role and RoleBinding in it (watchNamespaces).
        s.kubectl("create", "namespace", NAMESPACE)
        s.up()
        sys.stderr.write(f"\n[e2e] rollout stack: images {t_images - t0:.1f}s, cluster+helm+operator Ready "
                         f"{time.monotonic() - t_images:.1f}s, pods in {s.cluster.pod_cidr}\n")
        yield s
    finally:
        sys.stderr.write(f"[e2e] rollout stack diagnostics:\n{s.diagnose()[-6000:]}\n")
        s.down()


@pytest.fixture(scope="module")
def fleet(stack: Stack) -> Iterator[Fleet]:
    ns = NAMESPACE
    # Pods are rejected until the namespace's default ServiceAccount exists.
    wait_for(lambda: stack.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
             what="default ServiceAccount", timeout_s=60, interval_s=0.5)
    # Pod-level steps (strategy instances): these suites assert which pods hold which version;
    # the default, requests, is covered by test_request_canary.py and test_quality_rollout.py.
    gateconfig = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig", "metadata": {"name": GATE},
                  "spec": {"params": BASE_PARAMS,
                           "rollout": {"strategy": "instances", "steps": [5, 20, 100], "analysisInterval": ANALYSIS_INTERVAL,
                                       "slaP99LatencyMs": SLA_P99_MS, "maxDrift": 0.2, "autoRollback": True}}}
    # No spec.image: the chart's modelServer.image (the locally built model-server image).
    model = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "metadata": {"name": MODEL},
             "spec": {"replicas": REPLICAS, "gateConfigRef": {"name": GATE},
                      "model": {"dModel": 128, "experts": 4, "maxExpertsPerToken": 2}}}
    op = Operator(stack=stack)
    op.expected_restarts = op.restart_count()
    f = Fleet(stack=stack, namespace=ns, operator=op)
    t0 = time.monotonic()
    stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                  "items": [gateconfig, model]}))
    try:
        f.wait_serving(REPLICAS, f"{REPLICAS} model servers Ready and answering /healthz")
        sys.stderr.write(f"[e2e] {REPLICAS} model-server containers serving {time.monotonic() - t0:.1f}s after "
                         f"apply\n")
        f.check_pods_are_ours()
        f.watch("the GateConfig to be initialised", lambda ro: ro.get("phase") == "Succeeded", timeout=60)
        f.load = BackgroundLoad(f.targets, qps=QPS).start()
        yield f
    finally:
        if f.load is not None:
            f.load.stop()
            sys.stderr.write(f"[e2e] load: {f.load.stats}\n")
        # The whole container log outlives the stack (which removes the container) in the state dir.
        log = stack.cluster.state_dir / "operator-container.log"
        log.write_text(op.tail(1_000_000))
        sys.stderr.write(f"[e2e] rollout operator log ({log}) tail:\n{op.tail(40)}\n")
