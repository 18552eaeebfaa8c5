"""A real model server process with its TLS admin channel, for the pod-client tests (a module of its
own: test files cannot import each other or a conftest by name)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from localcluster.ports import free_port


@contextmanager
def admin_model_server(directory: Path, *, token: str, cert: str, key: str,
                       extra_args: Sequence[str] = ()) -> Iterator[tuple[int, int]]:
    """Start ``sparsegate_workload.server`` on loopback with the admin token and certificate written
    into ``directory``; yields (port, admin port) once /readyz answers 200 (at most 60 s)."""
    (directory / "token").write_text(token)
    (directory / "tls.crt").write_text(cert)
    (directory / "tls.key").write_text(key)
    port, admin_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sparsegate_workload.server", "--host", "127.0.0.1",
                             "--port", str(port), "--admin-port", str(admin_port), *extra_args,
                             "--admin-token-file", str(directory / "token"),
                             "--admin-tls-cert", str(directory / "tls.crt"),
                             "--admin-tls-key", str(directory / "tls.key")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"model server exited: {proc.stderr.read().decode()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "model server was not ready within 60 s"
            time.sleep(0.2)
        yield port, admin_port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
