"""Starting and stopping the component processes, with pid files so another process can stop them.

A pid file holds ``<pid> <start-time-in-clock-ticks>``: the start time (from /proc) tells a live
component from an unrelated process that reused its pid, so ``down`` never kills a stranger.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` (field 22 of /proc/<pid>/stat), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces; fields after it are split after ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _die_with_parent(sig: int = signal.SIGKILL) -> None:
    # Runs in the child: if the test runner dies hard, the kernel sends the component ``sig``.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, sig)


def start(
    *,
    name: str,
    argv: list[str],
    log_path: Path,
    pid_file: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    die_with_parent: bool = False,
    parent_death_signal: int = signal.SIGKILL,
) -> subprocess.Popen[bytes]:
    """Starts ``argv`` in its own session, output appended to ``log_path``, pid recorded.

    ``die_with_parent``: the kernel sends it ``parent_death_signal`` when this process dies (SIGKILL,
    or SIGTERM for one that must clean up on the way out)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    if cwd is not None:
        cwd.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"==> {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {name}: {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=(lambda: _die_with_parent(parent_death_signal)) if die_with_parent else None,
        )
    pid_file.write_text(f"{proc.pid} {process_start_ticks(proc.pid) or 0}\n")
    return proc


def read_pid_file(pid_file: Path) -> tuple[int, int] | None:
    try:
        pid, ticks = pid_file.read_text().split()
        return int(pid), int(ticks)
    except (FileNotFoundError, ValueError):
        return None


def pid_file_alive(pid_file: Path) -> int | None:
    """The pid recorded in ``pid_file`` if that very process still runs."""
    recorded = read_pid_file(pid_file)
    if recorded is None:
        return None
    pid, ticks = recorded
    now = process_start_ticks(pid)
    if now is None or now != ticks or is_zombie(pid):
        return None
    return pid


def terminate(pid: int, *, ticks: int, grace_s: float = 10.0, popen: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL; returns once the process is gone."""

    def alive() -> bool:
        if popen is not None:
            return popen.poll() is None
        return process_start_ticks(pid) == ticks and not is_zombie(pid)

    if not alive():
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if popen is not None:
            popen.wait(timeout=10)
        else:
            deadline = time.monotonic() + 10
            while alive() and time.monotonic() < deadline:
                time.sleep(0.05)
    elif popen is not None:
        popen.wait(timeout=1)


def stop_from_pid_file(pid_file: Path, *, grace_s: float = 10.0, popen: subprocess.Popen[bytes] | None = None) -> bool:
    """Stops the process a pid file names (if it is still that process); True if one was stopped."""
    recorded = read_pid_file(pid_file)
    stopped = False
    if recorded is not None:
        pid, ticks = recorded
        if popen is not None or (process_start_ticks(pid) == ticks):
            terminate(pid, ticks=ticks, grace_s=grace_s, popen=popen)
            stopped = True
    pid_file.unlink(missing_ok=True)
    return stopped
