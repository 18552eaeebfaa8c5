"""Readiness probes for the components: poll their health endpoints, never sleep blindly."""

from __future__ import annotations

import asyncio
import http.client
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


class StartupError(RuntimeError):
    """A component exited or did not become healthy in time."""


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def http_get(url_host: str, port: int, path: str, *, context: ssl.SSLContext | None, timeout: float = 2.0) -> tuple[int, str]:
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection(url_host, port, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection(url_host, port, timeout=timeout, context=context)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def client_tls(*, ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def insecure_tls() -> ssl.SSLContext:
    # controller-manager and scheduler serve self-signed certs on loopback; only their health is read.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def wait_until(
    check: Callable[[], bool],
    *,
    what: str,
    timeout_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    interval_s: float = 0.1,
) -> float:
    """Polls ``check`` until true; fails fast if ``proc`` exits. Returns seconds waited."""
    start = time.monotonic()
    last_error = ""
    while True:
        if proc is not None and proc.poll() is not None:
            raise StartupError(f"{what}: process exited with {proc.returncode}; log tail:\n{_tail(log) if log else ''}")
        try:
            if check():
                return time.monotonic() - start
        except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() - start > timeout_s:
            tail = f"; log tail:\n{_tail(log)}" if log else ""
            raise StartupError(f"{what}: not healthy after {timeout_s:.0f}s ({last_error}){tail}")
        time.sleep(interval_s)


def endpoint_ok(host: str, port: int, path: str, *, context: ssl.SSLContext | None, expect: str | None = None) -> Callable[[], bool]:
    def check() -> bool:
        status, body = http_get(host, port, path, context=context)
        return status == 200 and (expect is None or expect in body)

    return check


def wait_for(check: Callable[[], object], *, what: str, timeout_s: float = 60.0, interval_s: float = 0.25) -> object:
    """Polls ``check`` until it returns something truthy and returns that (tests' Given/Then waits);
    fails the calling test with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (result := _poll(check, deadline=deadline, what=what)):
        time.sleep(interval_s)
    return result


async def wait_for_async(check: Callable[[], object], *, what: str, timeout_s: float = 60.0,
                         interval_s: float = 0.25) -> object:
    """:func:`wait_for` for a test running on an event loop: it sleeps with asyncio, so the loop's
    tasks run while it waits."""
    deadline = time.monotonic() + timeout_s
    while not (result := _poll(check, deadline=deadline, what=what)):
        await asyncio.sleep(interval_s)
    return result


def _poll(check: Callable[[], object], *, deadline: float, what: str) -> object:
    """One try of :func:`wait_for` / :func:`wait_for_async`: ``check``'s result, or the test fails
    when it is falsy past ``deadline``."""
    result = check()
    assert result or time.monotonic() < deadline, f"timed out waiting for {what}"
    return result
