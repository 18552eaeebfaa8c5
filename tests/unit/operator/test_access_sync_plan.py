"""domain.access_sync: the access document a model's pods need, which pods get a push, and what
condition AccessRulesApplied / status.accessRevision say (pure)."""

from __future__ import annotations

import pytest

from sparsegate.domain import access_sync
from sparsegate.domain.access_sync import PodAccess
from sparsegate.domain.policy import PolicySource


def _model(access=None, *, ns="ml", name="moe"):
    spec = {"model": {"dModel": 64, "experts": 4}, "expertGroups": [{"name": "a", "experts": [0, 1]}]}
    if access is not None:
        spec["access"] = access
    return {"metadata": {"namespace": ns, "name": name, "uid": "u1", "generation": 3}, "spec": spec}


def _policy(name, ns="ml", **spec):
    return PolicySource(namespace=ns, name=name, generation=1, spec=spec)


ALLOW_A = _policy("allow-a", action="Allow", sources=[{"serviceAccount": "caller-a"}],
                  targets=[{"sparseModel": "moe", "expertGroups": ["a"]}])
DENY_B = _policy("deny-b", action="Deny", sources=[{"serviceAccount": "caller-b"}],
                 targets=[{"sparseModel": "moe"}])
OTHER_NS = _policy("elsewhere", ns="other", action="Allow", sources=[{"serviceAccount": "x"}],
                   targets=[{"sparseModel": "moe"}])


def test_enforced_only_with_enforce():
    assert access_sync.enforced(_model({"requestAuth": "Enforce"}))
    assert not access_sync.enforced(_model({"requestAuth": "Off"}))
    assert not access_sync.enforced(_model())


def test_document_holds_the_models_namespace_rules_and_changes_with_them():
    doc = access_sync.model_document(_model(), [ALLOW_A, DENY_B, OTHER_NS], trust_domain="cluster.local")
    assert doc["model"] == "ml/moe" and doc["enforced"] is True
    assert sorted(r["id"] for r in doc["rules"]) == ["ml/allow-a#s0t0", "ml/deny-b#s0t0"]
    assert doc == access_sync.model_document(_model(), [DENY_B, OTHER_NS, ALLOW_A], trust_domain="cluster.local")
    fewer = access_sync.model_document(_model(), [ALLOW_A], trust_domain="cluster.local")
    assert fewer["revision"] != doc["revision"]
    none = access_sync.model_document(_model(), [OTHER_NS], trust_domain="cluster.local")
    assert none["enforced"] is False and none["rules"] == []


def test_unreadable_policy_spec_raises():
    with pytest.raises((ValueError, KeyError, TypeError)):
        access_sync.model_document(_model(), [_policy("bad", action="Maybe", sources=[{}], targets=[])],
                                   trust_domain="cluster.local")


def test_push_to_pods_that_answered_without_the_revision():
    held = {"p1": PodAccess("p1", "sha256:new"), "p2": PodAccess("p2", "sha256:old"),
            "p3": PodAccess("p3", None), "p4": PodAccess("p4", None, error="timeout")}
    # p4 did not answer (a PUT would fail alike), p5 was not asked: neither is pushed to this round.
    assert access_sync.pods_to_push("sha256:new", reachable=["p5", "p4", "p3", "p2", "p1"], held=held) == \
        ["p2", "p3"]


def test_condition_true_only_when_every_live_pod_holds_the_revision():
    held = {"p1": PodAccess("p1", "r1"), "p2": PodAccess("p2", "r1")}
    ok = access_sync.condition(revision="r1", rules=2, pods=["p1", "p2"], held=held)
    assert (ok["status"], ok["reason"]) == ("True", access_sync.ALL_PODS_HOLD)
    assert "2/2 pods hold revision r1 (2 rules)" in ok["message"]
    # p3 has no address yet, p2 answered an error: False, each named with why.
    held["p2"] = PodAccess("p2", "r0", error="PUT /admin/access 422: bad")
    not_yet = access_sync.condition(revision="r1", rules=2, pods=["p1", "p2", "p3"], held=held,
                                    withheld={"fake": "no owner"})
    assert (not_yet["status"], not_yet["reason"]) == ("False", access_sync.NOT_APPLIED)
    assert "1/3 pods" in not_yet["message"] and "p2: PUT /admin/access 422" in not_yet["message"]
    assert "p3: no address yet" in not_yet["message"] and "fake" in not_yet["message"]
    assert access_sync.condition(revision="r1", pods=[], held={})["reason"] == access_sync.NO_PODS
    bad = access_sync.condition(revision=None, pods=["p1"], held={}, error="ValueError: x")
    assert (bad["status"], bad["reason"]) == ("False", access_sync.RULES_INVALID)


def test_condition_message_lists_a_few_pods_and_counts_the_rest():
    pods = [f"p{i}" for i in range(9)]
    message = access_sync.condition(revision="r", pods=pods, held={}, rules=0)["message"]
    assert "p4: no address yet and 4 more" in message


def test_status_patch_writes_on_change_only_and_keeps_other_conditions():
    ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
    wanted = access_sync.condition(revision="r1", rules=1, pods=["p1"], held={"p1": PodAccess("p1", "r1")})
    patch = access_sync.status_patch({"conditions": [ready]}, wanted=wanted, revision="r1", generation=3,
                                      now="2026-02-02T00:00:00Z")
    assert patch is not None and patch["accessRevision"] == "r1"
    assert patch["conditions"][0] == ready
    mine = patch["conditions"][1]
    assert mine["type"] == access_sync.CONDITION and mine["observedGeneration"] == 3
    assert mine["lastTransitionTime"] == "2026-02-02T00:00:00Z"
    assert access_sync.status_patch(patch, wanted=wanted, revision="r1", generation=3, now="later") is None
    # Status unchanged but message new: the transition time stays.
    wanted2 = access_sync.condition(revision="r2", rules=1, pods=["p1"], held={"p1": PodAccess("p1", "r2")})
    again = access_sync.status_patch(patch, wanted=wanted2, revision="r2", generation=3, now="later")
    assert again["conditions"][1]["lastTransitionTime"] == "2026-02-02T00:00:00Z"
    # No longer enforcing: the condition and the revision go; then nothing to write.
    gone = access_sync.status_patch(again, wanted=None, revision=None, generation=4, now="later")
    assert gone == {"conditions": [ready], "accessRevision": None}
    assert access_sync.status_patch({"conditions": [ready]}, wanted=None, revision=None, generation=4,
                                    now="later") is None
    assert access_sync.reported(_model() | {"status": again}) and not access_sync.reported(_model())
