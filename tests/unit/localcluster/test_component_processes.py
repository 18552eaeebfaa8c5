"""Pid files, stopping by pid file, certificates from the real openssl."""

import subprocess
import sys
from pathlib import Path

from localcluster import pki, processes
from localcluster.config import cert_specs


def test_start_and_stop_by_pid_file(tmp_path: Path) -> None:
    proc = processes.start(
        name="sleeper", argv=[sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        log_path=tmp_path / "logs" / "sleeper.log", pid_file=tmp_path / "sleeper.pid",
    )
    try:
        assert processes.pid_file_alive(tmp_path / "sleeper.pid") == proc.pid
        assert processes.stop_from_pid_file(tmp_path / "sleeper.pid", grace_s=5, popen=proc)
        assert proc.returncode is not None
        assert not (tmp_path / "sleeper.pid").exists()
        assert "starting sleeper" in (tmp_path / "logs" / "sleeper.log").read_text()
    finally:
        proc.kill()
        proc.wait()


def test_stale_pid_file_with_reused_pid_is_not_killed(tmp_path: Path) -> None:
    # Our own pid with a wrong start time stands for "pid reused by a stranger".
    import os

    pid_file = tmp_path / "x.pid"
    pid_file.write_text(f"{os.getpid()} 1\n")
    assert processes.pid_file_alive(pid_file) is None
    assert not processes.stop_from_pid_file(pid_file)


def test_sigkill_after_grace_when_sigterm_is_ignored(tmp_path: Path) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    proc = processes.start(name="stubborn", argv=[sys.executable, "-c", code], log_path=tmp_path / "s.log", pid_file=tmp_path / "s.pid")
    try:
        # Wait until the handler is installed (the child prints a bare "ready" line after it).
        while "ready" not in (tmp_path / "s.log").read_text().splitlines():
            assert proc.poll() is None
        processes.stop_from_pid_file(tmp_path / "s.pid", grace_s=0.3, popen=proc)
        assert proc.returncode == -9
    finally:
        proc.kill()
        proc.wait()


def test_openssl_issues_certs_the_ca_verifies(tmp_path: Path) -> None:
    pki.ensure_ca(tmp_path)
    for spec in cert_specs():
        pki.ensure_cert(tmp_path, spec)
    pki.ensure_service_account_keys(tmp_path)
    out = subprocess.run(
        ["openssl", "verify", "-CAfile", "ca.crt", "kube-apiserver.crt", "admin.crt"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout
    assert "kube-apiserver.crt: OK" in out and "admin.crt: OK" in out
    text = subprocess.run(["openssl", "x509", "-in", "admin.crt", "-noout", "-subject"], cwd=tmp_path,
                          capture_output=True, text=True, check=True).stdout
    assert "O = system:masters" in text and "CN = kubernetes-admin" in text
    san = subprocess.run(["openssl", "x509", "-in", "kube-apiserver.crt", "-noout", "-ext", "subjectAltName"],
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in san
    # Keys are kept on a second call: a restarted cluster must keep its signing keys.
    before = (tmp_path / "sa.key").read_bytes()
    pki.ensure_service_account_keys(tmp_path)
    assert (tmp_path / "sa.key").read_bytes() == before


def test_a_pod_runner_that_dies_at_start_is_not_taken_for_up_by_an_earlier_run_s_log(tmp_path: Path) -> None:
    # `localcluster up --containers` again on the same state dir (after `down`): the log is appended
    # to, and the earlier runner's "synced:" line must not count as this runner's first pass.
    import pytest

    from localcluster.cluster import POD_RUNNER, LocalCluster
    from localcluster.health import StartupError

    cluster = LocalCluster(state_dir=tmp_path, containers=True)
    log = cluster.layout.log(POD_RUNNER)
    log.parent.mkdir(parents=True)
    log.write_text("2026-12-07 10:00:00,000 podrunner INFO synced: 3 pods\n")
    # No kubeconfig in this state dir: this runner exits at once.
    with pytest.raises(StartupError, match="podrunner: process exited"):
        cluster._start_pod_runner()
    cluster.stop()
