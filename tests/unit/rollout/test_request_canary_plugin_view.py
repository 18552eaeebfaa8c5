"""kubectl sparsegate status under strategy requests: the canary line says the share is of requests."""

from __future__ import annotations

from sparsegate.kubectl_plugin.view import status_view


def gateconfig(**rollout: object) -> dict:
    return {"metadata": {"namespace": "ns", "name": "gate"}, "spec": {"rollout": {"steps": [5, 20, 100]}},
            "status": {"stable": {"version": "g-aaaaaaaaaaaa"},
                       "rollout": {"phase": "Analysing", "step": 1, "steps": 3, "canaryPercent": 5,
                                   "canaryVersion": "g-bbbbbbbbbbbb", "canaryInstances": "2/2", **rollout}}}


def test_status_names_the_share_of_requests_or_of_instances() -> None:
    text = status_view(gateconfig(strategy="requests", canaryWeight=0.05))
    assert "Canary:     g-bbbbbbbbbbbb  5% of requests (weight 0.05) on all 2 instances" in text
    assert "5% target, 2/2 instances" in status_view(gateconfig())
