"""Two operator replicas, one Lease: only the leader runs Kopf; when its pod goes, the standby leads.

The chart's Deployment on the dev stack, scaled to two replicas with ``helm upgrade``
(``operator.replicas=2``): both pods run the operator image as the chart's ServiceAccount and elect
on the chart's Lease. The leader's pod is deleted as a drain would (nodes cordoned first, so the
Deployment's replacement pod cannot start and race the waiting standby for the Lease); its operator
stops cleanly, releases the Lease, and the standby leads at once. Replicas are restored after.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time

from localcluster.health import wait_for

from operator_e2e_support import (LEASE, LIVENESS_PORT, RELEASE_NS, get_json, http_get, kopf_live, lease_holder, leader,
                                  operator_restarts)


def ready_pods(stack) -> list[dict]:
    return [p for p in stack.operator_pods()
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]


def standby_live(pod: dict) -> bool:
    """The standby answers liveness (so it is not restarted for waiting) with its own reply."""
    try:
        return json.loads(http_get(pod, LIVENESS_PORT, "/healthz", timeout=2)[1]).get("standby") is True
    except (OSError, ValueError):
        return False


def leads(stack, pod: dict) -> bool:
    return "leading as" in stack.logs(pod, "operator", lines=2000)


def lease_history(stack, since: str) -> list[str | None]:
    """The Lease's holder after each change since resourceVersion ``since`` (a watch replays them all)."""
    from kubernetes import client, config, watch

    api = client.CoordinationV1Api(config.new_client_from_config(config_file=str(stack.cluster.kubeconfig)))
    holders = []
    for event in watch.Watch().stream(api.list_namespaced_lease, RELEASE_NS, field_selector=f"metadata.name={LEASE}",
                                      resource_version=since, timeout_seconds=2):
        holders.append(event["object"].spec.holder_identity)
    return holders


def stop_timeline(log: str) -> str:
    """Seconds from the SIGTERM log line to Kopf's end and to the Lease's release (podman's timestamps)."""
    marks = {"SIGTERM": "Signal SIGTERM is received", "Kopf stopped": "Kopf has stopped",
             "released": "released the Lease", "release failed": "could not release"}
    at: dict[str, datetime.datetime] = {}
    for line in log.splitlines():
        stamp, _, text = line.partition(" ")
        for mark, needle in marks.items():
            if needle in text and mark not in at:
                try:  # podman: 2026-12-04T21:55:41.749123456Z (nanoseconds: cut to microseconds)
                    at[mark] = datetime.datetime.fromisoformat(stamp[:26].rstrip("Z"))
                except ValueError:
                    pass
    if "SIGTERM" not in at:
        return "no SIGTERM line"
    return ", ".join(f"{m} +{(t - at['SIGTERM']).total_seconds():.1f}s" for m, t in at.items() if m != "SIGTERM")


def set_schedulable(stack, schedulable: bool) -> None:
    for node in get_json(stack, "nodes")["items"]:
        stack.kubectl("uncordon" if schedulable else "cordon", node["metadata"]["name"])


def test_standby_takes_over_when_the_leader_goes(stack, tmp_path):
    leader(stack)  # one operator leads before the upgrade
    stack.install("--set", "operator.replicas=2")
    try:
        pods = wait_for(lambda: (r := ready_pods(stack)) and len(r) == 2 and r, what="2 operator pods Ready",
                        timeout_s=180, interval_s=1.0)
        holder = wait_for(lambda: (h := lease_holder(stack)) in {p["metadata"]["name"] for p in pods} and h,
                          what="an operator pod holding the Lease", timeout_s=60)
        first = next(p for p in pods if p["metadata"]["name"] == holder)
        standby = next(p for p in pods if p["metadata"]["name"] != holder)

        # The standby answers liveness but does not lead; the leader runs Kopf.
        wait_for(lambda: standby_live(standby), what="standby liveness", timeout_s=30)
        wait_for(lambda: kopf_live(first), what="Kopf's liveness on the leader", timeout_s=30)
        assert leads(stack, first) and not leads(stack, standby)

        restarts = operator_restarts(stack)
        set_schedulable(stack, False)
        try:
            # The leader's pod goes: its operator stops cleanly and releases the Lease, and the standby
            # leads and works, well before the Lease (15 s) could have expired.
            since = get_json(stack, "lease", LEASE, "-n", RELEASE_NS)["metadata"]["resourceVersion"]
            # The old leader's last words (how long its stop took), readable after its pod is gone.
            stopping_log = tmp_path / "old-leader.log"
            follower = stack.follow_logs(first, "operator", stopping_log)
            # The pod's object stays until its operator has stopped (the dev pod runner deletes it
            # then, as a kubelet does), so the stopping leader's ServiceAccount token still
            # authenticates its Lease release.
            pod_ref = ("pod", first["metadata"]["name"], "-n", RELEASE_NS)
            t0 = time.monotonic()
            stack.kubectl("delete", *pod_ref, "--wait=false")
            wait_for(lambda: lease_holder(stack) == standby["metadata"]["name"], what="the standby to take over",
                     timeout_s=30, interval_s=0.2)
            takeover_s = time.monotonic() - t0
            try:
                follower.wait(timeout=10)
            except subprocess.TimeoutExpired:
                follower.kill()
            last_words = stopping_log.read_text(errors="replace")[-6000:]
            sys.stderr.write(f"\n[e2e] old leader's stop: {stop_timeline(last_words)}\n")
            # Every change of the Lease since, from the API server's watch: the old leader released it
            # (which it does only on a clean stop) before the standby claimed it.
            seen = lease_history(stack, since)
            holders = [h for i, h in enumerate(seen) if i == 0 or seen[i - 1] != h]
            assert holders[-2:] == [None, standby["metadata"]["name"]], f"{holders}\n--- old leader:\n{last_words}"
            assert takeover_s < 15, f"takeover took {takeover_s:.1f}s (the Lease was not released?)\n{last_words}"
            sys.stderr.write(f"\n[e2e] standby leads {takeover_s:.1f}s after the leader's pod was deleted\n")
            # Kopf itself now answers the new leader's liveness (its probe results, not the standby reply).
            wait_for(lambda: kopf_live(standby), what="Kopf's liveness endpoint on the new leader", timeout_s=30)
            assert leads(stack, standby)
            # The standby's container was not restarted to lead: the same process took over.
            key = f"{standby['metadata']['name']}/operator"
            assert operator_restarts(stack)[key] == restarts[key]
        finally:
            set_schedulable(stack, True)

        # The Deployment's replacement pod starts as the new standby; the Lease stays where it is.
        replacement = wait_for(lambda: next((p for p in ready_pods(stack) if p["metadata"]["name"] not in
                                             {first["metadata"]["name"], standby["metadata"]["name"]}), None),
                               what="the replacement operator pod Ready", timeout_s=180, interval_s=1.0)
        wait_for(lambda: standby_live(replacement), what="the replacement's standby liveness", timeout_s=30)
        assert lease_holder(stack) == standby["metadata"]["name"]
    finally:
        stack.install()  # operator.replicas back to the chart default (1)
        wait_for(lambda: len(stack.operator_pods()) == 1, what="one operator pod again", timeout_s=120,
                 interval_s=1.0)
        leader(stack, timeout_s=120)
