"""Rollout gauges under strategy requests: pods report their set key (stable + canary at a
weight); they hold the canary, so they count as canary pods, not as "other"."""

from __future__ import annotations

from sparsegate_contracts.canary import set_key

from sparsegate.domain.rollout_gauges import Role, rollout_gauges

STABLE, CANARY, OLD = "g-aaaaaaaaaaaa", "g-bbbbbbbbbbbb", "g-cccccccccccc"


def test_pods_holding_the_set_count_as_canary_pods() -> None:
    held = set_key(STABLE, CANARY, 0.05)
    status = {"stable": {"version": STABLE},
              "rollout": {"phase": "Analysing", "step": 1, "steps": 3, "canaryPercent": 5, "canaryWeight": 0.05,
                          "strategy": "requests", "canaryVersion": CANARY, "canaryInstances": "3/3",
                          "podVersions": {"p0": held, "p1": held, "p2": STABLE,
                                          "p3": set_key(STABLE, OLD, 0.05)}}}
    g = rollout_gauges(status)
    assert (g.canary_percent, g.canary_instances, g.instances) == (5, 3, 3)
    assert g.pods == {Role.STABLE: 1, Role.CANARY: 2, Role.OTHER: 1}
