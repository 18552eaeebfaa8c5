"""A leader cut off from the API server stops before a standby takes over: never two writers.

Given two ``sparsegate run --leader-elect`` processes on the host (default durations: lease 15 s,
renew deadline 10 s, retry 2 s), each as its own ServiceAccount (the chart's operator RBAC) and
each reaching the API server through its own TCP proxy, on a control plane that audits every
write; A leads and reconciles a SparseModel that the test keeps changing (so a leader writes
all the time).
When A's proxy is cut (open connections torn down; new ones blackholed, or reset at once: a
connection error that is no API error, which once killed the renewal thread silently),
Then A exits on its own (status 1, "leader election lost") within its renew deadline, B takes
the Lease only after that and within lease + retries + slack, and B reconciles;
And after A's proxy is healed and A restarts (as its pod would) it stays a standby; in the audit
log no write by A's identity is ever received after B's first write.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from localcluster import LocalCluster
from localcluster.health import wait_for
from localcluster.ports import pick_unused_pod_cidr

from partition_support import (CHART, LEASE, CuttableProxy, OperatorProcess, apiserver_address, audited_writes,
                               grant_chart_rbac, service_account_user, token_kubeconfig)

REPO = Path(__file__).resolve().parents[3]
LEASE_S, RENEW_DEADLINE_S, RETRY_S = 15, 10.0, 2.0  # the CLI defaults the processes run with
# Standbys poll every retry·U(1, 1.2); B may see A's last renewal up to one poll late, and acquires
# on its first poll past the lease; start-up and a loaded 2-core machine get the slack.
TAKEOVER_BOUND_S = LEASE_S + 2 * RETRY_S * 1.2 + 5


@pytest.fixture(scope="module")
def audited_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A control plane of its own: the session one runs without the (opt-in) audit log."""
    local = LocalCluster(state_dir=tmp_path_factory.mktemp("audited"), pod_cidr=pick_unused_pod_cidr(),
                         audit_log=True)
    local.start()
    sys.stderr.write(f"\n[e2e] audited cluster up in {local.timings['total']:.1f}s\n")
    try:
        yield local
    finally:
        local.stop()


def lease_holder(cluster: LocalCluster, namespace: str) -> str | None:
    run = cluster.kubectl("get", "lease", LEASE, "-n", namespace, "-o", "json", check=False)
    return (json.loads(run.stdout).get("spec") or {}).get("holderIdentity") if run.returncode == 0 else None


@pytest.mark.parametrize("cut", ["blackhole", "reset"])
def test_partitioned_leader_stops_before_the_standby_writes(audited_cluster: LocalCluster, tmp_path: Path,
                                                            cut: str):
    cluster = audited_cluster
    ns = f"partition-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    cluster.kubectl("create", "namespace", ns)
    for sa in ("op-a", "op-b"):
        cluster.kubectl("create", "serviceaccount", sa, "-n", ns)
    grant_chart_rbac(cluster, namespace=ns, service_accounts=["op-a", "op-b"])
    user_a, user_b = service_account_user(ns, "op-a"), service_account_user(ns, "op-b")

    proxies = {sa: CuttableProxy(apiserver_address(cluster), mode=cut) for sa in ("op-a", "op-b")}
    kubeconfigs = {sa: token_kubeconfig(cluster, path=tmp_path / f"{sa}.kubeconfig", server=proxies[sa].url,
                                        namespace=ns, service_account=sa) for sa in proxies}
    procs: list[OperatorProcess] = []

    def start(sa: str, log: str) -> OperatorProcess:
        p = OperatorProcess.start(identity=sa, kubeconfig=kubeconfigs[sa], namespace=ns, log=tmp_path / log)
        procs.append(p)
        return p

    def poke(n: int) -> None:
        # A spec change every second: whoever leads reconciles it (Deployment apply, status patch).
        cluster.kubectl("patch", "sparsemodel", "moe-small", "-n", ns, "--type=merge",
                        "-p", json.dumps({"spec": {"replicas": 1 + n % 2}}))

    try:
        a = start("op-a", "a.log")
        wait_for(lambda: a.leads() or a.proc.poll() is not None, what="A leading", timeout_s=60, interval_s=0.2)
        assert a.leads(), a.text()[-3000:]
        for example in ("gateconfig.yaml", "sparsemodel.yaml"):
            cluster.kubectl("apply", "-n", ns, "-f", str(REPO / "examples" / example))
        wait_for(lambda: cluster.kubectl("get", "deployment", "moe-small", "-n", ns, check=False).returncode == 0,
                 what="A's Deployment for moe-small", timeout_s=60, interval_s=0.5)
        b = start("op-b", "b.log")
        # B waits as a standby while A renews: it never leads while A is connected.
        wait_for(lambda: "standing by" in b.text() or b.proc.poll() is not None, what="B standing by",
                 timeout_s=60, interval_s=0.5)
        for n in range(6):
            poke(n)
            time.sleep(1)
        assert lease_holder(cluster, ns) == "op-a" and not b.leads() and b.proc.poll() is None, b.text()[-3000:]

        # When: A is partitioned from the API server.
        t_cut = time.time()
        proxies["op-a"].cut()
        a_exit = b_lead = None
        n = 6
        while time.time() - t_cut < TAKEOVER_BOUND_S + 10 and (a_exit is None or b_lead is None):
            if a_exit is None and a.proc.poll() is not None:
                a_exit = time.time()
            if b_lead is None and lease_holder(cluster, ns) == "op-b":
                b_lead = time.time()
            if int(time.time() - t_cut) > n - 6:  # keep the models changing (~1/s)
                poke(n)
                n += 1
            time.sleep(0.1)
        assert a_exit is not None, f"A did not stop when cut off:\n{a.text()[-3000:]}"
        assert a.proc.returncode == 1 and "leader election lost" in a.text(), a.text()[-3000:]
        assert b_lead is not None, f"B did not take over:\n{b.text()[-3000:]}"
        assert a_exit - t_cut < RENEW_DEADLINE_S + 1, f"A acted {a_exit - t_cut:.1f}s after the cut"
        assert b_lead - t_cut < TAKEOVER_BOUND_S, f"takeover took {b_lead - t_cut:.1f}s"

        # Heal A's network; A restarts as its pod would, and must stay a standby.
        proxies["op-a"].heal()
        a2 = start("op-a", "a2.log")
        t_heal = time.time()
        while time.time() - t_heal < 10:
            poke(n)
            n += 1
            time.sleep(1)
        assert a2.proc.poll() is None and not a2.leads() and lease_holder(cluster, ns) == "op-b", a2.text()[-3000:]
        assert b.proc.poll() is None and b.leads()
        # Stop the standby first, so B's clean release hands nothing to A. (A standby has no
        # SIGTERM handler: it ends on the signal's default action.)
        assert a2.stop() == -signal.SIGTERM
        assert b.stop() == 0

        # Then: the audit log's writes by each identity, on the API server's clock.
        writes = audited_writes(cluster, {user_a, user_b})
        by_a = [w for w in writes if w.user == user_a]
        by_b = [w for w in writes if w.user == user_b]
        assert by_a and by_b, writes
        b_first = by_b[0]
        assert (b_first.resource, b_first.name) == ("leases", LEASE), b_first  # B's first write: taking the Lease
        # B reconciled the models it now leads for, not only its Lease.
        assert any(w.resource != "leases" and w.received > b_first.received for w in by_b), by_b
        overlap = [w for w in by_a if w.received >= b_first.received or w.completed >= b_first.received]
        a_last = max(w.completed for w in by_a)
        gap_exit_s = b_first.received - a_exit
        sys.stderr.write(
            f"\n[e2e] partition ({cut}): A exited {a_exit - t_cut:.1f}s after the cut; B took the Lease "
            f"{b_first.received - t_cut:.1f}s after the cut, {gap_exit_s:.1f}s after A exited; "
            f"A's last write completed {b_first.received - a_last:.1f}s before B's first; "
            f"writes A {len(by_a)}, B {len(by_b)}; double writers observed: {len(overlap)}\n")
        assert not overlap, f"A wrote after B's first write: {overlap}"
        assert a_last < b_first.received
        assert gap_exit_s > 0, "B took the Lease before A had exited"
    finally:
        for p in reversed(procs):
            p.stop(timeout_s=15)
        for proxy in proxies.values():
            proxy.close()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
