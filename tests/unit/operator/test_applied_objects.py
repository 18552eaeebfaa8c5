"""controllers.applied_objects: what a model's reconcile last applied, by digest and age."""

from __future__ import annotations

import pytest

from sparsegate.controllers.applied_objects import AppliedObjects, digest

MODEL = ("ns", "m")


def cm(data: dict) -> dict:
    return {"kind": "ConfigMap", "metadata": {"name": "m", "namespace": "ns"}, "data": data}


def test_unchanged_until_the_rendering_changes_or_the_record_ages() -> None:
    a = AppliedObjects(interval_s=600)
    assert not a.unchanged(MODEL, cm({"k": "1"}), now=0)
    a.record(MODEL, cm({"k": "1"}), now=0)
    assert a.unchanged(MODEL, cm({"k": "1"}), now=599)
    assert not a.unchanged(MODEL, cm({"k": "2"}), now=1)
    assert not a.unchanged(MODEL, cm({"k": "1"}), now=600)  # an edit by someone else is undone from here
    assert not a.unchanged(("ns", "other"), cm({"k": "1"}), now=1)
    service = {"kind": "Service", "metadata": {"name": "m", "namespace": "ns"}}
    assert not a.unchanged(MODEL, service, now=1)  # per kind and name


def test_key_order_does_not_matter_but_values_do() -> None:
    assert digest({"a": 1, "b": {"c": 2, "d": 3}}) == digest({"b": {"d": 3, "c": 2}, "a": 1})
    assert digest({"a": 1}) != digest({"a": "1"})


def test_forget_drops_a_models_records_and_zero_keeps_none() -> None:
    a = AppliedObjects(interval_s=600)
    a.record(MODEL, cm({}), now=0)
    a.record(("ns", "other"), cm({}), now=0)
    a.forget(MODEL)
    assert not a.unchanged(MODEL, cm({}), now=1) and a.unchanged(("ns", "other"), cm({}), now=1)
    assert len(a) == 1
    off = AppliedObjects(interval_s=0)
    off.record(MODEL, cm({}), now=0)
    assert len(off) == 0 and not off.unchanged(MODEL, cm({}), now=0)
    with pytest.raises(ValueError, match="0 \\(off\\) or positive"):
        AppliedObjects(interval_s=-1)


@pytest.mark.parametrize("interval_s", [600, 0])
def test_a_failure_is_kept_until_an_apply_lands_and_drops_the_record(interval_s: float) -> None:
    a = AppliedObjects(interval_s=interval_s)
    a.record(MODEL, cm({"k": "1"}), now=0)
    a.record_failure(MODEL, cm({"k": "2"}), "422 Invalid")
    assert a.failure(MODEL, cm({"k": "3"})) == "422 Invalid"  # by kind and name, whatever the rendering
    assert not a.unchanged(MODEL, cm({"k": "1"}), now=1)  # the next reconcile applies it, even unchanged
    assert a.failure(("ns", "other"), cm({})) is None
    a.record(MODEL, cm({"k": "2"}), now=2)
    assert a.failure(MODEL, cm({"k": "2"})) is None
    a.record_failure(MODEL, cm({}), "timed out")
    a.forget(MODEL)
    assert a.failure(MODEL, cm({})) is None


def test_in_flight_until_it_lands_or_fails_and_a_hold_is_taken_once() -> None:
    a = AppliedObjects(interval_s=600)
    svc = {"kind": "Service", "metadata": {"name": "m"}}
    assert not a.unapplied(MODEL, svc) and not a.hold(MODEL, svc)  # applied or never tried: nothing to hold
    a.begin(MODEL, svc)
    assert a.unapplied(MODEL, svc) and a.hold(MODEL, svc)
    a.record(MODEL, svc, now=0)
    assert not a.unapplied(MODEL, svc) and not a.hold(MODEL, svc)  # landed: a write holds nothing back now
    assert a.take_held(MODEL, svc) and not a.take_held(MODEL, svc)  # the earlier hold, once
    a.begin(MODEL, svc)
    a.record_failure(MODEL, svc, "refused")
    assert a.unapplied(MODEL, svc) and a.hold(MODEL, svc)  # failed: still not applied
    a.forget(MODEL)
    assert not a.unapplied(MODEL, svc) and not a.take_held(MODEL, svc)


def test_expire_drops_the_records_but_keeps_what_is_in_flight_or_failed() -> None:
    """A touched model (``handlers.sparsemodel``): everything is applied again, while an apply in
    flight still holds Ready back and a failure is still reported."""
    a = AppliedObjects(interval_s=600)
    svc = {"kind": "Service", "metadata": {"name": "m"}}
    a.record(MODEL, cm({}), now=0)
    a.begin(MODEL, svc)
    a.record(("ns", "other"), cm({}), now=0)
    a.expire(MODEL)
    assert not a.unchanged(MODEL, cm({}), now=1) and a.unchanged(("ns", "other"), cm({}), now=1)
    assert a.unapplied(MODEL, svc)
    a.record_failure(MODEL, svc, "refused")
    a.expire(MODEL)
    assert a.failure(MODEL, svc) == "refused"


def deployment(generation, uid="dep-1") -> dict:
    return {"kind": "Deployment", "metadata": {"name": "m", "namespace": "ns", "uid": uid, "generation": generation}}


def test_a_deployment_past_the_generation_our_apply_returned_was_edited_by_someone_else() -> None:
    """``kubectl scale deploy``/``kubectl edit``/``kubectl rollout restart`` move the Deployment's
    spec generation past what our last apply returned; its status moving (pods Ready) does not."""
    a = AppliedObjects(interval_s=600)
    assert not a.foreign_edit(MODEL, deployment(7))  # nothing applied by this process yet
    a.record_deployment(MODEL, deployment(3))
    assert not a.foreign_edit(MODEL, deployment(3))  # our own apply's event, or a status change
    assert not a.foreign_edit(MODEL, deployment(2))  # an event older than our apply
    assert a.foreign_edit(MODEL, deployment(4))
    assert not a.foreign_edit(MODEL, deployment(4, uid="dep-2"))  # another Deployment of the name
    assert not a.foreign_edit(MODEL, None) and not a.foreign_edit(("ns", "other"), deployment(4))
    a.record_deployment(MODEL, deployment(4))  # the apply that put it back
    assert not a.foreign_edit(MODEL, deployment(4))
    a.record_deployment(MODEL, deployment(3))  # an older apply's answer, recorded late
    assert not a.foreign_edit(MODEL, deployment(4))
    a.expire(MODEL)  # records of the ConfigMap and Service only
    assert a.foreign_edit(MODEL, deployment(5))
    a.forget(MODEL)  # its Deployment deleted, or the model
    assert not a.foreign_edit(MODEL, deployment(5))
    off = AppliedObjects(interval_s=0)  # re-applying everything each time still puts an edit back at once
    off.record_deployment(MODEL, deployment(1))
    assert off.foreign_edit(MODEL, deployment(2))


def written(rv, kind: str = "Service") -> dict:
    """A Service or ConfigMap as an apply answered it or its watch event carries it."""
    return {"kind": kind, "metadata": {"name": "m", "namespace": "ns", "resourceVersion": rv}}


def test_a_service_or_configmap_past_the_resource_version_our_apply_returned_was_written_by_someone_else() -> None:
    """They have no spec generation: the resourceVersion each apply of ours returned tells our own
    writes' events (and older ones) from another writer's (``kubectl edit``, a label added)."""
    a = AppliedObjects(interval_s=600)
    service = {"kind": "Service", "metadata": {"name": "m", "namespace": "ns"}}
    assert not a.foreign_write(MODEL, written("7"))  # nothing applied by this process yet
    a.record(MODEL, service, now=0, answer=written("10"))
    assert not a.foreign_write(MODEL, written("10"))  # our apply's own event
    assert not a.foreign_write(MODEL, written("9"))  # an event older than our apply
    assert a.foreign_write(MODEL, written("11"))
    assert not a.foreign_write(MODEL, written("11", "ConfigMap"))  # per kind and name
    assert not a.foreign_write(MODEL, written("abc")) and not a.foreign_write(MODEL, None)
    a.record(MODEL, service, now=1, answer=written("8"))  # an older apply's answer, recorded late
    assert a.foreign_write(MODEL, written("11"))
    a.record(MODEL, service, now=1, answer=written("11"))  # the put-back: a no-op apply answers the version it found
    assert not a.foreign_write(MODEL, written("11"))
    a.record(MODEL, service, now=2)  # found as rendered, no answer: the version stays
    assert a.foreign_write(MODEL, written("12"))
    a.expire(MODEL)  # records of what was applied when only
    assert a.foreign_write(MODEL, written("12"))
    a.forget(MODEL)
    assert not a.foreign_write(MODEL, written("12"))
    off = AppliedObjects(interval_s=0)  # re-applying everything each time still puts an edit back at once
    off.record(MODEL, service, now=0, answer=written("1"))
    assert off.foreign_write(MODEL, written("2"))


def test_an_apply_in_flight_and_one_objects_record_expired() -> None:
    a = AppliedObjects(interval_s=600)
    service = {"kind": "Service", "metadata": {"name": "m", "namespace": "ns"}}
    a.begin(MODEL, service)
    assert a.applying(MODEL, written("3")) and not a.applying(MODEL, written("3", "ConfigMap"))
    a.record(MODEL, service, now=0, answer=written("3"))
    assert not a.applying(MODEL, written("3"))
    a.record(MODEL, cm({"k": "1"}), now=0)
    a.expire_object(MODEL, written("4"))
    assert not a.unchanged(MODEL, service, now=1) and a.unchanged(MODEL, cm({"k": "1"}), now=1)
