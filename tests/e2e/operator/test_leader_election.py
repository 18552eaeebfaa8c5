"""Two operators, one Lease: only the leader reconciles; a clean stop hands over at once.

Runs with the admin kubeconfig and its own Lease name and namespace so it does not disturb the
session operator (whose RBAC, Lease included, the lifecycle tests prove). That operator may be
running too, so "the new leader works" is shown by Kopf answering its liveness endpoint, not by
a model becoming Ready (either operator could have done that).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from operator_e2e_support import RELEASE_NS, free_port, get_json, wait_for

LEASE = "e2e-ha"


def start(cluster, namespace: str, name: str, work: Path) -> tuple[subprocess.Popen, Path, int]:
    port = free_port()
    log = work / f"{name}.log"
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "POD_NAME": name}
    argv = [str(Path(sys.executable).with_name("sparsegate")), "run", "--standalone",
            f"--namespace={namespace}", f"--liveness=http://127.0.0.1:{port}/healthz",
            "--leader-elect", f"--lease-name={LEASE}", f"--lease-namespace={RELEASE_NS}"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return proc, log, port


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
    return proc.returncode


def leads(log: Path) -> bool:
    return b"leading as" in log.read_bytes()


def test_standby_takes_over_when_the_leader_stops(cluster, sparsegate_release, namespace, tmp_path):
    a, a_log, _ = start(cluster, namespace, "op-a", tmp_path)
    try:
        wait_for("op-a to lead", lambda: leads(a_log), timeout=60)
        b, b_log, b_port = start(cluster, namespace, "op-b", tmp_path)
        try:
            # The standby answers liveness (so it is not restarted) but does not lead.
            def standby_live():
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{b_port}/healthz", timeout=2) as r:
                        return b"standby" in r.read()
                except OSError:
                    return False
            wait_for("op-b standby liveness", standby_live, timeout=30)
            assert not leads(b_log)
            lease = get_json(cluster, "lease", LEASE, "-n", RELEASE_NS)
            assert lease["spec"]["holderIdentity"] == "op-a"

            # The leader stops cleanly: it releases the Lease, and the standby leads and works.
            assert stop(a) == 0
            t0 = time.monotonic()
            wait_for("op-b to take over", lambda: leads(b_log), timeout=30)
            takeover_s = time.monotonic() - t0
            assert takeover_s < 15, f"takeover took {takeover_s:.1f}s (the Lease was not released?)"
            # Kopf itself now answers op-b's liveness (its probe results, not the standby reply).
            def kopf_live():
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{b_port}/healthz", timeout=2) as r:
                        return json.loads(r.read()).get("handlers") == "ok"
                except (OSError, ValueError):
                    return False
            wait_for("Kopf's liveness endpoint on the new leader", kopf_live, timeout=30)
            assert b.poll() is None
            assert get_json(cluster, "lease", LEASE, "-n", RELEASE_NS)["spec"]["holderIdentity"] == "op-b"
        finally:
            stop(b)
    finally:
        stop(a)
