"""The operator works from its wheel, without the source tree.

Builds the wheel from this checkout, installs it (``--no-deps``) into a fresh virtualenv in a temporary
directory outside the tree, makes the development virtualenv's dependencies importable through a
``.pth`` line (a directory a .pth adds is not a site directory: its own .pth files, among them the
editable install's finder, are NOT run), and then, from a directory outside the repository with no
PYTHONPATH: runs ``sparsegate --version``, reads the Rego through the installed package, and runs the
operator's RoutingPolicy sync (``handlers.routingpolicy.PolicySync``, as tests/e2e/policies do)
against a real ``opa run --server``, which gets the packaged Rego + data and answers decisions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from localcluster.binaries import find_binary
from localcluster.ports import free_port

from sparsegate_contracts import flowpolicy

pytestmark = [pytest.mark.slow, pytest.mark.opa]

ROOT = Path(__file__).resolve().parents[3]
SOURCE_REGO = ROOT / "policies" / "routing" / "src.rego"
BUILD_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _run(argv: list[str], *, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{argv} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def _clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH, no active virtualenv, no Rego override: only what the installed package brings."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "SPARSEGATE_ROUTING_REGO"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def opa_binary() -> Path:
    return find_binary("opa")  # a missing binary errors with the command that builds it


class Installed:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.venv = work / "venv"
        self.python = self.venv / "bin" / "python"
        self.site = Path(_run([str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              env=_clean_env()).stdout.strip())

    def run(self, argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
        return _run(argv, cwd=self.work, env=_clean_env(**env), timeout=120)

    def script(self, name: str, code: str, **env: str) -> str:
        path = self.work / name
        path.write_text(textwrap.dedent(code))
        return self.run([str(self.python), str(path)], **env).stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools' build/ and egg-info go to the temporary directory, not into the checkout.
    cfg = out / "build.cfg"
    cfg.write_text(f"[build]\nbuild_base = {out / 'build'}\n[egg_info]\negg_base = {out}\n")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(out / "dist"), str(ROOT)], env={**os.environ, "DIST_EXTRA_CONFIG": str(cfg)})
    (built,) = (out / "dist").glob("sparsegate-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    work = tmp_path_factory.mktemp("clean")
    assert not work.resolve().is_relative_to(ROOT), "the clean environment must live outside the source tree"
    _run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")])
    env = Installed(work)
    # This checkout's pip installs into the new interpreter's environment (which has no pip of its own),
    # before the .pth exists: pip must not see the development environment's editable sparsegate.
    _run([sys.executable, "-m", "pip", "--python", str(env.python), "install", "-q", "--no-deps", "--no-index",
          str(wheel)])
    dev_site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (env.site / "sparsegate-dev-dependencies.pth").write_text("".join(f"{p}\n" for p in dev_site))
    return env


def test_wheel_carries_the_rego_and_bpf_sources_as_files(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        info = z.getinfo("sparsegate_contracts/rego/routing.rego")
        assert (info.external_attr >> 16) & 0o170000 == 0o100000, "a regular file, not a symlink"
        assert z.read(info) == SOURCE_REGO.read_bytes()
        names = set(z.namelist())
    assert {"sparsegate_ebpf/xdp_flow.bpf.c", "sparsegate_ebpf/sparsegate_flow.h",
            "sparsegate/handlers/routingpolicy.py", "sparsegate_workload/server.py"} <= names


def test_imports_resolve_inside_the_clean_environment(installed: Installed) -> None:
    out = installed.script("where.py", """
        import json, sys
        import sparsegate.cli, sparsegate.handlers.routingpolicy, sparsegate_contracts.rego
        import sparsegate_ebpf.policy, sparsegate_workload.gateparams
        print(json.dumps({"modules": {n: getattr(m, "__file__", None) for n, m in sys.modules.items()
                                      if n.split(".")[0].startswith("sparsegate")},
                          "finders": [repr(f) for f in sys.meta_path], "path": sys.path}))
    """)
    seen = json.loads(out)
    assert len(seen["modules"]) > 10
    for name, file in seen["modules"].items():
        assert file and Path(file).is_relative_to(installed.site), f"{name} comes from {file}, not the wheel"
    assert not any("editable" in f for f in seen["finders"]), seen["finders"]
    assert not any(Path(p).is_relative_to(ROOT) for p in seen["path"] if p), seen["path"]


def test_sparsegate_version(installed: Installed) -> None:
    script = str(installed.venv / "bin" / "sparsegate")
    assert installed.run([script, "--version"]).stdout == f"sparsegate {BUILD_VERSION}\n"
    assert installed.run([script, "version"]).stdout == f"sparsegate {BUILD_VERSION}\n"


def test_rego_loads_through_the_installed_package(installed: Installed) -> None:
    out = installed.script("rego.py", """
        import json
        from importlib import resources
        from sparsegate_contracts import rego
        resource = resources.files(rego).joinpath(rego.ROUTING_RESOURCE)
        print(json.dumps({"text": rego.routing_policy(), "file": str(resource)}))
    """)
    seen = json.loads(out)
    assert seen["text"] == SOURCE_REGO.read_text()
    resource = Path(seen["file"])
    assert resource.is_relative_to(installed.site) and not resource.is_symlink()


@pytest.fixture
def opa_url() -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([str(opa_binary()), "run", "--server", "--addr", f"127.0.0.1:{port}", "--log-level",
                             "error", "--disable-telemetry"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, f"opa exited {proc.returncode}: {proc.stderr.read().decode()}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=0.5) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, f"opa on {url} not healthy after 20 s"
                time.sleep(0.05)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


ROUTING_SYNC = """
    import asyncio, json
    from sparsegate.clients.opa import RoutingOpa
    from sparsegate.domain.policy import PolicySource
    from sparsegate.domain.policy_compile import PodInfo, Port
    from sparsegate.handlers.routingpolicy import PolicySync, Settings
    from sparsegate_contracts import flowpolicy, names
    from sparsegate_ebpf.policy import parse_policy


    class MemoryStore:  # the allow-list ConfigMap, at our own wrapper's interface (no cluster here)
        half_published = False

        def __init__(self):
            self.document = None

        async def read(self):
            return self.document

        async def read_published(self):
            return self.document, None

        async def publish(self, document, *, basis=None):
            self.document = document


    def pod(name, ns, ip, sa, model=None):
        labels = ((names.MODEL_LABEL, model),) if model else ()
        return PodInfo(namespace=ns, name=name, ip=ip, service_account=sa, labels=labels,
                       ports=(Port(8080),) if model else ())


    async def main():
        settings = Settings.from_env()  # SPARSEGATE_OPA_URL from the test; no SPARSEGATE_ROUTING_REGO
        opa = RoutingOpa(url=settings.opa_url, timeout=5.0, retries=0)
        store = MemoryStore()
        sync = PolicySync(settings=settings, opa=opa, store=store)
        policy = PolicySource(namespace="models", name="allow-web", generation=1, spec={
            "action": "Allow", "priority": 10, "sources": [{"namespace": "web", "serviceAccount": "frontend"}],
            "targets": [{"sparseModel": "mixtral"}], "ports": [{"port": 8080}]})
        pods = [pod("mixtral-0", "models", "127.20.0.10", "default", model="mixtral"),
                pod("fe-0", "web", "127.20.1.1", "frontend"), pod("other-0", "web", "127.20.1.3", "other")]
        try:
            await sync.sync(policies=[policy], pods=pods)
            allowed = await opa.decide({"source": {"spiffeID": "spiffe://cluster.local/ns/web/sa/frontend"},
                                        "target": {"namespace": "models", "sparseModel": "mixtral", "port": 8080}})
            denied = await opa.decide({"source": {"namespace": "web", "serviceAccount": "other"},
                                       "target": {"namespace": "models", "sparseModel": "mixtral", "port": 8080}})
            revision = await opa.revision()
        finally:
            opa.close()
        agent_view = parse_policy(flowpolicy.document_text(store.document))
        print(json.dumps({"rego_path": settings.rego_path, "rego": sync.rego, "revision": revision,
                          "sync_revision": sync.revision, "loaded": sync.loaded, "allowed": allowed,
                          "denied": denied, "document": store.document, "agent_version": agent_view.version}))


    asyncio.run(main())
"""


def test_routing_policy_sync_against_real_opa(installed: Installed, opa_url: str) -> None:
    seen = json.loads(installed.script("routing_sync.py", ROUTING_SYNC, SPARSEGATE_OPA_URL=opa_url))
    source = SOURCE_REGO.read_text()
    assert seen["rego_path"] is None and seen["rego"] == source
    # OPA holds exactly the packaged Rego, and the data revision the sync computed from it.
    with urllib.request.urlopen(f"{opa_url}/v1/policies/sparsegate-routing", timeout=5) as r:
        assert json.load(r)["result"]["raw"] == source
    assert seen["revision"] == seen["sync_revision"] and seen["revision"].startswith("sha256:")
    assert seen["loaded"] == {"models/allow-web": {"generation": 1, "rules": 1}}
    assert seen["allowed"]["allow"] is True and seen["allowed"]["rule"] == "models/allow-web#s0t0"
    assert seen["denied"]["allow"] is False
    document = seen["document"]
    assert flowpolicy.ip_entries(document) == [{"srcIP": "127.20.1.1", "dstIP": "127.20.0.10", "dstPort": 8080,
                                                "protocol": "tcp", "action": "allow", "rule": "models/allow-web#s0t0"}]
    assert seen["agent_version"] == document["version"]
