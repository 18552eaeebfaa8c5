"""Faults injected into live rollouts, measured: requests lost, versions left behind, writers at once.

The figures printed here (``[faults] …`` lines) are the rows of the README's fault table. Given the
module's rollout fleet (``fleet`` in conftest.py: the operator in-cluster from its image, REPLICAS
model-server containers, a loopback load of QPS requests/s spread over every pod with an IP):

- the operator SIGKILLed in every phase of a rollout (each step's analysis, paused, a bad version
  under analysis): the restarted process resumes from status, nothing is lost;
- the API server frozen (SIGSTOP: it accepts connections and answers nothing) in the middle of a
  step: the data plane does not need it, so no request is lost; the rollout finishes afterwards;
- a model server SIGKILLed as a new version reaches it: the operator pushes again to the restarted
  server and the rollout finishes; requests that were in flight on the dead server, or sent to its
  address before it served again, fail — the load generator sends to every pod address, as a client
  with no retry and no readiness-aware balancing would.

"Lost" counts answers that are neither 200 nor an injected fault (``faultInjection`` answers 503 on
purpose): connection errors, timeouts and unexpected statuses.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

from localcluster.health import wait_for

from rollout_e2e_support import REPLICAS, Fleet


def load_delta(fleet: Fleet, before: dict[str, int]) -> Counter[str]:
    assert fleet.load is not None
    return Counter(fleet.load.stats) - Counter(before)


def lost(delta: Counter[str], *, injected_503: bool = False) -> int:
    return sum(n for status, n in delta.items() if status not in ("200", "skipped") and
               not (injected_503 and status == "503"))


def analysing(step: int, version: str):
    return lambda ro: ro.get("phase") == "Analysing" and ro.get("step") == step and ro.get("canaryVersion") == version


def test_operator_sigkill_in_every_rollout_phase(fleet: Fleet) -> None:
    assert fleet.load is not None
    before = dict(fleet.load.stats)
    stable = fleet.stable_version()
    fleet.set_rollout(analysisInterval="6s")  # room to kill inside each step's window
    new = fleet.set_params(toolGateThreshold=0.83)
    kills = 0
    for step in (1, 2):
        fleet.watch(f"step {step} analysing", analysing(step, new))
        fleet.operator.kill()
        fleet.operator.wait_restarted()
        kills += 1
    # Paused: the restarted operator keeps holding, then resumes when told.
    fleet.set_rollout(paused=True)
    fleet.watch("paused", lambda ro: ro.get("phase") == "Paused")
    held = fleet.pod_versions()
    fleet.operator.kill()
    fleet.operator.wait_restarted()
    kills += 1
    time.sleep(4)
    assert fleet.rollout()["phase"] == "Paused" and fleet.pod_versions() == held
    fleet.set_rollout(paused=False)
    fleet.watch("step 3 analysing", analysing(3, new))
    fleet.operator.kill()
    fleet.operator.wait_restarted()
    kills += 1
    fleet.watch("promotion", lambda ro: ro.get("phase") == "Succeeded" and fleet.stable_version() == new)
    assert set(fleet.pod_versions().values()) == {new} and stable != new
    good = load_delta(fleet, before)

    # A bad version under analysis when the operator dies: the new process still rolls it back.
    before = dict(fleet.load.stats)
    bad = fleet.set_params(toolGateThreshold=0.81, faultInjection={"errorRate": 0.3})
    fleet.watch("bad version at step 1", lambda ro: ro.get("step") == 1 and ro.get("canaryVersion") == bad)
    fleet.operator.kill()
    fleet.operator.wait_restarted()
    kills += 1
    fleet.watch("rollback after restart", lambda ro: ro.get("phase") == "RolledBack" and ro.get("rejectedVersion") == bad)
    assert set(fleet.pod_versions().values()) == {new}
    fleet.set_rollout(analysisInterval="4s")
    bad_delta = load_delta(fleet, before)
    total = sum(good.values()) + sum(bad_delta.values())
    print(f"\n[faults] operator SIGKILL x{kills} (steps 1, 2, paused, 3, bad version at step 1): "
          f"{total} requests, lost {lost(good) + lost(bad_delta, injected_503=True)}, "
          f"injected 503s {bad_delta.get('503', 0)}; rollout Succeeded / RolledBack as without the kills")
    assert lost(good) == 0, good
    assert lost(bad_delta, injected_503=True) == 0, bad_delta


def test_api_server_frozen_mid_step_loses_no_request(fleet: Fleet) -> None:
    assert fleet.load is not None
    fleet.set_rollout(analysisInterval="6s")
    new = fleet.set_params(toolGateThreshold=0.79)
    fleet.watch("step 2 analysing", analysing(2, new))
    pid = int(fleet.stack.cluster.layout.pid_file("kube-apiserver").read_text().split()[0])
    restarts = fleet.operator.restart_count()
    before = dict(fleet.load.stats)
    frozen_s = 20.0
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(frozen_s)
        during = load_delta(fleet, before)
    finally:
        os.kill(pid, signal.SIGCONT)
    # The operator may give up leadership while it cannot renew its Lease (it exits and restarts, as a
    # leader election's loser should): those restarts are this fault's, not unexpected ones.
    wait_for(lambda: fleet.stack.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
             what="API server answering again", timeout_s=60)
    base = fleet.operator.expected_restarts
    settled: list[int] = []

    def restarts_settled() -> bool:
        fleet.operator.pod()  # a Ready operator
        settled.append(fleet.operator.restart_count())
        return len(settled) >= 6 and len(set(settled[-6:])) == 1

    wait_for(restarts_settled, what="the operator Ready with a stable restart count", timeout_s=120, interval_s=1.0)
    fleet.operator.expected_restarts = base + settled[-1] - restarts
    fleet.watch("promotion after the outage", lambda ro: ro.get("phase") == "Succeeded" and fleet.stable_version() == new,
                timeout=180)
    fleet.set_rollout(analysisInterval="4s")
    exits = fleet.operator.restart_count() - restarts
    print(f"\n[faults] API server frozen {frozen_s:.0f}s at step 2: {sum(during.values())} requests during the "
          f"outage, lost {lost(during)}; operator restarts {exits}; rollout Succeeded afterwards")
    assert lost(during) == 0, during
    assert sum(during.values()) > 0.5 * frozen_s  # the load really ran through the outage


def test_model_server_sigkill_as_a_version_arrives(fleet: Fleet) -> None:
    assert fleet.load is not None
    fleet.set_rollout(analysisInterval="4s")
    before = dict(fleet.load.stats)
    new = fleet.set_params(toolGateThreshold=0.77)
    # The first canary pod is chosen by the operator: kill the server of the pod it pushes to, as
    # soon as the new version is in status (the push follows within the same tick).
    fleet.watch("canary chosen", lambda ro: ro.get("canaryVersion") == new and ro.get("step") == 1)
    canary = fleet.rollout().get("canaryPods") or []
    victim = next((p for p in fleet.pods() if p["metadata"]["name"] in canary), fleet.pods()[0])
    fleet.stack.kill_container(victim, "server")
    fleet.watch("promotion after the crash", lambda ro: ro.get("phase") == "Succeeded" and fleet.stable_version() == new,
                timeout=240)
    wait_for(lambda: set(fleet.pod_versions().values()) == {new}, what="every pod on the new version", timeout_s=60)
    fleet.set_rollout(analysisInterval="4s")
    delta = load_delta(fleet, before)
    print(f"\n[faults] model server SIGKILL as the canary push arrives: {sum(delta.values())} requests, lost "
          f"{lost(delta)} (in flight on, or sent to, the dead server before it served again); rollout Succeeded, "
          f"the restarted server re-pushed")
    assert lost(delta) < sum(delta.values())  # the rest of the fleet kept serving
