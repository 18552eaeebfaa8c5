"""The few podman calls the container pod runner makes, as typed functions.

Settings come from the project's ``dev/containers/containers.conf`` (``CONTAINERS_CONF``, set by
dev/env.sh; runc, no default ulimits): podman's defaults do not run on these machines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from localcluster.podplan import ContainerPlan

CONF = Path(__file__).resolve().parents[1] / "containers" / "containers.conf"
LABEL_RUNNER = "io.sparsegate.runner"
LABEL_POD_UID = "io.sparsegate.pod-uid"
LABEL_CONTAINER = "io.sparsegate.container"
LABEL_GRACE = "io.sparsegate.grace-seconds"


class PodmanError(RuntimeError):
    """A podman command failed; the message carries its stderr."""


def container_name(*, namespace: str, pod: str, uid: str, container: str) -> str:
    """The podman name of one pod container (a kubelet's dockershim-style name)."""
    return f"k8s_{container}_{pod}_{namespace}_{uid[:8]}"


def runner_id(work_dir: Path) -> str:
    """The label value that marks one pod runner's containers (stable for a cluster's work dir)."""
    import hashlib

    return hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()[:12]


def remove_runner_containers(runner: str, *, grace_s: int = 10) -> int:
    """Stops and removes every container of ``runner`` (each given its pod's grace period, at most
    ``grace_s``); returns how many there were."""
    found = list_containers(runner)
    if found:
        grace = max(min(int(c.labels.get(LABEL_GRACE, grace_s)), grace_s) for c in found.values())
        podman("rm", "-f", "-t", str(grace), "--ignore", *found, check=False, timeout=60 + 2 * grace)
    return len(found)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(CONF))
    return env


def executable() -> str:
    found = shutil.which("podman")
    if not found:
        raise PodmanError("podman not found: run dev/setup.sh (installs podman, buildah, runc)")
    return found


def podman(*args: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([executable(), *args], capture_output=True, text=True, timeout=timeout, env=_env(),
                          check=False)
    if check and proc.returncode != 0:
        raise PodmanError(f"podman {' '.join(args[:3])} ... failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def image_exists(image: str) -> bool:
    return podman("image", "exists", image, check=False).returncode == 0


@dataclasses.dataclass(frozen=True)
class ContainerState:
    name: str
    id: str
    state: str  # podman's: created, running, exited, ...
    exit_code: int
    started_at: int  # unix seconds, 0 if never
    exited_at: int
    labels: Mapping[str, str]


def list_containers(runner_id: str) -> dict[str, ContainerState]:
    """Every container this runner made (by label), running or not, by name."""
    out = podman("ps", "-a", "--filter", f"label={LABEL_RUNNER}={runner_id}", "--format", "json").stdout
    found = {}
    for c in json.loads(out or "[]"):
        name = (c.get("Names") or [""])[0]
        found[name] = ContainerState(
            name=name, id=c.get("Id", ""), state=str(c.get("State", "")).lower(), exit_code=int(c.get("ExitCode") or 0),
            started_at=int(c.get("StartedAt") or 0), exited_at=int(c.get("ExitedAt") or 0),
            labels=c.get("Labels") or {},
        )
    return found


def run_argv(plan: ContainerPlan, *, name: str, labels: Mapping[str, str], mounts: Sequence[tuple[str, str, bool]],
             hostname: str) -> list[str]:
    """``podman run`` arguments for ``plan`` (host network; ``mounts`` as (host, container, ro))."""
    argv = ["run", "-d", "--name", name, "--network", "host", "--pull", "never", "--hostname", hostname,
            "--log-driver", "k8s-file"]
    for k, v in sorted(labels.items()):
        argv += ["--label", f"{k}={v}"]
    if plan.entrypoint is not None:
        argv += ["--entrypoint", json.dumps(list(plan.entrypoint))]
    if plan.user:
        argv += ["--user", plan.user]
    if plan.working_dir:
        argv += ["--workdir", plan.working_dir]
    if plan.read_only_root:
        argv += ["--read-only"]
    if plan.privileged:
        argv += ["--privileged"]
    if plan.no_new_privileges:
        argv += ["--security-opt", "no-new-privileges"]
    if plan.seccomp_unconfined:
        argv += ["--security-opt", "seccomp=unconfined"]
    argv += [f"--cap-drop={c}" for c in plan.cap_drop]
    argv += [f"--cap-add={c}" for c in plan.cap_add]
    for k, v in plan.env:
        argv += ["--env", f"{k}={v}"]
    for source, target, ro in mounts:
        argv += ["--volume", f"{source}:{target}:{'ro' if ro else 'rw'}"]
    argv.append(plan.image)
    if plan.args is not None:
        argv += list(plan.args)
    return argv


def logs_tail(name: str, lines: int = 20) -> str:
    proc = podman("logs", "--tail", str(lines), name, check=False)
    return (proc.stdout + proc.stderr).strip()


def follow_logs(name: str, out: Path) -> subprocess.Popen[bytes]:
    """``podman logs -f --timestamps`` of a container into ``out`` until it ends (or is killed):
    what a container said while stopping, still readable after its pod is deleted."""
    with open(out, "wb") as sink:
        return subprocess.Popen([executable(), "logs", "-f", "--timestamps", name], stdout=sink,
                                stderr=subprocess.STDOUT, env=_env())
