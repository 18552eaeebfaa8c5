"""Kopf's diff-base kept in the operator's process (handlers.diffbase): no write per handled change."""

from __future__ import annotations

import kopf

from sparsegate.handlers.diffbase import InProcessDiffBaseStorage

LEGACY = "sparsegate.dev/last-handled-configuration"


def body(uid: str = "u1", *, replicas: int = 2, annotations: dict | None = None) -> kopf.Body:
    return kopf.Body({"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel",
                      "metadata": {"name": "m", "namespace": "ns", "uid": uid, "annotations": annotations or {}},
                      "spec": {"replicas": replicas}, "status": {"observedGeneration": 1}})


def storage() -> InProcessDiffBaseStorage:
    return InProcessDiffBaseStorage(prefix="sparsegate.dev", key="last-handled-configuration")


def test_an_unknown_object_has_no_essence_so_kopf_handles_it_as_created() -> None:
    assert storage().fetch(body=body()) is None


def test_a_stored_essence_is_fetched_back_and_nothing_is_written() -> None:
    s, b, patch = storage(), body(), kopf.Patch()
    essence = s.build(body=b)
    s.store(body=b, patch=patch, essence=essence)
    assert s.fetch(body=b) == essence and s.fetch(body=body("other")) is None
    assert essence["spec"] == {"replicas": 2} and "status" not in essence
    assert not patch  # the point: no PATCH of Kopf's own after a handled change
    changed = body(replicas=3)
    assert s.build(body=changed) != s.fetch(body=changed)  # a spec change is still a change


def test_an_earlier_versions_annotation_is_no_change_and_is_removed_with_the_next_store() -> None:
    s = storage()
    old = body(annotations={LEGACY: '{"spec":{"replicas":1}}\n', "team": "a"})
    assert s.build(body=old) == s.build(body=body(annotations={"team": "a"}))
    patch = kopf.Patch()
    s.store(body=old, patch=patch, essence=s.build(body=old))
    assert patch == {"metadata": {"annotations": {LEGACY: None}}}


def test_a_deleted_objects_essence_is_forgotten() -> None:
    s, b = storage(), body()
    s.store(body=b, patch=kopf.Patch(), essence=s.build(body=b))
    assert len(s) == 1
    s.forget("u1")
    s.forget("never-stored")
    assert len(s) == 0 and s.fetch(body=b) is None


class Uncopyable(dict):
    """A stanza the essence must not deep-copy (Kopf's own build would)."""

    def __deepcopy__(self, memo: dict) -> None:
        raise AssertionError("deep-copied")


def rich(kind: str = "SparseModel", **extra: object) -> dict:
    return {"apiVersion": "sparsegate.dev/v1alpha1", "kind": kind, **extra,
            "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 4,
                         "labels": {"app": "m"}, "finalizers": ["x"],
                         "ownerReferences": [{"kind": "Deployment", "name": "d", "uid": "d1"}],
                         "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
                         "annotations": {LEGACY: "{}", "team": "a", "sparsegate.dev/kopf-managed": "yes",
                                         "other.example/kopf-managed": "yes", "other.example/x": "1",
                                         "kubectl.kubernetes.io/last-applied-configuration": "{}"}},
            "spec": {"replicas": 2, "model": {"experts": 4}},
            "status": {"observedGeneration": 4, "conditions": [{"type": "Ready", "status": "True"}]}}


def test_the_essence_is_kopfs_own() -> None:
    ours, kopfs = storage(), kopf.AnnotationsDiffBaseStorage(prefix="sparsegate.dev",
                                                              key="last-handled-configuration")
    # A ReplicaSet of a Deployment: Kopf names its keys apart (read from ownerReferences).
    for raw in (rich(), rich(data={"k": "v"}), rich(kind="ReplicaSet")):
        for extra in (None, [], ["status.observedGeneration"]):
            assert ours.build(body=kopf.Body(raw), extra_fields=extra) == \
                kopfs.build(body=kopf.Body(raw), extra_fields=extra), (raw["kind"], extra)
    assert ours.build(body=kopf.Body(rich())) == {"metadata": {"labels": {"app": "m"}, "annotations": {"team": "a"}},
                                                  "spec": {"replicas": 2, "model": {"experts": 4}}}


def test_status_and_managed_fields_are_not_copied() -> None:
    raw = rich()
    raw["status"] = Uncopyable(raw["status"])
    raw["metadata"]["managedFields"] = [Uncopyable(raw["metadata"]["managedFields"][0])]
    essence = storage().build(body=kopf.Body(raw))
    assert essence["spec"] == {"replicas": 2, "model": {"experts": 4}}
    spec = raw["spec"]
    spec["replicas"] = 3
    assert essence["spec"]["replicas"] == 2  # what is kept is still a copy


def test_kinds_whose_essence_nothing_reads_get_an_empty_one_without_a_copy() -> None:
    s = InProcessDiffBaseStorage(prefix="sparsegate.dev", key="last-handled-configuration", kinds={"SparseModel"})
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "uid": "p1"},
           "spec": Uncopyable({"containers": []}), "status": Uncopyable({})}
    assert s.build(body=kopf.Body(pod)) == {}
    gate = rich(kind="GateConfig")
    gate["spec"] = Uncopyable(gate["spec"])
    assert s.build(body=kopf.Body(gate)) == {}
    other_group = rich(apiVersion="example.com/v1")  # a SparseModel kind of another group: not ours
    other_group["spec"] = Uncopyable(other_group["spec"])
    assert s.build(body=kopf.Body(other_group)) == {}
    assert s.build(body=kopf.Body(rich()))["spec"] == {"replicas": 2, "model": {"experts": 4}}
    unnamed = {k: v for k, v in rich().items() if k not in ("apiVersion", "kind")}  # no kind: built, to be safe
    assert s.build(body=kopf.Body(unnamed))["spec"] == {"replicas": 2, "model": {"experts": 4}}
    # What Kopf does with it next: clear progress, diff against the (absent) stored essence.
    progress = kopf.AnnotationsProgressStorage(prefix="sparsegate.dev")
    assert progress.clear(essence=s.build(body=kopf.Body(pod))) == {}


def test_the_essence_kinds_are_the_kinds_kopf_reads_essences_of() -> None:
    import sparsegate.main  # noqa: F401  (registers every handler)
    from sparsegate.handlers.diffbase import ESSENCE_KINDS, STORAGE
    from sparsegate_contracts import names

    registry = kopf.get_default_registry()
    handlers = [*registry._changing.get_all_handlers(), *registry._spawning.get_all_handlers()]
    read = {(h.selector.group, h.selector.plural or h.selector.any_name) for h in handlers}
    assert read == {(names.GROUP, names.PLURALS[kind]) for kind in ESSENCE_KINDS}
    assert STORAGE._kinds == ESSENCE_KINDS
