"""RoutingPolicy status from a sync outcome (sparsegate.domain.policy_status)."""

from __future__ import annotations

from sparsegate.domain.policy_status import SyncOutcome, status_changed, status_patch


def _conditions(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


def test_loaded_generation_makes_ready() -> None:
    st = status_patch(outcome=SyncOutcome(generation=3, loaded_generation=3, decision_count=4, revision="sha256:r"),
                      previous=None, now="T1")
    assert st["loadedInOPA"] is True and st["decisionCount"] == 4 and st["observedGeneration"] == 3
    assert st["opaRevision"] == "sha256:r"
    c = _conditions(st)
    assert c["Ready"]["status"] == "True" and c["Ready"]["reason"] == "LoadedInOPA"
    assert c["Degraded"]["status"] == "False" and c["Ready"]["observedGeneration"] == 3


def test_stale_generation_is_not_loaded() -> None:
    st = status_patch(outcome=SyncOutcome(generation=3, loaded_generation=2, decision_count=0, revision="r"),
                      previous=None, now="T1")
    assert st["loadedInOPA"] is False and _conditions(st)["Ready"]["reason"] == "NotLoadedInOPA"


def test_unreachable_opa_degrades_and_keeps_counts() -> None:
    ok = status_patch(outcome=SyncOutcome(generation=1, loaded_generation=1, decision_count=5, revision="r"),
                      previous=None, now="T1")
    down = status_patch(outcome=SyncOutcome(generation=1, loaded_generation=None, decision_count=None, revision="r",
                                            error="connection refused"), previous=ok, now="T2")
    c = _conditions(down)
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "OPAUnreachable"
    assert c["Degraded"]["lastTransitionTime"] == "T2" and "last good allow-list kept" in c["Degraded"]["message"]
    assert c["Ready"]["status"] == "False"
    assert "decisionCount" not in down  # the published decisions did not change
    assert down["loadedInOPA"] is True  # we cannot know otherwise; the resync will tell
    again = status_patch(outcome=SyncOutcome(generation=1, loaded_generation=None, decision_count=None, revision="r",
                                             error="connection refused"), previous={**ok, **down}, now="T3")
    assert _conditions(again)["Degraded"]["lastTransitionTime"] == "T2"  # no flapping timestamps
    assert not status_changed(previous={**ok, **down}, patch=again)


def test_rejected_policy_is_not_loaded() -> None:
    st = status_patch(outcome=SyncOutcome(generation=1, loaded_generation=None, decision_count=None, revision=None,
                                          error="rego_parse_error", rejected=True), previous={"loadedInOPA": True}, now="T")
    assert st["loadedInOPA"] is False and _conditions(st)["Degraded"]["reason"] == "OPARejected"
