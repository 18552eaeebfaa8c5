"""Rollout gauges: read from GateConfig status (pure), then exported by the operator's metrics."""

from __future__ import annotations

from sparsegate import metrics
from sparsegate.domain.rollout import Phase
from sparsegate.domain.rollout_gauges import Role, rollout_gauges

STABLE, CANARY, OLD = "g-aaaaaaaaaaaa", "g-bbbbbbbbbbbb", "g-cccccccccccc"


def in_flight_status(**rollout: object) -> dict:
    return {"stable": {"version": STABLE},
            "rollout": {"phase": "Analysing", "step": 2, "steps": 3, "canaryPercent": 20,
                        "canaryVersion": CANARY, "canaryInstances": "2/10",
                        "podVersions": {f"p{i}": (CANARY if i < 2 else STABLE) for i in range(9)} | {"p9": OLD},
                        **rollout}}


def sample(name: str, **labels: str) -> float | None:
    return metrics.prometheus_client.REGISTRY.get_sample_value(name, labels)


def test_a_canary_in_flight_reads_step_weight_instances_and_pods_by_role():
    g = rollout_gauges(in_flight_status())
    assert (g.phase, g.step, g.steps, g.canary_percent) == ("Analysing", 2, 3, 20)
    assert (g.canary_instances, g.instances) == (2, 10)
    assert g.versions == {Role.STABLE: STABLE, Role.CANARY: CANARY}
    assert g.pods == {Role.STABLE: 7, Role.CANARY: 2, Role.OTHER: 1}


def test_resting_or_empty_status_has_no_canary():
    resting = rollout_gauges({"stable": {"version": STABLE},
                              "rollout": {"phase": "Succeeded", "steps": 3, "canaryPercent": None,
                                          "canaryInstances": None, "podVersions": {"a": STABLE}}})
    assert (resting.phase, resting.step, resting.canary_percent, resting.canary_instances) == ("Succeeded", 0, 0, 0)
    assert resting.versions == {Role.STABLE: STABLE} and resting.pods[Role.STABLE] == 1
    # A canaryVersion equal to stable (e.g. a promote just recorded) is no canary either.
    same = rollout_gauges(in_flight_status(canaryVersion=STABLE))
    assert Role.CANARY not in same.versions and same.step == 0 and same.canary_percent == 0
    for empty in (None, {}, {"rollout": None}, {"rollout": {"canaryInstances": "x/y", "step": "2"}}):
        g = rollout_gauges(empty)
        assert (g.phase, g.step, g.steps, g.canary_percent, g.instances, g.versions) == (None, 0, 0, 0, None, {})


def test_observe_exports_one_phase_and_versions_and_forget_removes_everything():
    ns, gc = "unit-ns", "unit-gc"
    metrics.observe_gateconfig(namespace=ns, name=gc, status=in_flight_status())
    assert sample("sparsegate_rollout_phase", namespace=ns, gateconfig=gc, phase="Analysing") == 1
    assert all(sample("sparsegate_rollout_phase", namespace=ns, gateconfig=gc, phase=p.value) == 0
               for p in Phase if p.value != "Analysing")
    assert sample("sparsegate_rollout_step", namespace=ns, gateconfig=gc) == 2
    assert sample("sparsegate_rollout_canary_percent", namespace=ns, gateconfig=gc) == 20
    assert sample("sparsegate_rollout_canary_instances", namespace=ns, gateconfig=gc) == 2
    assert sample("sparsegate_rollout_instances", namespace=ns, gateconfig=gc) == 10
    assert sample("sparsegate_rollout_pods", namespace=ns, gateconfig=gc, role="canary") == 2
    assert sample("sparsegate_rollout_version_info", namespace=ns, gateconfig=gc, role="canary", version=CANARY) == 1

    # Promoted: the old stable version's series goes, the new stable one stays, no canary remains.
    metrics.observe_gateconfig(namespace=ns, name=gc, status={
        "stable": {"version": CANARY}, "rollout": {"phase": "Succeeded", "steps": 3, "podVersions": {"a": CANARY}}})
    assert sample("sparsegate_rollout_phase", namespace=ns, gateconfig=gc, phase="Analysing") == 0
    assert sample("sparsegate_rollout_phase", namespace=ns, gateconfig=gc, phase="Succeeded") == 1
    assert sample("sparsegate_rollout_version_info", namespace=ns, gateconfig=gc, role="canary", version=CANARY) is None
    assert sample("sparsegate_rollout_version_info", namespace=ns, gateconfig=gc, role="stable", version=STABLE) is None
    assert sample("sparsegate_rollout_version_info", namespace=ns, gateconfig=gc, role="stable", version=CANARY) == 1
    assert sample("sparsegate_rollout_step", namespace=ns, gateconfig=gc) == 0

    metrics.forget_gateconfig(namespace=ns, name=gc)
    text = metrics.prometheus_client.generate_latest().decode()
    assert f'gateconfig="{gc}"' not in text
    metrics.forget_gateconfig(namespace=ns, name=gc)  # twice: nothing left, no error


def test_reconcile_errors_series_exists_before_the_first_error():
    with metrics.observe("UnitNeverFails"):
        pass
    assert sample("sparsegate_operator_reconcile_errors_total", kind="UnitNeverFails") == 0


def test_instances_at_rest_follow_the_count_status_records():
    # The controller records status.rollout.instances at every check, canary or not; with no
    # canaryInstances at rest the gauge must follow it, not keep the count of the last rollout.
    ns, gc = "unit-ns", "unit-gc-instances"
    metrics.observe_gateconfig(namespace=ns, name=gc, status=in_flight_status(instances=10))
    assert sample("sparsegate_rollout_instances", namespace=ns, gateconfig=gc) == 10
    metrics.observe_gateconfig(namespace=ns, name=gc, status={
        "stable": {"version": CANARY},
        "rollout": {"phase": "Succeeded", "steps": 3, "instances": 4, "podVersions": {f"p{i}": CANARY for i in range(4)}}})
    assert sample("sparsegate_rollout_instances", namespace=ns, gateconfig=gc) == 4
    assert rollout_gauges({"rollout": {"phase": "Succeeded", "instances": 0}}).instances == 0
    metrics.forget_gateconfig(namespace=ns, name=gc)


def test_an_earlier_gateconfigs_deleted_event_keeps_the_re_created_ones_gauges():
    """Deleted and created again under its name: Kopf handles each uid apart, so the old object's
    DELETED may come after the new one's events; the gauges are the new one's and stay (a resting
    GateConfig may see no further event to set them again)."""
    import asyncio

    from sparsegate.handlers import rollout_metrics

    ns, gc = "unit-ns", "unit-recreated"
    status = {"stable": {"version": STABLE}, "rollout": {"phase": "Succeeded", "steps": 3}}

    def event(type_, uid, index):
        body = {"metadata": {"namespace": ns, "name": gc, "uid": uid}, "status": status}
        asyncio.run(rollout_metrics.gateconfig_rollout_gauges(type=type_, body=body, namespace=ns, name=gc,
                                                              sparsegate_gate_views=index))

    new_indexed = {(ns, gc): [{"metadata": {"name": gc}}]}  # the index holds the new object (uid-new)
    event("MODIFIED", "uid-new", new_indexed)
    event("DELETED", "uid-old", new_indexed)
    assert sample("sparsegate_rollout_phase", namespace=ns, gateconfig=gc, phase="Succeeded") == 1
    event("DELETED", "uid-new", {})  # the new one goes too: nothing of the name is left
    assert sample("sparsegate_rollout_phase", namespace=ns, gateconfig=gc, phase="Succeeded") is None


def test_each_sparsemodel_is_exported_under_the_gateconfig_it_names():
    """``sparsegate_gateconfig_model_info``: the dashboard keeps a GateConfig's canary-vs-stable
    panels to its own models with it (two GateConfigs with the same params share version ids)."""
    import asyncio

    from sparsegate.handlers import rollout_metrics

    ns, model = "unit-ns", "unit-model"

    def event(type_, ref, index):
        body = {"metadata": {"namespace": ns, "name": model}, "spec": {"gateConfigRef": {"name": ref}} if ref else {}}
        asyncio.run(rollout_metrics.sparsemodel_gateconfig_binding(type=type_, body=body, namespace=ns, name=model,
                                                                   sparsegate_model_views=index))

    def bound() -> set[str]:
        return {gc for gc in ("gate-a", "gate-b")
                if sample("sparsegate_gateconfig_model_info", namespace=ns, gateconfig=gc, model=model) == 1}

    indexed = {(ns, model): [{}]}
    event("ADDED", "gate-a", indexed)
    assert bound() == {"gate-a"}
    event("MODIFIED", "gate-b", indexed)  # spec.gateConfigRef edited: only the new one
    assert bound() == {"gate-b"}
    event("DELETED", "gate-b", indexed)  # an earlier object's DELETED, the name created again
    assert bound() == {"gate-b"}
    event("MODIFIED", None, indexed)  # no reference: the built-in gate, no GateConfig
    assert bound() == set()
    event("MODIFIED", "gate-a", indexed)
    event("DELETED", "gate-a", {})
    assert bound() == set()
