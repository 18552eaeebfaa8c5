"""A real OPA server (`opa run --server`) on a free loopback port, health-checked, for the policy tests.

No OPA binary means a loud failure, never a skip: these tests exist to exercise the real engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from localcluster.binaries import MissingBinaryError, find_binary
from localcluster.ports import free_port

REPO = Path(__file__).resolve().parents[3]


def opa_binary() -> str:
    """The pinned opa that dev/setup/binaries.sh builds (the one the OPA image ships), never another
    `opa` found on PATH: a missing one fails with the command that builds it."""
    try:
        return str(find_binary("opa"))
    except MissingBinaryError as exc:
        pytest.fail(str(exc), pytrace=False)



@dataclass
class OpaServer:
    """One `opa run --server` process; `restart()` keeps the port and loses all state, like a pod restart."""

    binary: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, timeout: float = 15.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "run", "--server", "--addr", f"127.0.0.1:{self.port}", "--log-level", "error",
             "--disable-telemetry"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"opa exited with {self.proc.returncode}: {self.proc.stderr.read().decode()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=0.5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"opa on {self.url} not healthy after {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def opa_server() -> Iterator[OpaServer]:
    server = OpaServer(binary=opa_binary())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def routing_rego() -> str:
    return (REPO / "policies" / "routing" / "src.rego").read_text()
