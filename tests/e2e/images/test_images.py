"""The project's container images, for real: built (or found cached) by ``imagebuild``, then run
with podman. Each prints its build's version, carries the OCI labels, runs as the user the chart
expects, and does its job: the model server answers inference, OPA serves, the agent has BCC.

Nothing is skipped: without podman/buildah the build fails with the command that installs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import imagebuild
import pytest
from imagebuild import sources, tools
from localcluster.ports import free_port

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
NONROOT = "65532"
LABEL_KEYS = ("title", "version", "revision", "source", "licenses", "description")


def podman(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=tools.env(),
                              stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        pytest.fail(f"podman not found: install it with {tools.INSTALL_HINT}", pytrace=False)
    if check and proc.returncode != 0:
        pytest.fail(f"podman {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    return proc


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    t0 = time.monotonic()
    try:
        refs = imagebuild.ensure_images()
    except imagebuild.ImageBuildError as exc:
        pytest.fail(f"could not build the images: {exc}", pytrace=False)
    print(f"[images] ensure_images in {time.monotonic() - t0:.1f}s: {refs}")
    return refs


def inspect(ref: str) -> dict:
    return json.loads(podman("image", "inspect", ref).stdout)[0]


def opa_version() -> str:
    return sources.go_module_version(ROOT / "dev/go/opa/go.mod", "github.com/open-policy-agent/opa")


@pytest.mark.parametrize("name,args,expected", [
    ("operator", ["--version"], f"sparsegate {VERSION}"),
    ("model-server", ["--version"], f"sparsegate_workload.server {VERSION}"),
    ("agent", ["--version"], f"sparsegate_ebpf.agent {VERSION}"),
    ("opa", ["version"], None),
])
def test_image_prints_its_version(images: dict[str, str], name: str, args: list[str], expected: str | None) -> None:
    out = podman("run", "--rm", images[name], *args, timeout=120).stdout
    assert (expected or f"Version: {opa_version()}") in out, out


@pytest.mark.parametrize("name", ["operator", "model-server", "agent", "opa"])
def test_image_labels(images: dict[str, str], name: str) -> None:
    labels = inspect(images[name])["Config"]["Labels"]
    for key in LABEL_KEYS:
        assert labels.get(f"org.opencontainers.image.{key}"), f"{name}: label {key} missing in {labels}"
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.title"] == f"sparsegate-{name}"
    assert labels["org.opencontainers.image.version"] == (opa_version() if name == "opa" else VERSION)
    assert labels["org.opencontainers.image.revision"] != ""


@pytest.mark.parametrize("name", ["operator", "model-server"])
def test_python_images_run_as_nonroot(images: dict[str, str], name: str) -> None:
    assert inspect(images[name])["Config"]["User"] == f"{NONROOT}:{NONROOT}"
    assert podman("run", "--rm", "--entrypoint", "id", images[name], timeout=60).stdout.split()[0] == \
        f"uid={NONROOT}(nonroot)"


def test_agent_image_has_debian_bcc_and_the_agent(images: dict[str, str]) -> None:
    out = podman("run", "--rm", "--entrypoint", "python", images["agent"], "-c",
                 "import bcc, sparsegate_ebpf.agent, sparsegate_ebpf.programs as p;"
                 "print(bcc.__file__, p.import_bcc().__name__)", timeout=60).stdout
    # Debian's python3-bpfcc, linked into the image's virtualenv (not PyPI's unrelated `bcc`).
    assert "/bcc/__init__.py" in out and "site-packages/bcc" in out, out
    assert inspect(images["agent"])["Config"].get("User", "") in ("", "0", "root")


@pytest.mark.bpf
def test_agent_image_loads_xdp_without_privileged_mode(images: dict[str, str]) -> None:
    """As the chart runs it: root with only BPF, NET_ADMIN and PERFMON, a read-only root filesystem,
    /tmp writable, the host's kernel headers mounted. BCC compiles and the kernel verifies and loads
    the XDP program (attached nowhere). seccomp is unconfined, as for a Kubernetes pod without a
    seccompProfile: podman's default profile here (containers-common 0.50) allows bpf() only with
    CAP_SYS_ADMIN."""
    build = Path(f"/lib/modules/{os.uname().release}/build")
    if not build.exists():
        pytest.fail(f"no kernel headers at {build}: run dev/setup/bpf.sh", pytrace=False)
    proc = podman("run", "--rm", "--cap-drop", "all", "--cap-add", "BPF,NET_ADMIN,PERFMON",
                  "--security-opt", "seccomp=unconfined", "--read-only", "--tmpfs", "/tmp",
                  "-v", "/lib/modules:/lib/modules:ro", "-v", "/usr/src:/usr/src:ro",
                  "--entrypoint", "python", images["agent"], "-m", "sparsegate_ebpf.programs", timeout=300, check=False)
    assert proc.returncode == 0 and "loaded xdp_flow" in proc.stderr, proc.stdout + proc.stderr


class Container:
    """``podman run -d --network host``; removed (with its logs kept for the failure message) after."""

    def __init__(self, image: str, *args: str) -> None:
        self.name = f"sg-img-test-{uuid.uuid4().hex[:8]}"
        podman("run", "-d", "--name", self.name, "--network", "host", image, *args, timeout=120)

    def logs(self) -> str:
        proc = podman("logs", self.name, check=False, timeout=30)
        return proc.stdout + proc.stderr

    def running(self) -> bool:
        return podman("inspect", "--format", "{{.State.Running}}", self.name, check=False).stdout.strip() == "true"

    def process_uid(self) -> str:
        pid = podman("inspect", "--format", "{{.State.Pid}}", self.name).stdout.strip()
        status = Path(f"/proc/{pid}/status").read_text()
        return next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))

    def stop(self) -> int:
        podman("stop", "--time", "10", self.name, timeout=60)
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout.strip())

    def remove(self) -> None:
        podman("rm", "--force", self.name, check=False, timeout=60)


@pytest.fixture
def container() -> Iterator[type[Container]]:
    started: list[Container] = []

    class Tracked(Container):
        def __init__(self, image: str, *args: str) -> None:
            super().__init__(image, *args)
            started.append(self)

    yield Tracked
    for c in started:
        c.remove()


def http(method: str, url: str, body: object | None = None, timeout: float = 10) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_http(c: Container, url: str, timeout_s: float) -> tuple[int, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return http("GET", url, timeout=2)
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            if not c.running():
                pytest.fail(f"{c.name} exited before answering {url}:\n{c.logs()}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"{url} did not answer within {timeout_s:.0f}s:\n{c.logs()}", pytrace=False)
            time.sleep(0.3)


def test_model_server_image_serves_inference(images: dict[str, str], container: type[Container]) -> None:
    port = free_port()
    c = container(images["model-server"], "--host", "127.0.0.1", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    status, health = wait_http(c, f"{base}/healthz", timeout_s=180)
    assert status == 200 and health["status"] == "ok", health
    deadline = time.monotonic() + 120
    while (code := http("POST", f"{base}/v1/infer", {"tokens": [[1, 2, 3, 4], [5, 6, 7, 8]]}))[0] == 503:
        assert time.monotonic() < deadline, f"still loading: {code}\n{c.logs()}"
        time.sleep(0.5)
    status, result = code
    assert status == 200, (result, c.logs())
    assert len(result["nextTokens"]) == 2 and all(0 <= t < 512 for t in result["nextTokens"])
    assert result["gateVersion"] == health["gateVersion"]
    assert c.process_uid() == NONROOT
    assert c.stop() in (0, 143), c.logs()  # SIGTERM: a clean shutdown


def test_opa_image_serves_as_nonroot(images: dict[str, str], container: type[Container]) -> None:
    assert inspect(images["opa"])["Config"]["User"] == f"{NONROOT}:{NONROOT}"
    port = free_port()
    c = container(images["opa"], "run", "--server", f"--addr=127.0.0.1:{port}", "--skip-version-check")
    status, body = wait_http(c, f"http://127.0.0.1:{port}/health", timeout_s=60)
    assert status == 200, body
    assert c.process_uid() == NONROOT
    c.stop()


def test_warm_ensure_builds_nothing(images: dict[str, str]) -> None:
    t0 = time.monotonic()
    assert imagebuild.ensure_images() == images
    assert time.monotonic() - t0 < 10, "a warm machine with an unchanged checkout must not rebuild"
    assert imagebuild.refs() == images


def test_cli_refs_match_the_api(images: dict[str, str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "dev")}
    out = subprocess.run([sys.executable, "-m", "imagebuild", "refs"], capture_output=True,
                         text=True, env=env, check=True, timeout=60).stdout
    assert dict(line.split("=", 1) for line in out.split()) == images
