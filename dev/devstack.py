"""The dev stack: what a platform engineer would have after ``helm install``, on this machine.

One module brings up, in order: the project's images (``imagebuild``, cached by content), a local
control plane whose pods run their containers with podman (``LocalCluster(containers=True)``), and
the chart installed with helm using those images — so the operator runs in-cluster from its image
with its ServiceAccount, the chart's OPA sidecar decides routing, and the SparseModel pods the
operator renders run the model-server image. The demo (``dev/demo.py``) and the install e2e tests
use it; waits go through the one poller, :func:`localcluster.health.wait_for`.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from localcluster import LocalCluster, nodes, podman
from localcluster.binaries import find_binary
from localcluster.health import wait_for

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "sparsegate"
RELEASE, RELEASE_NS = "sparsegate", "sparsegate-system"
OPERATOR_LABELS = "app.kubernetes.io/component=operator"
# What the stack runs by default; the node agent (``"agent"``) is opt-in: it needs BPF and an interface.
DEFAULT_IMAGES = ("operator", "model-server", "opa")


def split_ref(ref: str) -> tuple[str, str]:
    """``localhost/x:tag`` → (``localhost/x``, ``tag``)."""
    repo, _, tag = ref.rpartition(":")
    return repo, tag


def image_values(images: Mapping[str, str]) -> list[str]:
    """helm ``--set`` flags that point the chart at locally built images (never pulled)."""
    flags = []
    for key, name in (("operator.image", "operator"), ("opa.image", "opa"), ("modelServer.image", "model-server"),
                      ("agent.image", "agent")):
        if name in images:
            repo, tag = split_ref(images[name])
            flags += ["--set", f"{key}.repository={repo}", "--set", f"{key}.tag={tag}",
                      "--set", f"{key}.pullPolicy=Never"]
    return flags


def operator_env_values(env: Mapping[str, str]) -> list[str]:
    """helm flags that give the operator container ``env`` (the chart's ``operator.extraEnv``)."""
    flags: list[str] = []
    for i, (name, value) in enumerate(env.items()):
        flags += ["--set", f"operator.extraEnv[{i}].name={name}", "--set-string", f"operator.extraEnv[{i}].value={value}"]
    return flags


class Stack:
    """Images + container-mode cluster + helm release. ``up()`` is idempotent for a running stack."""

    def __init__(self, *, state_dir: Path, pod_cidr: str | None = None, node_shape: nodes.NodeShape | None = None,
                 die_with_parent: bool = True, operator_env: Mapping[str, str] | None = None,
                 extra_values: Sequence[str] = ()) -> None:
        kwargs: dict[str, Any] = {"pod_cidr": pod_cidr} if pod_cidr else {}
        self.cluster = LocalCluster(state_dir=state_dir, containers=True, node_shape=node_shape,
                                    die_with_parent=die_with_parent, **kwargs)
        self.extra_values = [*operator_env_values(operator_env or {}), *extra_values]
        self.images: dict[str, str] = {}

    # -- bring-up ---------------------------------------------------------------------------

    def build_images(self, names: Sequence[str] = DEFAULT_IMAGES) -> dict[str, str]:
        """Builds (or finds cached) ``names``; the chart is pointed at exactly these images."""
        import imagebuild

        self.images = imagebuild.ensure_images(list(names))
        return self.images

    def start_cluster(self) -> None:
        if len(self.cluster.running_components()) < 6:
            self.cluster.start()

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(find_binary("helm")), f"--kubeconfig={self.cluster.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args[:2])} failed: {proc.stderr.strip()}")
        return proc

    def install(self, *values: str) -> None:
        """``helm upgrade --install`` of the chart with chart defaults plus the local images.

        The chart's CRDs are applied first, as the chart README says for every upgrade: helm never
        upgrades crds/, and the chart's crds check refuses CRDs of another commit (a cluster kept
        running across commits, as the demo's is)."""
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
        self.helm("upgrade", "--install", RELEASE, str(CHART), "-n", RELEASE_NS, "--create-namespace",
                  *image_values(self.images), *self.extra_values, *values)

    def up(self) -> Stack:
        if not self.images:
            self.build_images()
        self.start_cluster()
        self.install()
        self.wait_operator_ready()
        return self

    def down(self) -> list[str]:
        return self.cluster.stop()

    # -- what tests and the demo look at ----------------------------------------------------

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, **kw)

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", kind, name, "-n", namespace, "-o", "json").stdout)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return json.loads(self.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout)["items"]

    def operator_pods(self) -> list[dict[str, Any]]:
        return [p for p in self.pods(RELEASE_NS, OPERATOR_LABELS) if not p["metadata"].get("deletionTimestamp")]

    def wait_operator_ready(self, timeout_s: float = 180) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            for p in self.operator_pods():
                conds = {c["type"]: c["status"] for c in p.get("status", {}).get("conditions") or []}
                if conds.get("Ready") == "True":
                    return p
            return None

        try:
            return wait_for(ready, what="operator pod Ready", timeout_s=timeout_s, interval_s=1.0)  # type: ignore[return-value]
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnose()}") from None

    @staticmethod
    def container_name(pod: Mapping[str, Any], container: str) -> str:
        meta = pod["metadata"]
        return podman.container_name(namespace=meta["namespace"], pod=meta["name"], uid=meta["uid"],
                                     container=container)

    def logs(self, pod: Mapping[str, Any], container: str, lines: int = 40) -> str:
        return podman.logs_tail(self.container_name(pod, container), lines)

    def follow_logs(self, pod: Mapping[str, Any], container: str, out: Path) -> subprocess.Popen[bytes]:
        """The container's log, from now until it ends, into ``out`` (kept after the pod goes)."""
        return podman.follow_logs(self.container_name(pod, container), out)

    def diagnose(self) -> str:
        """Pods, their container states and the operator's log tail: what a failing wait prints."""
        out = [self.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout]
        for p in self.operator_pods():
            for c in p.get("status", {}).get("containerStatuses") or []:
                # lastState says how a restarted container ended (exit code 1 after a lost Lease,
                # a liveness restart, ...): what a "restarted unexpectedly" failure needs.
                out.append(f"--- {p['metadata']['name']}/{c['name']}: {json.dumps(c.get('state'))} "
                           f"restarts {c.get('restartCount', 0)}, last {json.dumps(c.get('lastState') or {})}")
                out.append(self.logs(p, c["name"]))
        runner_log = self.cluster.layout.log("podrunner")
        if runner_log.exists():
            out.append("--- podrunner log tail\n" + "\n".join(runner_log.read_text().splitlines()[-30:]))
        return "\n".join(out)

    def kill_container(self, pod: Mapping[str, Any], container: str) -> None:
        """A crash: SIGKILL to the container (the pod runner restarts it, as a kubelet would)."""
        podman.podman("kill", "--signal", "KILL", self.container_name(pod, container))

