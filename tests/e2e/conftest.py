"""Shared e2e fixtures: one real local control plane per test session, and one dev stack.

The cluster is started fresh in a temporary state directory and stopped at session end. A missing
binary raises (the tests error with the name and the setup command); nothing here skips.

``stack`` is the dev stack (``dev/devstack.py``: the project's images, a container-mode cluster, the
chart installed with helm, the operator in-cluster from its image with its OPA sidecar), built on
first use only and shared by every test that asks for it; ``stack_namespace`` gives each test a
namespace of its own on it.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devstack import Stack
from localcluster import LocalCluster
from localcluster.health import wait_for
from localcluster.ports import pick_unused_pod_cidr

E2E_DIR = Path(__file__).parent

# The shared stack's operator settings (chart `operator.extraEnv`): a 1 s rollout tick and a 1 s
# RoutingPolicy resync instead of 5 s / 10 s, so tests end in seconds. Tests that depend on a value
# read it back from the Deployment rather than assume it.
STACK_OPERATOR_ENV = {"SPARSEGATE_ROLLOUT_TICK_S": "1", "SPARSEGATE_POLICY_RESYNC_SECONDS": "1"}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # -> pytest.TestReport
    # Kept on the item so a fixture's teardown can tell whether its test failed (and print diagnostics).
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Everything under tests/e2e needs the real control plane: mark it so `-m "not e2e"` works.
    for item in items:
        if E2E_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    state = tmp_path_factory.mktemp("cluster")
    # A pod range of its own: a demo cluster (127.20.0.0/16) may be serving on this machine.
    local = LocalCluster(state_dir=state, pod_cidr=pick_unused_pod_cidr())
    local.start()
    sys.stderr.write(f"\n[e2e] local cluster up in {local.timings['total']:.1f}s {local.timings} state={state}\n")
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def kubectl(cluster: LocalCluster) -> Callable[..., subprocess.CompletedProcess[str]]:
    """``kubectl("get", "pods", "-n", ns)``: the built kubectl on the session cluster; raises on failure."""
    return cluster.kubectl


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    # Pods are rejected until the namespace's default ServiceAccount exists.
    deadline = time.monotonic() + 60
    while cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
        assert time.monotonic() < deadline, f"no default ServiceAccount in {name}"
        time.sleep(0.2)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def kube_api_client(cluster: LocalCluster):  # -> kubernetes.client.ApiClient
    """A Python Kubernetes ApiClient for the session cluster."""
    from kubernetes import config as kube_config

    return kube_config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The dev stack, up once for the whole session (only if a test asks for it), stopped at the end.

    Its own pod range, like ``cluster``: a demo stack (127.20.0.0/16) may be running on this machine.
    """
    s = Stack(state_dir=tmp_path_factory.mktemp("stack"), pod_cidr=pick_unused_pod_cidr(),
              operator_env=STACK_OPERATOR_ENV,
              # Tests make a namespace each (stack_namespace): the operator must serve them all.
              # The chart's admission policy stays on, so every test's writes go through it.
              extra_values=["--set", "operator.clusterWide=true"])
    t0 = time.monotonic()
    s.build_images()
    t_images = time.monotonic()
    try:
        s.up()
        sys.stderr.write(f"\n[e2e] dev stack: images {t_images - t0:.1f}s, cluster+helm+operator Ready "
                         f"{time.monotonic() - t_images:.1f}s, pods in {s.cluster.pod_cidr}\n")
        yield s
    finally:
        s.down()


@pytest.fixture
def stack_namespace(stack: Stack, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace on the dev stack, deleted (without waiting) after the test; a failed test
    also gets the stack's diagnostics (pods, operator log tails, pod runner log) in its report."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    stack.kubectl("create", "namespace", name)
    # Pods are rejected until the namespace's default ServiceAccount exists.
    wait_for(lambda: stack.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             what=f"default ServiceAccount in {name}")
    yield name
    if any(getattr(getattr(request.node, f"rep_{when}", None), "failed", False) for when in ("setup", "call")):
        sys.stderr.write(f"[e2e] dev stack diagnostics:\n{stack.diagnose()[-8000:]}\n")
    stack.kubectl("delete", "namespace", name, "--wait=false", check=False)
