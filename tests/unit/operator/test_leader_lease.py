"""Leader-election decisions over a Lease."""

from __future__ import annotations

import datetime

from sparsegate.domain import lease

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)


def held(by, *, renewed_ago_s, duration=15):
    return {"metadata": {"name": "l", "namespace": "ns", "resourceVersion": "7"},
            "spec": {"holderIdentity": by, "leaseDurationSeconds": duration,
                     "renewTime": lease.format_time(NOW - datetime.timedelta(seconds=renewed_ago_s))}}


def test_fresh_lease_of_another_blocks():
    assert not lease.can_acquire(held("b", renewed_ago_s=5), identity="a", now=NOW)


def test_expired_or_own_lease_can_be_taken():
    assert lease.can_acquire(held("b", renewed_ago_s=16), identity="a", now=NOW)
    assert lease.can_acquire(held("a", renewed_ago_s=5), identity="a", now=NOW)
    assert lease.can_acquire({"spec": {}}, identity="a", now=NOW)


def test_claim_counts_transitions_and_keeps_resource_version():
    taken = lease.claimed(held("b", renewed_ago_s=30), name="l", namespace="ns", identity="a",
                          duration_s=15, now=NOW)
    assert taken["spec"]["holderIdentity"] == "a" and taken["spec"]["leaseTransitions"] == 1
    assert taken["metadata"]["resourceVersion"] == "7"
    assert lease.parse_time(taken["spec"]["renewTime"]) == NOW
    renewed = lease.claimed(taken, name="l", namespace="ns", identity="a", duration_s=15, now=NOW)
    assert renewed["spec"]["leaseTransitions"] == 1
    fresh = lease.claimed(None, name="l", namespace="ns", identity="a", duration_s=15, now=NOW)
    assert "resourceVersion" not in fresh["metadata"] and fresh["spec"]["leaseTransitions"] == 0
