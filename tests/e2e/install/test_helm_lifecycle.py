"""The chart's release-level checks through the real helm binary against the bare control plane.

No images and no pods: only what helm install/upgrade decides from what the API server holds
(templates that `lookup`, and what the API server accepts or refuses). Fails (never skips) when
helm is missing: build it with dev/setup/binaries.sh helm.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from localcluster import LocalCluster

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))


@pytest.fixture
def helm(cluster: LocalCluster) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    """``helm("install", ...)`` on the session cluster; every release it installed is uninstalled
    after, then the namespaces it was given (``helm.namespaces``) are deleted."""
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    installed: list[tuple[str, str]] = []

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(exe), f"--kubeconfig={cluster.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=120)
        if args[0] == "install" and proc.returncode == 0:
            installed.append((args[1], args[args.index("-n") + 1]))
        return proc

    run.namespaces = []  # type: ignore[attr-defined]
    yield run
    for release, ns in reversed(installed):
        run("uninstall", release, "-n", ns)
    for ns in run.namespaces:  # type: ignore[attr-defined]
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_second_release_in_the_same_namespace_is_refused(cluster: LocalCluster, helm) -> None:
    """Two releases in one namespace (each serving its own namespaces) both installed, and both
    operators ran `--lease-name=sparsegate-operator --lease-namespace=<that namespace>`: one held the
    Lease and the other stood by for ever (answering liveness), so the namespaces only it serves were
    never reconciled, with no error anywhere; the flow-policy and probe ConfigMaps (fixed names in the
    release namespace) were shared too. The second install now fails naming the first release."""
    tag = uuid.uuid4().hex[:6]
    ns, served_a, served_b = f"sg-{tag}", f"ml-{tag}", f"staging-{tag}"
    a, b = f"a-{tag}", f"b-{tag}"  # cluster-scoped names follow the release name: none left by another run
    for name in (ns, served_a, served_b):
        cluster.kubectl("create", "namespace", name)
        helm.namespaces.append(name)
    first = helm("install", a, str(CHART), "-n", ns, "--set", f"operator.watchNamespaces={{{served_a}}}")
    assert first.returncode == 0, first.stderr
    second = helm("install", b, str(CHART), "-n", ns, "--set", f"operator.watchNamespaces={{{served_b}}}")
    assert second.returncode != 0, "a second release in the namespace was installed"
    assert f'namespace {ns} already runs the sparsegate operator of release "{a}"' in second.stderr, second.stderr
    # The release itself upgrades, and another namespace takes the second release.
    again = helm("upgrade", a, str(CHART), "-n", ns, "--reuse-values")
    assert again.returncode == 0, again.stderr
    other = helm("install", b, str(CHART), "-n", served_b)
    assert other.returncode == 0, other.stderr


def test_an_upgrade_that_changes_the_lease_recreates_the_operator(cluster: LocalCluster, helm) -> None:
    """With leader election the Deployment rolls (old and new pods overlap), which is safe only when
    both elect on one Lease. An upgrade turning leaderElection on (from the Recreate of `false`), or
    renaming the Lease, rolled too: the new pod found its Lease free and led at once while the old
    one still ran (without a Lease, or on the old one), two operators writing the same objects.
    Such an upgrade now recreates; the next one rolls again."""
    tag = uuid.uuid4().hex[:6]
    ns, release = f"sg-{tag}", f"sg-{tag}"
    cluster.kubectl("create", "namespace", ns)
    helm.namespaces.append(ns)

    def strategy() -> str:
        return cluster.kubectl("get", "deployment", "-n", ns, f"{release}-sparsegate-operator",
                               "-o", "jsonpath={.spec.strategy.type}").stdout

    steps = [(("install", "--set", "operator.leaderElection.enabled=false"), "Recreate"),
             (("upgrade", "--set", "operator.leaderElection.enabled=true"), "Recreate"),  # none ran on a Lease
             (("upgrade", "--reuse-values"), "RollingUpdate"),  # both elect on sparsegate-operator
             (("upgrade", "--reuse-values", "--set", "operator.leaderElection.leaseName=renamed"), "Recreate"),
             (("upgrade", "--reuse-values"), "RollingUpdate")]
    for (verb, *values), want in steps:
        proc = helm(verb, release, str(CHART), "-n", ns, *values)
        assert proc.returncode == 0, proc.stderr
        assert strategy() == want, (verb, values)
