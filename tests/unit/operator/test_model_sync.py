"""The reconcile steps (handlers.modelsync) against an in-memory stand-in for our Kube wrapper.

Mocked at our own wrapper layer (clients.kube.Kube), never at HTTP; the real API server runs the
same flows in tests/e2e/operator.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import sys
import threading
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from sparsegate.clients.kube import KubeError
from sparsegate.controllers.applied_objects import AppliedObjects
from sparsegate.controllers.status_inputs import StatusInputs
from sparsegate.domain import admin_tls, fleet_view, model_status
from sparsegate.domain.conditions import container_problems
from sparsegate.controllers.deferred_refresh import DeferredRefreshes
from sparsegate.handlers import modelsync, sparsemodel

ROOT = Path(__file__).resolve().parents[3]
LOG = logging.getLogger("test")


class MemoryKube:
    """Objects by (kind, namespace, name); apply replaces, create_if_absent creates once."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.applied: list[str] = []
        self.replaced: list[str] = []
        self.fail_apply: str | None = None
        self.fail_status: tuple[int, str] = (422, "Invalid")  # how fail_apply's kind is refused
        self.rv = 0
        self.calls: list[tuple[str, str]] = []  # (get|create|apply|status, kind): what a real client would send

    def put(self, obj: dict) -> dict:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        m = obj["metadata"]
        self.objects[(obj["kind"], m["namespace"], m["name"])] = obj
        return obj

    def get(self, kind, *, namespace, name):
        self.calls.append(("get", kind))
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def apply(self, obj):
        if self.fail_apply == obj["kind"]:
            raise KubeError(*self.fail_status, {"message": f"{obj['kind']} refused"})
        self.applied.append(obj["kind"])
        self.calls.append(("apply", obj["kind"]))
        existing = self.objects.get((obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]))
        if existing is not None:  # as a server-side apply: status and generation stay the server's
            obj = {**copy.deepcopy(obj), "status": existing.get("status")}
            obj["metadata"]["generation"] = existing["metadata"].get("generation")
        return self.put(obj)

    def replace(self, obj):
        m = obj["metadata"]
        current = self.objects.get((obj["kind"], m["namespace"], m["name"]))
        if current is None or current["metadata"]["resourceVersion"] != m.get("resourceVersion"):
            raise KubeError(409, "Conflict", {"message": "resourceVersion changed"})
        self.replaced.append(obj["kind"])
        return self.put(obj)

    def create_if_absent(self, obj):
        self.calls.append(("create", obj["kind"]))
        m = obj["metadata"]
        if (obj["kind"], m["namespace"], m["name"]) in self.objects:
            return False
        self.put(obj)
        return True

    def update_status(self, kind, *, namespace, name, mutate, attempts=5, current=None):
        stored = self.objects.get((kind, namespace, name))
        if current is None or stored is None or \
                current["metadata"].get("resourceVersion") != stored["metadata"]["resourceVersion"]:
            current = self.get(kind, namespace=namespace, name=name)  # as Kube does: a stale start reads again
        if current is None:
            return None
        patch = mutate(current)
        if patch is not None:
            self.calls.append(("status", kind))
            stored = self.objects[(kind, namespace, name)]
            stored["status"] = {**(stored.get("status") or {}), **patch}
        return current


@pytest.fixture
def kube():
    k = MemoryKube()
    model = yaml.safe_load((ROOT / "examples" / "sparsemodel.yaml").read_text())
    model["metadata"].update(namespace="ns", uid="uid-1", generation=1)
    k.put(model)
    return k


def watched(k):
    """The Deployment as the operator's watch delivered it (here: as stored, at once)."""
    def read():
        deployment = k.objects.get(("Deployment", "ns", "moe-small"))  # no request: the watch has it
        return fleet_view.deployment_view(deployment) if deployment else None
    return read


def watched_gates(k):
    """The GateConfigs as the operator's watch delivered them (here: as stored, at once)."""
    def read(namespace, name):
        gc = k.objects.get(("GateConfig", namespace, name))  # no request: the watch has it
        return fleet_view.gate_view(gc) if gc else None
    return read


def start(k, model, *, events=None, inputs=None, pods=(), applied=None) -> modelsync.Reconciled:
    """The reconcile up to its status write; its Service apply may still be in flight."""
    return modelsync.reconcile(k, model, events=(lambda *a: events.append(a)) if events is not None else (lambda *a: None),
                               logger=LOG, watched_deployment=watched(k), watched_gate=watched_gates(k),
                               status_inputs=StatusInputs() if inputs is None else inputs, pods=pods,
                               applied_objects=applied)


def reconcile(k, model, **kwargs) -> str:
    """The reconcile with its Service apply finished, as the handler runs it."""
    reconciled = start(k, model, **kwargs)
    if reconciled.service is not None:
        reconciled.service.finish()
    return reconciled.outcome


def model_of(k):
    return k.get("SparseModel", namespace="ns", name="moe-small")


def conditions(k):
    return {c["type"]: c for c in model_of(k)["status"]["conditions"]}


def gateconfig(k, **spec_params):
    gc = yaml.safe_load((ROOT / "examples" / "gateconfig.yaml").read_text())
    gc["metadata"].update(namespace="ns")
    gc["spec"]["params"].update(spec_params)
    k.put(gc)


def test_missing_gateconfig_applies_nothing_and_degrades(kube):
    events = []
    outcome = reconcile(kube, model_of(kube), events=events)
    assert outcome == "degraded" and kube.applied == []
    assert conditions(kube)["Degraded"]["reason"] == "GateConfigNotFound"
    assert ("Warning", "DegradedTrue") in {(e[1], e[2]) for e in events}


def test_reconcile_renders_everything_once_and_records_the_gate(kube):
    gateconfig(kube)
    events = []
    assert reconcile(kube, model_of(kube), events=events) == "success"
    # the ConfigMap before the Deployment (its pods mount it); the Service beside them, in any order
    assert sorted(kube.applied) == ["ConfigMap", "Deployment", "Service"]
    assert kube.applied.index("ConfigMap") < kube.applied.index("Deployment")
    secret = kube.get("Secret", namespace="ns", name="moe-small-admin")
    assert sorted(secret["data"]) == ["tls.crt", "tls.key", "token"]
    assert admin_tls.certificate_names(admin_tls.material_from_secret(secret).cert_pem) == [
        "moe-small.ns.admin.sparsegate.dev"]
    reconcile(kube, model_of(kube), events=events)
    # the Secret is created once: token and certificate survive re-reconciles
    assert kube.get("Secret", namespace="ns", name="moe-small-admin")["data"] == secret["data"]
    assert kube.replaced == []
    st = model_of(kube)["status"]
    assert st["observedGeneration"] == 1 and st["gateVersion"].startswith("g-")
    assert conditions(kube)["Degraded"]["status"] == "False"
    # the second reconcile changed no condition, so it posted no new events
    assert len(events) == len({(e[2]) for e in events})


def test_apply_failure_is_reported_then_raised_for_retry(kube):
    gateconfig(kube)
    kube.fail_apply = "Service"
    with pytest.raises(KubeError):
        reconcile(kube, model_of(kube))
    assert conditions(kube)["Degraded"]["reason"] == "ApplyFailed"
    assert "Service refused" in conditions(kube)["Degraded"]["message"]


def test_no_deployment_is_applied_when_what_its_pods_mount_failed(kube):
    gateconfig(kube)
    kube.fail_apply = "ConfigMap"
    with pytest.raises(KubeError):
        reconcile(kube, model_of(kube))
    assert "Deployment" not in kube.applied and "ConfigMap" not in kube.applied
    assert kube.get("Secret", namespace="ns", name="moe-small-admin") is not None
    assert "ConfigMap refused" in conditions(kube)["Degraded"]["message"]


@pytest.mark.parametrize("refused", ["Deployment", "ConfigMap"])
def test_a_refused_apply_reports_the_deployment_that_still_runs(kube, refused):
    """Generation 2 refused by the API server: the Deployment of generation 1 keeps running and
    status says so (2 replicas, Ready from it), with Degraded ApplyFailed; not "no Deployment"
    and 0 replicas, which a refused apply never caused."""
    gateconfig(kube)
    reconcile(kube, model_of(kube))
    available(kube)
    m = model_of(kube)
    m["metadata"]["generation"] = 2
    m["spec"]["image"] = "registry.example/model:2"
    kube.put(m)
    kube.fail_apply = refused
    with pytest.raises(KubeError):
        reconcile(kube, model_of(kube))
    status, cond = model_of(kube)["status"], conditions(kube)
    assert (status["replicas"], status["readyReplicas"]) == (2, 2)
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("True", "AllReplicasReady")
    assert (cond["Degraded"]["reason"], cond["Stalled"]["reason"]) == ("ApplyFailed", "ApplyFailed")
    assert f"{refused} refused" in cond["Degraded"]["message"]


@pytest.mark.parametrize("refused", ["Deployment", "Service"])
def test_an_apply_failed_in_passing_reads_reconciling_not_stalled(kube, refused):
    """An API server 5xx, 429 or 409 conflict is retried (the handler raises, Kopf retries): status
    says Reconciling (ApplyRetrying), not Stalled, which kstatus and Flux read as a failure for good.
    A 4xx that needs a person (422 invalid, 403 forbidden) stays Stalled ApplyFailed."""
    gateconfig(kube)
    reconcile(kube, model_of(kube))
    available(kube)
    m = model_of(kube)
    m["metadata"]["generation"] = 2
    m["spec"]["image"] = "registry.example/model:2"
    kube.put(m)
    kube.fail_apply = refused
    for status, expected in (((503, "Service Unavailable"), ("ApplyRetrying", "False", "True")),
                             ((429, "Too Many Requests"), ("ApplyRetrying", "False", "True")),
                             ((409, "Conflict"), ("ApplyRetrying", "False", "True")),
                             ((403, "Forbidden"), ("ApplyFailed", "True", "False")),
                             ((422, "Invalid"), ("ApplyFailed", "True", "False"))):
        kube.fail_status = status
        with pytest.raises(KubeError):
            reconcile(kube, model_of(kube), applied=AppliedObjects(interval_s=600))
        cond = conditions(kube)
        assert (cond["Degraded"]["reason"], cond["Stalled"]["status"], cond["Reconciling"]["status"]) == expected, \
            status
        assert cond["Degraded"]["status"] == "True" and f"{status[0]} " in cond["Degraded"]["message"]
    kube.fail_apply = None
    reconcile(kube, model_of(kube), applied=AppliedObjects(interval_s=600))
    assert (conditions(kube)["Degraded"]["status"], conditions(kube)["Stalled"]["status"]) == ("False", "False")


def test_a_first_apply_refused_says_the_deployment_is_missing_not_the_gate(kube):
    gateconfig(kube)
    kube.fail_apply = "Deployment"
    with pytest.raises(KubeError):
        reconcile(kube, model_of(kube))
    cond = conditions(kube)
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("False", "DeploymentMissing")
    assert cond["Degraded"]["reason"] == "ApplyFailed"


class GatedServiceKube(MemoryKube):
    """Its Service apply waits until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.service_gate = threading.Event()

    def apply(self, obj):
        if obj["kind"] == "Service":
            assert self.service_gate.wait(10), "the test never opened the gate"
        return super().apply(obj)


def test_the_deployment_and_status_do_not_wait_for_the_service(kube):
    slow = GatedServiceKube()
    slow.objects = kube.objects
    gateconfig(slow)
    reconciled = start(slow, model_of(slow))
    # Returned with the Service apply still in flight: the Deployment is applied and status written.
    assert reconciled.outcome == "success" and not reconciled.service.future.done()
    assert sorted(slow.applied) == ["ConfigMap", "Deployment"]
    st = model_of(slow)["status"]
    assert st["observedGeneration"] == 1 and conditions(slow)["Degraded"]["status"] == "False"
    writes = slow.calls.count(("status", "SparseModel"))
    slow.service_gate.set()
    reconciled.service.finish()
    assert "Service" in slow.applied
    assert slow.calls.count(("status", "SparseModel")) == writes  # it landed as assumed: no second write


def available(k) -> dict:
    """The model's Deployment with every replica ready, stored (and so watched) as its controller would report it."""
    deployment = k.get("Deployment", namespace="ns", name="moe-small")
    deployment["metadata"]["generation"] = 1
    deployment["status"] = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1}
    return k.put(deployment)


def test_ready_waits_for_the_service_and_is_written_once_it_lands(kube):
    slow = GatedServiceKube()
    slow.objects = kube.objects
    gateconfig(slow)
    applied = AppliedObjects(interval_s=600)
    reconciled = start(slow, model_of(slow), applied=applied)
    # Every replica became ready while the Service apply is still in flight: not Ready yet, and why.
    modelsync.refresh_from_deployment(slow, namespace="ns", name="moe-small", deployment=available(slow), pods=[],
                                      events=lambda *a: None, status_inputs=StatusInputs(), applied_objects=applied)
    ready = conditions(slow)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ServiceNotApplied"), ready
    assert "Service is not applied yet" in ready["message"] and conditions(slow)["Progressing"]["status"] == "True"
    slow.service_gate.set()
    reconciled.service.finish()  # it landed: status again, now Ready
    assert conditions(slow)["Ready"]["reason"] == "AllReplicasReady"
    # Later writes see it applied; a later reconcile applies no Service and holds nothing back.
    assert not applied.unapplied(("ns", "moe-small"), modelsync.service_ref("moe-small"))
    assert start(slow, model_of(slow), applied=applied).service is None


def test_an_older_reconciles_status_rewrite_keeps_the_gate_a_newer_re_render_wrote(kube):
    """Kopf's reconcile (old gate) and a re-render for a newer gate (``handlers.gatebinding``: it
    waits for the model's turn, not for the Service) each apply the Service and write status while
    it is in flight. The older one's apply lands first and its handler writes status again: that
    write put its own, older gate back in status (gateVersion, gateChecksum) over the newer one's,
    while the Deployment runs the newer gate."""
    slow = GatedServiceKube()
    slow.objects = kube.objects
    gateconfig(slow)
    applied = AppliedObjects(interval_s=600)
    older = start(slow, model_of(slow), applied=applied)  # Service apply in flight
    old_version = model_of(slow)["status"]["gateVersion"]
    available(slow)  # every replica ready: only the Service holds Ready back
    gateconfig(slow, entropyBeta=0.3)
    newer = start(slow, model_of(slow), applied=applied)  # the re-render, Service apply in flight too
    status = model_of(slow)["status"]
    new_gate = (status["gateVersion"], status["gateChecksum"])
    assert new_gate[0] != old_version
    assert conditions(slow)["Ready"]["reason"] == "ServiceNotApplied"
    slow.service_gate.set()
    older.service.finish()  # first submitted, first landed
    newer.service.finish()
    status = model_of(slow)["status"]
    assert (status["gateVersion"], status["gateChecksum"]) == new_gate
    assert conditions(slow)["Ready"]["reason"] == "AllReplicasReady"  # the Service landed: not held back for good


def _reconcile_whose_service_apply_fails(kube: Any) -> tuple[GatedServiceKube, Any]:
    """A reconcile whose Service apply is held (``service_gate``) and then fails: it ends otherwise
    than the status written meanwhile assumed, so that status would be written again."""
    slow = GatedServiceKube()
    slow.objects = kube.objects
    slow.fail_apply = "Service"
    gateconfig(slow)
    return slow, start(slow, model_of(slow), applied=AppliedObjects(interval_s=600))


def test_a_status_rewrite_leaves_a_model_re_created_under_the_same_name_alone(kube):
    slow, reconciled = _reconcile_whose_service_apply_fails(kube)
    recreated = model_of(slow)
    recreated["metadata"]["uid"] = "uid-2"
    recreated.pop("status")
    slow.put(recreated)  # deleted and created again while the Service apply was in flight
    writes = slow.calls.count(("status", "SparseModel"))
    slow.service_gate.set()
    with pytest.raises(KubeError):
        reconciled.service.finish()
    assert slow.calls.count(("status", "SparseModel")) == writes
    assert "status" not in model_of(slow)


def test_a_status_rewrite_leaves_a_newer_generations_status_alone(kube):
    """A re-render (handlers.gatebinding) runs beside Kopf's handler: when the Service apply of the
    one for generation 1 ends after the handler reconciled generation 2, its status rewrite must not
    set observedGeneration back to 1 (kstatus and the Argo CD check would read InProgress for good)."""
    slow, reconciled = _reconcile_whose_service_apply_fails(kube)
    newer = model_of(slow)
    newer["metadata"]["generation"] = 2
    newer["status"]["observedGeneration"] = 2  # generation 2 reconciled (and its status written) meanwhile
    slow.put(newer)
    slow.service_gate.set()
    with pytest.raises(KubeError):
        reconciled.service.finish()
    assert model_of(slow)["status"]["observedGeneration"] == 2


def test_a_service_that_lands_between_the_check_and_the_write_is_written_as_applied(kube):
    applied = AppliedObjects(interval_s=600)
    key, ref = ("ns", "moe-small"), modelsync.service_ref("moe-small")
    applied.begin(key, ref)

    def compute(service_applied: bool) -> dict:
        if not service_applied:
            applied.record(key, ref, now=0)  # lands while this write is being computed
        ready = "True" if service_applied else "False"
        reason = "AllReplicasReady" if service_applied else "ServiceNotApplied"
        return {"conditions": [{"type": "Ready", "status": ready, "reason": reason}]}
    assert modelsync.with_service(applied, key, compute)["conditions"][0]["status"] == "True"
    assert not applied.take_held(key, ref)  # nothing was held back, so nothing to write again


def test_a_service_failure_is_written_then_kept_until_an_apply_lands(kube):
    gateconfig(kube)
    applied = AppliedObjects(interval_s=600)
    events = []
    kube.fail_apply = "Service"
    reconciled = start(kube, model_of(kube), events=events, applied=applied)
    assert "Deployment" in kube.applied  # nothing waits for the Service
    with pytest.raises(KubeError, match="ApplyFailed"):
        reconciled.service.finish()  # status again with the failure, then raised for Kopf's retry
    assert conditions(kube)["Degraded"]["reason"] == "ApplyFailed"
    assert "Service refused" in conditions(kube)["Degraded"]["message"]
    assert [e[2] for e in events].count("DegradedTrue") == 1
    # A retry that fails again writes status once, already with the failure: no flapping condition.
    kube.calls.clear()
    with pytest.raises(KubeError):
        reconcile(kube, model_of(kube), events=events, applied=applied)
    assert kube.calls.count(("status", "SparseModel")) == 1  # the reconcile's own: finish had nothing to correct
    assert conditions(kube)["Degraded"]["reason"] == "ApplyFailed"
    assert [e[2] for e in events].count("DegradedTrue") == 1
    # Once an apply lands, the retry's second write clears it.
    kube.fail_apply = None
    events.clear()
    assert reconcile(kube, model_of(kube), events=events, applied=applied) == "success"
    assert conditions(kube)["Degraded"]["status"] == "False"
    assert [e[2] for e in events] == ["DegradedFalse"]
    assert applied.failure(("ns", "moe-small"), {"kind": "Service", "metadata": {"name": "moe-small"}}) is None


def test_gate_too_wide_for_the_model_is_invalid(kube):
    gateconfig(kube, maxExpertsPerToken=16)  # the example model has 8 experts
    assert reconcile(kube, model_of(kube)) == "degraded"
    assert conditions(kube)["Degraded"]["reason"] == "GateConfigInvalid"


def test_stale_models_follow_the_resolved_gate_from_the_views(kube):
    gateconfig(kube)
    reconcile(kube, model_of(kube))
    gc = kube.objects[("GateConfig", "ns", "default-gate")]
    # What the gate binding reads: the GateConfig as its event delivered it, the models' views.
    view = fleet_view.model_view(model_of(kube))
    assert modelsync.stale_models(gc, [view]) == []
    assert modelsync.stale_models(gc, [model_of(kube)]) == []  # the view decides as the object does
    gc["spec"]["params"]["entropyBeta"] = 0.3
    assert modelsync.stale_models(gc, [view]) == ["moe-small"]
    # Gone: the model renders a gate but should now be Degraded.
    assert modelsync.stale_models(None, [view]) == ["moe-small"]
    # Never reconciled yet: its own reconcile is pending and resolves the gate itself.
    fresh = {**view, "status": {}}
    assert modelsync.stale_models(gc, [fresh]) == [] and modelsync.stale_models(None, [fresh]) == []


def test_a_model_whose_apply_was_refused_is_not_stale_for_an_unchanged_gate(kube):
    """Degraded (ApplyFailed: a quota, an admission webhook) is no missing gate: the gate binding must
    not re-reconcile such a model on every event of its GateConfig (a status write each rollout tick,
    each re-render one more refused apply and a failed handler) nor on each of its own events."""
    gateconfig(kube)
    reconcile(kube, model_of(kube))
    gc = kube.objects[("GateConfig", "ns", "default-gate")]
    refused = model_of(kube)
    refused["status"]["conditions"] = [{**c, "status": "True", "reason": "ApplyFailed", "message": "quota"}
                                       if c["type"] == "Degraded" else c for c in refused["status"]["conditions"]]
    for seen in (refused, fleet_view.model_view(refused)):
        assert modelsync.stale_models(gc, [seen]) == []
        assert modelsync.stale_models(None, [seen]) == ["moe-small"]  # its GateConfig gone: it is
    gc["spec"]["params"]["entropyBeta"] = 0.3
    assert modelsync.stale_models(gc, [fleet_view.model_view(refused)]) == ["moe-small"]  # a new gate: it is
    # Degraded for want of a gate, and the GateConfig (back) has one: stale, whatever it rendered before.
    missing = {**refused, "status": {**refused["status"], "conditions": [
        {**c, "reason": "GateConfigNotFound"} if c["type"] == "Degraded" else c
        for c in refused["status"]["conditions"]]}}
    missing["status"].pop("gateVersion", None)
    assert modelsync.stale_models(gc, [fleet_view.model_view(missing)]) == ["moe-small"]


def test_status_writes_skip_a_recreated_model(kube):
    old = model_of(kube)
    recreated = model_of(kube)
    recreated["metadata"]["uid"] = "uid-2"
    kube.put(recreated)  # a new object: another uid and resourceVersion
    gateconfig(kube)
    reconcile(kube, old)
    assert "status" not in model_of(kube)



def test_model_without_image_gets_the_operators_default_from_env(kube, monkeypatch):
    """The chart passes modelServer.image as SPARSEGATE_MODEL_IMAGE(_PULL_POLICY)."""
    gateconfig(kube)
    model = model_of(kube)
    model["spec"].pop("image", None)  # examples/ leave it out
    kube.put(model)
    monkeypatch.setenv("SPARSEGATE_MODEL_IMAGE", "localhost/sparsegate-model-server:dev")
    monkeypatch.setenv("SPARSEGATE_MODEL_IMAGE_PULL_POLICY", "Never")
    reconcile(kube, model_of(kube))
    (c,) = kube.get("Deployment", namespace="ns", name="moe-small")["spec"]["template"]["spec"]["containers"]
    assert (c["image"], c["imagePullPolicy"]) == ("localhost/sparsegate-model-server:dev", "Never")


def stuck_pod(k, name, reason, message):
    k.put({"kind": "Pod", "metadata": {"name": name, "namespace": "ns", "labels": {"sparsegate.dev/model": "moe-small"}},
           "status": {"phase": "Running", "containerStatuses": [
               {"name": "server", "ready": False, "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}}}]}})


def test_ready_names_pods_whose_containers_cannot_start(kube):
    gateconfig(kube)
    reconcile(kube, model_of(kube))
    stuck_pod(kube, "moe-small-a", "ErrImageNeverPull", 'Container image "x" is not present with pull policy of Never')
    stuck_pod(kube, "moe-small-b", "ContainerCreating", "")  # just takes time: not named
    deployment = kube.get("Deployment", namespace="ns", name="moe-small")
    deployment["status"] = {"replicas": 2, "readyReplicas": 0, "updatedReplicas": 2}
    pods = [fleet_view.pod_view(p) for (kind, _, _), p in kube.objects.items() if kind == "Pod"]
    modelsync.refresh_from_deployment(kube, namespace="ns", name="moe-small", deployment=deployment, pods=pods,
                                      events=lambda *a: None, status_inputs=StatusInputs())
    ready = conditions(kube)["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "ContainersFailing"
    assert "moe-small-a/server: ErrImageNeverPull" in ready["message"] and "moe-small-b" not in ready["message"]
    # Once every replica is ready the pods are not looked at, and Ready is True.
    deployment["status"] = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1}
    deployment["metadata"]["generation"] = 1
    modelsync.refresh_from_deployment(kube, namespace="ns", name="moe-small", deployment=deployment, pods=pods,
                                      events=lambda *a: None, status_inputs=StatusInputs())
    assert conditions(kube)["Ready"]["status"] == "True"


def test_ready_comes_from_the_deployment_as_it_is_when_status_is_written(kube):
    """The Deployment controller can observe an apply (and the event handler write Ready) before
    the reconcile writes its status: the reconcile must not write back the apply's stale view."""
    gateconfig(kube)
    apply = kube.apply

    def apply_then_controller_observes(obj):
        applied = copy.deepcopy(apply(obj))
        if obj["kind"] == "Deployment":
            stored = kube.objects[("Deployment", "ns", "moe-small")]
            stored["metadata"]["generation"] = 1
            stored["status"] = {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
        return applied  # the response predates the controller's update

    kube.apply = apply_then_controller_observes
    reconcile(kube, model_of(kube))
    assert conditions(kube)["Ready"]["status"] == "True"


@pytest.mark.parametrize("case", ["token-only", "other-model", "expiring", "mismatched-key", "deleted-owner",
                                  "orphaned"])
def test_an_unusable_admin_secret_is_replaced_with_a_complete_one(kube, case):
    """A Secret from an operator before the TLS admin channel (token only), one whose certificate
    names another model, one ending within 30 days, or one whose key is of another pair, is replaced
    (PUT with its resourceVersion); so is a complete one that is not this model's: left by a deleted
    model of the same name (the garbage collector would remove it from under this one) or orphaned."""
    import base64
    import datetime

    gateconfig(kube)
    now = datetime.datetime.now(datetime.timezone.utc)
    if case == "token-only":
        data = {"token": base64.b64encode(b"old-token").decode()}
    else:
        name = "other.ns.admin.sparsegate.dev" if case == "other-model" else "moe-small.ns.admin.sparsegate.dev"
        cert, key = admin_tls.issue(server_name=name, now=now,
                                    validity=datetime.timedelta(days=10 if case == "expiring" else 365))
        if case == "mismatched-key":  # tls.key of another pair: the server cannot load it
            key = admin_tls.issue(server_name=name, now=now)[1]
        data = admin_tls.AdminMaterial(token="old-token", cert_pem=cert, key_pem=key).secret_data()
    owner = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "name": "moe-small",
             "uid": "uid-0" if case == "deleted-owner" else "uid-1", "controller": True}
    kube.put({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": "moe-small-admin", "namespace": "ns",
                           "ownerReferences": [] if case == "orphaned" else [owner]}, "data": data})
    events = []
    assert reconcile(kube, model_of(kube), events=events) == "success"
    assert kube.replaced == ["Secret"]
    secret = kube.get("Secret", namespace="ns", name="moe-small-admin")
    assert admin_tls.secret_problem(secret, server_name="moe-small.ns.admin.sparsegate.dev", now=now) is None
    assert admin_tls.material_from_secret(secret).token != "old-token"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    replaced = [e[3] for e in events if e[2] == "AdminSecretReplaced"]
    assert len(replaced) == 1
    if case in ("deleted-owner", "orphaned"):
        assert ("uid-0" if case == "deleted-owner" else "no owner") in replaced[0]
    # Complete now: the next reconcile leaves it alone.
    reconcile(kube, model_of(kube))
    assert kube.replaced == ["Secret"]


def test_a_model_recreated_under_its_name_takes_its_admin_secret_over(kube):
    """Deleted and created again (a new uid) before the garbage collector removed the old
    dependents: the Secret the old model left is replaced with one this model owns, as the applied
    objects are re-owned, so the collector does not delete it from under the new model."""
    gateconfig(kube)
    reconcile(kube, model_of(kube))
    m = model_of(kube)
    m["metadata"]["uid"] = "uid-2"
    m.pop("status")
    kube.put(m)
    reconcile(kube, model_of(kube), applied=AppliedObjects(interval_s=3600))
    for kind, name in [("Deployment", "moe-small"), ("ConfigMap", "moe-small-gate"), ("Secret", "moe-small-admin")]:
        assert [r["uid"] for r in kube.get(kind, namespace="ns", name=name)["metadata"]["ownerReferences"]] == ["uid-2"]


def test_a_new_model_costs_no_secret_deployment_or_gateconfig_read(kube):
    """Never reconciled: the GateConfig comes from the watch, not a GET; the admin Secret is
    created straight away (no GET first); the Deployment status comes from the apply and the
    watch, not a GET; the status write starts from the model as delivered. A reconciled model
    reads its Secret (it may need replacing) and creates none. A new model reads its ConfigMap and
    Service once, each before its apply (``modelsync.check_not_foreign``); a reconciled one does not."""
    gateconfig(kube)
    model = model_of(kube)
    kube.calls.clear()
    reconcile(kube, model)
    # The Service beside the rest (it may land at any point: nothing waits for it); Secret and
    # ConfigMap at once (in any order), then the Deployment that mounts them, then status.
    assert kube.calls.count(("apply", "Service")) == 1
    for kind in ("ConfigMap", "Service"):
        assert kube.calls.count(("get", kind)) == 1
        assert kube.calls.index(("get", kind)) < kube.calls.index(("apply", kind))
    rest = [call for call in kube.calls if call not in (("apply", "Service"), ("get", "Service"), ("get", "ConfigMap"))]
    assert sorted(rest[:2]) == [("apply", "ConfigMap"), ("create", "Secret")]
    assert rest[2:] == [("apply", "Deployment"), ("status", "SparseModel")]
    assert model_of(kube)["status"]["gateVersion"]  # resolved from the watched GateConfig
    model = model_of(kube)
    kube.calls.clear()
    reconcile(kube, model)
    assert ("get", "Secret") in kube.calls and ("create", "Secret") not in kube.calls
    assert ("get", "Deployment") not in kube.calls
    assert ("get", "ConfigMap") not in kube.calls and ("get", "Service") not in kube.calls


def test_newest_deployment_prefers_the_watch_once_it_has_seen_the_apply():
    def dep(uid="d1", generation=2, ready=0):
        return {"metadata": {"uid": uid, "generation": generation}, "status": {"readyReplicas": ready}}

    applied = dep(generation=3)
    assert modelsync.newest_deployment(applied, None) is applied
    assert modelsync.newest_deployment(None, dep()) == dep()
    assert modelsync.newest_deployment(applied, dep(generation=2, ready=2)) is applied  # predates the apply
    seen = dep(generation=3, ready=2)
    assert modelsync.newest_deployment(applied, seen) is seen  # has the controller's work since
    assert modelsync.newest_deployment(applied, dep(uid="old", generation=9)) is applied  # another object


def ready_deployment(kube, *, ready):
    deployment = kube.objects[("Deployment", "ns", "moe-small")]
    deployment["metadata"]["generation"] = 1
    deployment["status"] = {"observedGeneration": 1, "replicas": 2, "readyReplicas": ready, "updatedReplicas": 2}
    return copy.deepcopy(deployment)


def test_a_refresh_from_the_inputs_status_was_written_from_sends_nothing(kube):
    gateconfig(kube)
    inputs = StatusInputs()
    reconcile(kube, model_of(kube))
    deployment = ready_deployment(kube, ready=1)
    reconcile(kube, model_of(kube), inputs=inputs)  # writes Ready from this Deployment (as watched)

    def refresh(deployment):
        kube.calls.clear()
        sent = modelsync.refresh_from_deployment(kube, namespace="ns", name="moe-small", deployment=deployment,
                                                 pods=[], events=lambda *a: None, status_inputs=inputs)
        return sent, list(kube.calls)

    # The Deployment event with what the reconcile already wrote from: nothing read, nothing written.
    assert refresh(deployment) == (False, [])
    assert conditions(kube)["Ready"]["status"] == "False"
    # A replica became ready: read and written, and that is recorded in turn.
    deployment = ready_deployment(kube, ready=2)
    assert refresh(deployment) == (True, [("get", "SparseModel"), ("status", "SparseModel")])
    assert conditions(kube)["Ready"]["status"] == "True"
    assert refresh(deployment) == (False, [])
    # Back to one ready replica: the inputs differ from the last write, not from an older one.
    assert refresh(ready_deployment(kube, ready=1))[0] is True
    assert conditions(kube)["Ready"]["status"] == "False"
    # The same inputs for a model re-created under the name (another uid) are not taken as written.
    other = copy.deepcopy(deployment)
    other["metadata"]["ownerReferences"][0]["uid"] = "uid-9"
    assert refresh(other)[0] is True
    # A pod that cannot start changes the inputs too.
    stuck_pod(kube, "moe-small-a", "CrashLoopBackOff", "back-off")
    pods = [fleet_view.pod_view(kube.objects[("Pod", "ns", "moe-small-a")])]
    kube.calls.clear()
    assert modelsync.refresh_from_deployment(kube, namespace="ns", name="moe-small", deployment=deployment, pods=pods,
                                             events=lambda *a: None, status_inputs=inputs)


def test_the_deployment_view_gives_the_same_inputs_as_the_object(kube):
    gateconfig(kube)
    reconcile(kube, model_of(kube))
    deployment = ready_deployment(kube, ready=1)
    view = fleet_view.deployment_view(deployment)
    assert model_status.workload_inputs(view, []) == model_status.workload_inputs(deployment, [])
    assert view["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert len(repr(view)) * 3 < len(repr(deployment))


def refresh_with(kube, deployment, pods, inputs, events=None):
    return modelsync.refresh_from_deployment(kube, namespace="ns", name="moe-small", deployment=deployment, pods=pods,
                                             events=(lambda *a: events.append(a[1:])) if events is not None
                                             else (lambda *a: None), status_inputs=inputs)


def test_a_progress_deadline_is_kept_in_the_deployment_view_and_its_change_refreshes_the_model(kube):
    gateconfig(kube)
    inputs = StatusInputs()
    reconcile(kube, model_of(kube))
    deployment = ready_deployment(kube, ready=1)
    deployment["status"]["conditions"] = [
        {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable", "message": "x" * 100},
        {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated", "message": "y" * 100}]
    view = fleet_view.deployment_view(deployment)
    assert "conditions" not in view["status"]  # the usual reasons decide nothing: not kept
    assert refresh_with(kube, view, [], inputs) is True
    assert conditions(kube)["Reconciling"]["status"] == "True"
    assert refresh_with(kube, view, [], inputs) is False  # same inputs: nothing sent
    deployment["status"]["conditions"][1] = {
        "type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
        "lastUpdateTime": "2026-01-01T00:10:00Z", "message": 'ReplicaSet "moe-small-7d9f" has timed out progressing.'}
    view = fleet_view.deployment_view(deployment)
    assert view["status"]["conditions"] == [{k: deployment["status"]["conditions"][1][k]
                                             for k in ("type", "status", "reason", "message")}]
    assert model_status.workload_inputs(view, []) == model_status.workload_inputs(deployment, [])
    assert refresh_with(kube, view, [], inputs) is True  # the deadline alone changes the inputs
    conds = conditions(kube)
    assert (conds["Stalled"]["status"], conds["Stalled"]["reason"]) == ("True", "ProgressDeadlineExceeded")
    assert "has timed out progressing" in conds["Stalled"]["message"] and conds["Reconciling"]["status"] == "False"


def test_the_pod_view_keeps_only_its_first_failing_container():
    full = {"metadata": {"name": "moe-small-a", "namespace": "ns", "labels": {"sparsegate.dev/model": "moe-small"}},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": "server", "ready": False, "restartCount": 4, "image": "i" * 200, "imageID": "j" * 200,
                 "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
                 "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}}},
                {"name": "side", "restartCount": 0, "state": {"waiting": {"reason": "ImagePullBackOff"}}}]}}
    view = fleet_view.pod_view(full)
    assert view["status"]["containerStatuses"] == [
        {"name": "server", "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}}}]
    assert view["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] is sys.intern("CrashLoopBackOff")
    assert container_problems([view]) == ["moe-small-a/server: CrashLoopBackOff: back-off 40s restarting"]
    # A container that exited non-zero again after a restart is failing too; a running one is not kept.
    full["status"]["containerStatuses"] = [{"name": "server", "restartCount": 2, "state": {
        "terminated": {"exitCode": 2, "reason": "Error", "startedAt": "t", "finishedAt": "t", "containerID": "c"}}}]
    view = fleet_view.pod_view(full)
    assert container_problems([view]) == container_problems([full]) == \
        ["moe-small-a/server: Error: exit code 2"]
    full["status"]["containerStatuses"] = [{"name": "server", "ready": True, "restartCount": 2, "state": {"running": {}}}]
    assert "containerStatuses" not in fleet_view.pod_view(full)["status"]


def test_a_new_pod_that_cannot_run_stalls_a_rollout_while_the_old_pods_still_serve(kube):
    """Default strategy at 2 replicas: one pod of the new revision is added and both old ones keep
    serving (2 ready, 1 updated, 3 in all). A new pod that cannot run is reported at once, not
    when the Deployment's progress deadline (600 s) runs out."""
    gateconfig(kube)
    inputs = StatusInputs()
    reconcile(kube, model_of(kube))
    deployment = ready_deployment(kube, ready=2)
    deployment["status"].update(replicas=3, updatedReplicas=1)
    stuck_pod(kube, "moe-small-new", "CrashLoopBackOff", "back-off 10s restarting failed container")
    pods = [fleet_view.pod_view(kube.objects[("Pod", "ns", "moe-small-new")])]
    events = []
    assert refresh_with(kube, deployment, pods, inputs, events) is True
    conds = conditions(kube)
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "ContainersFailing")
    assert (conds["Stalled"]["status"], conds["Reconciling"]["status"]) == ("True", "False")
    assert "moe-small-new/server: CrashLoopBackOff" in conds["Stalled"]["message"]
    assert ("Warning", "StalledTrue") in [e[:2] for e in events]
    # Rolled back (or fixed): the failing pod is being deleted and the old ones are all there is.
    pods = [{**pods[0], "metadata": {**pods[0]["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}]
    deployment["status"].update(replicas=2, updatedReplicas=2)
    assert refresh_with(kube, deployment, pods, inputs) is True
    conds = conditions(kube)
    assert (conds["Ready"]["status"], conds["Stalled"]["status"], conds["Reconciling"]["status"]) == \
        ("True", "False", "False")


def test_a_check_waits_for_a_write_of_the_same_model_in_flight(kube):
    """Check and write hold the model's lock: a refresh cannot skip on inputs about to be replaced."""
    gateconfig(kube)
    inputs = StatusInputs()
    reconcile(kube, model_of(kube))
    deployment = ready_deployment(kube, ready=2)
    reconcile(kube, model_of(kube), inputs=inputs)
    done = threading.Event()

    def refresh():
        modelsync.refresh_from_deployment(kube, namespace="ns", name="moe-small", deployment=deployment, pods=[],
                                          events=lambda *a: None, status_inputs=inputs)
        done.set()

    with inputs.guard("ns", "moe-small"):  # a write of this model in flight
        worker = threading.Thread(target=refresh)
        worker.start()
        assert not done.wait(0.2)
    worker.join(5)
    assert done.is_set()


def test_a_deferred_refresh_reads_its_inputs_under_the_guard_so_it_never_writes_older_ones(kube):
    """The race seen at 1,000 models: a deferred refresh that had read "1/2 ready" before the
    settled event's refresh wrote "2/2" then wrote 1/2 over it, and no event came to mend it.
    refresh_from_watched reads the Deployment and pods only once it holds the model's guard."""
    gateconfig(kube)
    inputs = StatusInputs()
    reconcile(kube, model_of(kube), inputs=inputs)
    ready_deployment(kube, ready=1)
    reads = []

    def view():
        reads.append(kube.objects[("Deployment", "ns", "moe-small")]["status"]["readyReplicas"])
        return watched(kube)()

    # The settled event's refresh holds the guard (2/2) while the deferred one (scheduled at 1/2) waits.
    with inputs.guard("ns", "moe-small"):
        done = threading.Event()
        deferred = threading.Thread(target=lambda: (modelsync.refresh_from_watched(
            kube, namespace="ns", name="moe-small", deployment=view, pods=lambda: [], events=lambda *a: None,
            status_inputs=inputs), done.set()))
        deferred.start()
        assert not done.wait(0.2) and reads == []  # it reads nothing before it has the guard
        newest = ready_deployment(kube, ready=2)
        modelsync._refresh(kube, namespace="ns", name="moe-small", deployment=newest, pods=[],
                           events=lambda *a: None, status_inputs=inputs)
    deferred.join(5)
    assert reads == [2]
    assert conditions(kube)["Ready"]["status"] == "True"
    assert model_of(kube)["status"]["readyReplicas"] == 2
    # A Deployment gone meanwhile: nothing read or written (its DELETED event refreshes).
    kube.calls.clear()
    assert modelsync.refresh_from_watched(kube, namespace="ns", name="moe-small", deployment=lambda: None,
                                          pods=lambda: [], events=lambda *a: None, status_inputs=inputs) is False
    assert kube.calls == []


def scaled(k, replicas):
    model = model_of(k)
    model["spec"]["replicas"] = replicas
    model["metadata"]["generation"] += 1
    return k.put(model)


def test_unchanged_objects_are_not_applied_again_while_recorded(kube):
    gateconfig(kube)
    applied = AppliedObjects(interval_s=600)
    reconcile(kube, model_of(kube), applied=applied)
    assert sorted(kube.applied) == ["ConfigMap", "Deployment", "Service"]
    kube.applied.clear(), kube.calls.clear()
    # A replica change renders the same ConfigMap and Service and the same admin-Secret check.
    reconcile(kube, scaled(kube, 3), applied=applied)
    assert kube.applied == ["Deployment"]
    assert [c for c in kube.calls if c[1] == "Secret"] == []
    assert model_of(kube)["status"]["observedGeneration"] == 2
    # A gate change renders a new ConfigMap: it (and the Deployment) are applied, the Service not.
    kube.applied.clear()
    gateconfig(kube, toolGateThreshold=0.7)
    reconcile(kube, model_of(kube), applied=applied)
    assert sorted(kube.applied) == ["ConfigMap", "Deployment"]


def test_without_records_or_once_forgotten_or_expired_everything_is_applied(kube):
    gateconfig(kube)
    for applied in (None, AppliedObjects(interval_s=0), AppliedObjects(interval_s=1e-9)):
        reconcile(kube, model_of(kube), applied=applied)
        kube.applied.clear(), kube.calls.clear()
        reconcile(kube, model_of(kube), applied=applied)
        assert sorted(kube.applied) == ["ConfigMap", "Deployment", "Service"], applied
        assert ("get", "Secret") in kube.calls
    applied = AppliedObjects(interval_s=600)
    reconcile(kube, model_of(kube), applied=applied)
    applied.forget(("ns", "moe-small"))  # its Deployment was deleted
    kube.applied.clear()
    reconcile(kube, model_of(kube), applied=applied)
    assert sorted(kube.applied) == ["ConfigMap", "Deployment", "Service"]


def test_a_failed_apply_is_not_recorded_so_the_retry_applies_it(kube):
    gateconfig(kube)
    applied = AppliedObjects(interval_s=600)
    kube.fail_apply = "Service"
    with pytest.raises(KubeError):
        reconcile(kube, model_of(kube), applied=applied)
    kube.fail_apply = None
    kube.applied.clear()
    reconcile(kube, model_of(kube), applied=applied)
    assert sorted(kube.applied) == ["Deployment", "Service"]  # the ConfigMap had landed


def test_a_recreated_model_under_the_same_name_is_applied_in_full(kube):
    gateconfig(kube)
    applied = AppliedObjects(interval_s=600)
    reconcile(kube, model_of(kube), applied=applied)
    model = model_of(kube)
    model["metadata"]["uid"] = "uid-2"  # owner references (and the Secret check) name the new uid
    kube.put(model)
    kube.applied.clear(), kube.calls.clear()
    reconcile(kube, model_of(kube), applied=applied)
    assert sorted(kube.applied) == ["ConfigMap", "Deployment", "Service"]
    assert ("get", "Secret") in kube.calls


def handle(k, applied: AppliedObjects, model: dict) -> None:
    """The Kopf create/update/resume handler (``handlers.sparsemodel.reconcile_model``) for ``model``
    (its Events are posted nowhere: ``sparsemodel.post_event`` patched by the caller)."""
    memo = kopf.Memo(kube=k, applied_objects=applied, status_inputs=StatusInputs(),
                     model_pool=concurrent.futures.ThreadPoolExecutor(max_workers=1),
                     status_pool=concurrent.futures.ThreadPoolExecutor(max_workers=1))
    read_deployment, read_gate = watched(k), watched_gates(k)

    class Deployments(dict):  # the watch's Deployment views, as stored at once
        def get(self, key, default=None):
            view = read_deployment() if key == ("ns", "moe-small") else None
            return [view] if view is not None else default

    class Gates(dict):
        def get(self, key, default=None):
            view = read_gate(*key)
            return [view] if view is not None else default

    views = dict(sparsegate_model_views={}, sparsegate_model_pod_views={},
                 sparsegate_model_deployment_views=Deployments(), sparsegate_model_replicaset_views={},
                 sparsegate_gate_views=Gates())
    asyncio.run(sparsemodel.reconcile_model(body=kopf.Body(copy.deepcopy(model)), namespace="ns", name="moe-small",
                                            memo=memo, logger=LOG, **views))


def test_touching_a_model_puts_back_what_was_deleted_within_the_reapply_interval(kube, monkeypatch):
    """README: to rotate the admin credentials, delete Secret <model>-admin and touch the
    SparseModel. A touch (an annotation: no new generation) applies everything again, where a spec
    change still skips what is unchanged."""
    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    gateconfig(kube)
    applied = AppliedObjects(interval_s=3600)
    handle(kube, applied, model_of(kube))
    secret = kube.get("Secret", namespace="ns", name="moe-small-admin")
    # A spec change (new generation) skips the unchanged objects.
    kube.applied.clear()
    handle(kube, applied, scaled(kube, 2))
    assert kube.applied == ["Deployment"]
    # Someone deletes the admin Secret and the gate ConfigMap, then touches the model.
    del kube.objects[("Secret", "ns", "moe-small-admin")]
    del kube.objects[("ConfigMap", "ns", "moe-small-gate")]
    touched = model_of(kube)
    touched["metadata"].setdefault("annotations", {})["example.com/touched"] = "now"
    kube.applied.clear()
    handle(kube, applied, kube.put(touched))
    assert sorted(kube.applied) == ["ConfigMap", "Deployment", "Service"]
    reissued = kube.get("Secret", namespace="ns", name="moe-small-admin")
    assert reissued is not None and reissued["data"]["token"] != secret["data"]["token"]


def test_a_deleted_model_that_never_had_a_deployment_leaves_nothing_behind(kube):
    """The records of a model are dropped on its Deployment's DELETED event; a model without one
    (here: its GateConfig missing, so nothing rendered), deleted with its namespace, has none:
    its own DELETED event, as the SparseModel event handlers get it, drops them."""
    import sparsegate.main  # noqa: F401  (registers every handler)
    from sparsegate_contracts import names

    inputs, applied = StatusInputs(), AppliedObjects(interval_s=3600)
    assert reconcile(kube, model_of(kube), inputs=inputs, applied=applied) == "degraded"
    applied.record_failure(("ns", "moe-small"), {"kind": "Service", "metadata": {"name": "moe-small"}}, "refused")
    assert inputs._seen and applied._failures
    model = model_of(kube)
    memo = kopf.Memo(kube=kube, status_inputs=inputs, applied_objects=applied)
    views = dict(sparsegate_model_views={}, sparsegate_model_pod_views={}, sparsegate_model_deployment_views={},
                 sparsegate_model_replicaset_views={}, sparsegate_gate_views={})
    # Every SparseModel event handler of the model reconcile's modules (the access loop's has its own test).
    modules = ("sparsegate.handlers.sparsemodel", "sparsegate.handlers.gatebinding", "sparsegate.handlers.diffbase")
    handlers = [h for h in kopf.get_default_registry()._watching.get_all_handlers()
                if h.selector.any_name == names.SPARSEMODELS and h.fn.__module__ in modules]
    assert len(handlers) >= 2

    async def deliver(models: dict) -> None:
        for h in handlers:
            kwargs = dict(type="DELETED", body=kopf.Body(model), namespace="ns", name="moe-small",
                          uid=model["metadata"]["uid"], memo=memo, logger=LOG, **{**views, **models})
            if h.when is None or h.when(**kwargs):
                await h.fn(**kwargs)

    # A model re-created under the name (already in the watch's index) keeps its records.
    asyncio.run(deliver({"sparsegate_model_views": {("ns", "moe-small"): [{"metadata": {"uid": "uid-2"}}]}}))
    assert inputs._seen and applied._failures
    asyncio.run(deliver({}))
    assert inputs._seen == {} and applied._failures == {} and len(applied) == 0


@pytest.mark.parametrize("known", [True, False])
def test_a_deployment_listed_again_after_a_watch_restart_refreshes_a_model_whose_status_it_moved(kube, known,
                                                                                                   monkeypatch):
    """Kopf lists every Deployment again when its watch restarts (a 410 Gone, as after an API server
    restart): those events (type None) are the only word of a change made during the gap. The
    first listing of a process is left to the models' resume handlers (nothing written yet)."""
    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    gateconfig(kube)
    inputs = StatusInputs()
    reconcile(kube, model_of(kube), inputs=inputs)  # the Deployment as applied: nothing ready yet
    assert model_of(kube)["status"]["readyReplicas"] == 0
    if not known:
        inputs.forget("ns", "moe-small")  # a new process: its resume handler writes the model first
    # During the gap, every replica became ready.
    deployment = kube.objects[("Deployment", "ns", "moe-small")]
    deployment["metadata"].update(generation=1, uid="dep-1")
    deployment["status"] = {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    memo = kopf.Memo(kube=kube, status_inputs=inputs, applied_objects=AppliedObjects(interval_s=0),
                     status_pool=concurrent.futures.ThreadPoolExecutor(max_workers=1),
                     deferred_refreshes=DeferredRefreshes(delay_s=0))
    view = fleet_view.deployment_view(deployment)
    views = dict(sparsegate_model_views={}, sparsegate_model_pod_views={},
                 sparsegate_model_deployment_views={("ns", "moe-small"): [view]},
                 sparsegate_model_replicaset_views={}, sparsegate_gate_views={})
    asyncio.run(sparsemodel.deployment_changed(type=None, body=kopf.Body(copy.deepcopy(deployment)), memo=memo,
                                               logger=LOG, **views))
    assert model_of(kube)["status"]["readyReplicas"] == (2 if known else 0)


class HeldPool(concurrent.futures.Executor):
    """A status pool whose jobs run (each in a thread of its own) when and in the order the test says:
    four pool threads racing for one model's guard take it in any order."""

    def __init__(self) -> None:
        self.jobs: list[tuple[concurrent.futures.Future, Any]] = []

    def submit(self, fn, /, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.append((future, lambda: fn(*args, **kwargs)))
        return future

    async def run(self, index: int) -> None:
        future, call = self.jobs[index]
        threading.Thread(target=lambda: future.set_result(call())).start()
        await asyncio.wrap_future(future)


def test_a_stuck_pods_refresh_reads_its_inputs_under_the_guard_so_it_never_writes_older_ones(kube, monkeypatch):
    """A crash-looping pod's event handed the status pool the Deployment and pods as watched then
    (1/2 ready, the pod failing); the pod recovered and the Deployment's next event (2/2 ready)
    was refreshed by another pool thread that took the model's guard first. The pod's refresh then
    wrote its older inputs over it: Ready=False, Stalled=True (ContainersFailing) with every
    replica ready, and no event came to mend it (a running pod's events refresh nothing)."""
    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    gateconfig(kube)
    inputs = StatusInputs()
    reconcile(kube, model_of(kube), inputs=inputs)
    stuck_pod(kube, "moe-small-a", "CrashLoopBackOff", "back-off")
    stuck = fleet_view.pod_view(kube.objects[("Pod", "ns", "moe-small-a")])
    pod_views = {("ns", "moe-small"): [stuck]}
    deployment_views = {("ns", "moe-small"): [fleet_view.deployment_view(ready_deployment(kube, ready=1))]}
    pool = HeldPool()
    memo = kopf.Memo(kube=kube, status_inputs=inputs, applied_objects=AppliedObjects(interval_s=0),
                     status_pool=pool, deferred_refreshes=DeferredRefreshes(delay_s=0))
    views = dict(sparsegate_model_views={}, sparsegate_model_pod_views=pod_views,
                 sparsegate_model_deployment_views=deployment_views, sparsegate_model_replicaset_views={},
                 sparsegate_gate_views={})

    async def main() -> None:
        pod_event = asyncio.create_task(sparsemodel.pod_stuck(body=kopf.Body(copy.deepcopy(stuck)), memo=memo, **views))
        await asyncio.sleep(0.05)
        # The pod recovered and every replica is ready: the watch's views move on, the Deployment's event comes.
        running = copy.deepcopy(stuck)
        running["status"]["containerStatuses"] = [{"name": "server", "ready": True, "restartCount": 1,
                                                   "state": {"running": {}}}]
        pod_views[("ns", "moe-small")] = [running]
        deployment = ready_deployment(kube, ready=2)
        deployment_views[("ns", "moe-small")] = [fleet_view.deployment_view(deployment)]
        deployment_event = asyncio.create_task(sparsemodel.deployment_changed(
            type="MODIFIED", body=kopf.Body(copy.deepcopy(deployment)), memo=memo, logger=LOG, **views))
        await asyncio.sleep(0.05)
        assert len(pool.jobs) == 2
        await pool.run(1)  # the Deployment's refresh takes the guard first
        await deployment_event
        assert conditions(kube)["Ready"]["status"] == "True"
        await pool.run(0)  # then the pod's
        await pod_event

    asyncio.run(main())
    conds = conditions(kube)
    assert (conds["Ready"]["status"], conds["Stalled"]["status"]) == ("True", "False"), conds["Ready"]
    assert model_of(kube)["status"]["readyReplicas"] == 2


@pytest.mark.parametrize("owner", ["none", "other"])
def test_a_users_configmap_or_service_of_the_name_is_reported_not_taken_over(kube, owner):
    """A ConfigMap ``<model>-gate`` and a Service ``<model>`` that existed before the model (a
    user's) are refused with the reason in Degraded: a forced apply took over the Service's
    selector and added the model's ownerReference to both, so deleting the model deleted them."""
    gateconfig(kube)
    refs = [] if owner == "none" else [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "db",
                                        "uid": "db-uid", "controller": True}]
    mine = {"ConfigMap": {"data": {"important": "user data"}},
            "Service": {"spec": {"selector": {"app": "db"}, "ports": [{"port": 5432}]}}}
    for kind, name in [("ConfigMap", "moe-small-gate"), ("Service", "moe-small")]:
        kube.put({"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": "ns",
                                                                 "ownerReferences": refs}, **mine[kind]})
    users = {k: kube.get(k, namespace="ns", name=n) for k, n in [("ConfigMap", "moe-small-gate"), ("Service", "moe-small")]}
    with pytest.raises(KubeError):
        reconcile(kube, model_of(kube), applied=AppliedObjects(interval_s=3600))
    for kind, before in users.items():
        assert kube.get(kind, namespace="ns", name=before["metadata"]["name"]) == before  # untouched
    assert "ConfigMap" not in kube.applied and "Service" not in kube.applied and "Deployment" not in kube.applied
    degraded = conditions(kube)["Degraded"]
    assert degraded["reason"] == "ApplyFailed" and "moe-small-gate already exists" in degraded["message"]
    assert conditions(kube)["Ready"]["status"] == "False"


def test_objects_a_model_of_the_same_name_left_orphaned_are_taken_over(kube):
    """``kubectl delete --cascade=orphan`` then the model created again: the objects the operator
    made (its labels, no owner) are the new model's, as a predecessor's still owned ones are."""
    gateconfig(kube)
    reconcile(kube, model_of(kube))
    for kind, name in [("ConfigMap", "moe-small-gate"), ("Service", "moe-small"), ("Deployment", "moe-small")]:
        obj = kube.get(kind, namespace="ns", name=name)
        del obj["metadata"]["ownerReferences"]
        kube.put(obj)
    m = model_of(kube)
    m["metadata"]["uid"] = "uid-2"
    m.pop("status")
    kube.put(m)
    assert reconcile(kube, model_of(kube)) == "success"
    for kind, name in [("ConfigMap", "moe-small-gate"), ("Service", "moe-small")]:
        assert [r["uid"] for r in kube.get(kind, namespace="ns", name=name)["metadata"]["ownerReferences"]] == ["uid-2"]


def test_a_retry_that_lands_after_the_configmap_and_service_both_failed_clears_degraded(kube):
    """A first reconcile whose ConfigMap and Service were both refused (a namespace quota spent, or
    a user's objects of those names): the retry, once both land, clears Degraded and records the
    gate. It wrote status assuming the Service failed again, without the gate, and the rewrite once
    the Service landed took that for a newer reconcile's status and kept its Degraded for good."""
    gateconfig(kube)
    applied = AppliedObjects(interval_s=3600)
    apply = kube.apply

    def refuse(obj):
        if obj["kind"] in ("ConfigMap", "Service"):
            raise KubeError(403, "Forbidden", {"message": f"exceeded quota: {obj['kind']}"})
        return apply(obj)
    kube.apply = refuse
    with pytest.raises(KubeError):
        reconcile(kube, model_of(kube), applied=applied)
    assert conditions(kube)["Degraded"]["reason"] == "ApplyFailed"
    kube.apply = apply
    reconcile(kube, model_of(kube), applied=applied)
    assert conditions(kube)["Degraded"]["status"] == "False", conditions(kube)["Degraded"]
    assert model_of(kube)["status"]["gateVersion"]


def test_a_users_service_stays_refused_on_the_retries_after_the_first_status_named_the_gate(kube):
    """The first reconcile writes status (with the gate) before its Service apply ends: Kopf's
    retry, and a resumed operator that has no record of the failure, still refuse the user's Service."""
    gateconfig(kube)
    user = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "moe-small", "namespace": "ns"},
            "spec": {"selector": {"app": "db"}, "ports": [{"port": 5432}]}}
    kube.put(user)
    user = kube.get("Service", namespace="ns", name="moe-small")
    applied = AppliedObjects(interval_s=3600)
    for records in (applied, applied, AppliedObjects(interval_s=3600)):  # the retry, then a restarted operator
        with pytest.raises(KubeError):
            reconcile(kube, model_of(kube), applied=records)
        assert kube.get("Service", namespace="ns", name="moe-small") == user
        assert "Service moe-small already exists" in conditions(kube)["Degraded"]["message"]


def live_views(k) -> dict:
    """The Kopf indexes as the handlers get them, each reading the stored objects at once."""
    class Live(dict):
        def __init__(self, kind, view):
            super().__init__()
            self.kind, self.view = kind, view

        def get(self, key, default=None):
            obj = k.objects.get((self.kind, *key))
            return [self.view(obj)] if obj is not None else default
    return dict(sparsegate_model_views=Live("SparseModel", fleet_view.model_view), sparsegate_model_pod_views={},
                sparsegate_model_deployment_views=Live("Deployment", fleet_view.deployment_view),
                sparsegate_model_replicaset_views={}, sparsegate_gate_views=Live("GateConfig", fleet_view.gate_view))


def drift_memo(k, applied: AppliedObjects, inputs: StatusInputs) -> kopf.Memo:
    return kopf.Memo(kube=k, status_inputs=inputs, applied_objects=applied,
                     model_pool=concurrent.futures.ThreadPoolExecutor(max_workers=1),
                     status_pool=concurrent.futures.ThreadPoolExecutor(max_workers=1),
                     deferred_refreshes=DeferredRefreshes(delay_s=0))


def applied_at_generation(k, applied: AppliedObjects, inputs: StatusInputs) -> dict:
    """The model reconciled by this process, its Deployment (uid dep-1) at generation 1 as our apply returned it."""
    gateconfig(k)
    reconcile(k, model_of(k), inputs=inputs, applied=applied)
    k.objects[("Deployment", "ns", "moe-small")]["metadata"].update(uid="dep-1", generation=1)
    reconcile(k, model_of(k), inputs=inputs, applied=applied)
    k.applied.clear(), k.calls.clear()
    return k.objects[("Deployment", "ns", "moe-small")]


def test_a_deployment_scaled_or_edited_by_hand_is_put_back_at_its_event(kube, monkeypatch):
    """``kubectl scale deploy/<model> --replicas 5`` (or ``kubectl edit``): the Deployment's event
    carries a generation past the one our last apply returned, so the model is reconciled again
    and its Deployment applied as rendered (replicas from the SparseModel); pods becoming Ready (a
    status change, same generation) apply nothing."""
    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    applied, inputs = AppliedObjects(interval_s=3600), StatusInputs()
    deployment = applied_at_generation(kube, applied, inputs)
    want = model_of(kube)["spec"]["replicas"]
    memo = drift_memo(kube, applied, inputs)

    def event(type_: str = "MODIFIED") -> None:
        body = kopf.Body(copy.deepcopy(kube.objects[("Deployment", "ns", "moe-small")]))
        asyncio.run(sparsemodel.deployment_changed(type=type_, body=body, memo=memo, logger=LOG, **live_views(kube)))

    deployment["status"] = {"observedGeneration": 1, "replicas": want, "readyReplicas": want, "updatedReplicas": want}
    event()  # pods became Ready: status only
    assert kube.applied == []
    deployment["spec"]["replicas"] = 5  # kubectl scale
    deployment["metadata"]["generation"] = 2
    event()
    assert kube.applied == ["Deployment"]  # the ConfigMap and Service were not touched: still recorded
    assert kube.objects[("Deployment", "ns", "moe-small")]["spec"]["replicas"] == want
    kube.applied.clear()
    event()  # the put-back's own event (its generation recorded): nothing more
    event(None)  # nor a listing after a watch restart
    assert kube.applied == []


def test_a_model_deleted_meanwhile_is_not_put_back(kube, monkeypatch):
    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    applied, inputs = AppliedObjects(interval_s=3600), StatusInputs()
    deployment = applied_at_generation(kube, applied, inputs)
    deployment["metadata"]["generation"] = 2
    model = kube.objects[("SparseModel", "ns", "moe-small")]
    model["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    memo = drift_memo(kube, applied, inputs)
    asyncio.run(sparsemodel.deployment_changed(type="MODIFIED", body=kopf.Body(copy.deepcopy(deployment)), memo=memo,
                                               logger=LOG, **live_views(kube)))
    assert kube.applied == []


@pytest.mark.parametrize("kind,name", [("Service", "moe-small"), ("ConfigMap", "moe-small-gate")])
def test_a_deleted_service_or_configmap_is_put_back_at_its_event(kube, monkeypatch, kind, name):
    """Recorded as applied, a reconcile would skip them until ``--reapply-interval``: the DELETED
    event of the model's own Service or ConfigMap applies them again at once. Another's, or one
    whose model is gone or going, is left alone."""
    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    applied, inputs = AppliedObjects(interval_s=3600), StatusInputs()
    applied_at_generation(kube, applied, inputs)
    memo = drift_memo(kube, applied, inputs)
    gone = kube.objects.pop((kind, "ns", name))

    def deleted(obj) -> None:
        asyncio.run(sparsemodel.owned_object_deleted(type="DELETED", body=kopf.Body(copy.deepcopy(obj)), memo=memo,
                                                     logger=LOG, **live_views(kube)))

    other = copy.deepcopy(gone)
    other["metadata"]["ownerReferences"][0]["uid"] = "uid-0"  # a model of the name deleted earlier
    deleted(other)
    assert kube.applied == [] and (kind, "ns", name) not in kube.objects
    deleted(gone)
    assert (kind, "ns", name) in kube.objects and kind in kube.applied
    assert kube.objects[(kind, "ns", name)]["metadata"]["ownerReferences"] == gone["metadata"]["ownerReferences"]
    kube.applied.clear()
    kube.objects.pop((kind, "ns", name))
    kube.objects[("SparseModel", "ns", "moe-small")]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    deleted(gone)
    assert kube.applied == [] and (kind, "ns", name) not in kube.objects


def test_only_the_operators_own_services_and_configmaps_are_watched():
    """The watches of Services and ConfigMaps (only their deletion is handled) select the
    operator's objects by label on the API server: not every one of the served namespaces."""
    from kopf._cogs.structs import references

    import sparsegate.main
    settings = kopf.OperatorSettings()
    memo = kopf.Memo(reapply_interval_s=0)
    sparsegate.main.configure(settings=settings, memo=memo)
    for plural, kind in (("services", "Service"), ("configmaps", "ConfigMap"), ("pods", "Pod")):
        resource = references.Resource(group="", version="v1", plural=plural, kind=kind, namespaced=True)
        selectors = settings.watching.label_selectors.collect(resource)
        assert selectors == ([] if plural == "pods" else [sparsemodel.OWNED_SELECTOR])
    assert sparsemodel.OWNED_SELECTOR == "app.kubernetes.io/managed-by=sparsegate,app.kubernetes.io/name=" \
        + sparsemodel.OWNED_LABELS["app.kubernetes.io/name"]


def test_the_event_of_our_own_apply_seen_before_its_answer_puts_nothing_back(kube, monkeypatch):
    """A reconcile of ours (the HPA scaled the SparseModel) applies the Deployment at a new
    generation, and its watch event can come before the apply's answer is recorded: the check is
    made again in the model's turn, which that reconcile holds until it has recorded it."""
    from sparsegate.handlers.pools import model_turn

    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    applied, inputs = AppliedObjects(interval_s=3600), StatusInputs()
    deployment = applied_at_generation(kube, applied, inputs)
    memo = drift_memo(kube, applied, inputs)

    async def main() -> None:
        async with model_turn("ns", "moe-small"):  # our reconcile, its apply in flight
            deployment["metadata"]["generation"] = 2
            deployment["status"] = {"observedGeneration": 2, "replicas": 0}  # settled: refreshed at once
            event = asyncio.create_task(sparsemodel.deployment_changed(
                type="MODIFIED", body=kopf.Body(copy.deepcopy(deployment)), memo=memo, logger=LOG,
                **live_views(kube)))
            await asyncio.sleep(0.05)
            applied.record_deployment(("ns", "moe-small"), deployment)  # its answer
        await event

    asyncio.run(main())
    assert kube.applied == []


def owned_event(kube, memo, kind: str, name: str, type_: str = "MODIFIED") -> None:
    body = kopf.Body(copy.deepcopy(kube.objects[(kind, "ns", name)]))
    asyncio.run(sparsemodel.owned_object_changed(type=type_, body=body, memo=memo, logger=LOG, **live_views(kube)))


def edit_by_hand(kind: str, obj: dict) -> None:
    if kind == "Service":
        obj["spec"]["selector"] = {"app": "elsewhere"}  # kubectl edit svc: traffic goes elsewhere
    else:
        obj["data"]["gate.json"] = '{"mode": "other"}'  # kubectl edit cm <m>-gate: new pods start with another gate


@pytest.mark.parametrize("kind,name", [("Service", "moe-small"), ("ConfigMap", "moe-small-gate")])
def test_a_service_or_configmap_edited_by_hand_is_put_back_at_its_event(kube, monkeypatch, kind, name):
    """They have no spec generation: the resourceVersion each apply of ours returned is recorded,
    and an event at a newer one (someone else's write) applies the object again at once, not
    only after ``--reapply-interval``. The events of our own applies (their answers' versions)
    cost nothing: no request at all."""
    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    applied, inputs = AppliedObjects(interval_s=3600), StatusInputs()
    applied_at_generation(kube, applied, inputs)
    memo = drift_memo(kube, applied, inputs)
    rendered = copy.deepcopy(kube.objects[(kind, "ns", name)])
    owned_event(kube, memo, kind, name)  # our own last apply's event
    owned_event(kube, memo, kind, name, None)  # a listing after a watch restart
    assert kube.applied == [] and kube.calls == []
    edited = copy.deepcopy(rendered)
    edit_by_hand(kind, edited)
    kube.put(edited)  # a new resourceVersion
    owned_event(kube, memo, kind, name)
    assert sorted(kube.applied) == sorted([kind, "Deployment"])  # the other one still recorded as applied: not touched
    now = kube.objects[(kind, "ns", name)]
    field = "spec" if kind == "Service" else "data"
    assert now[field] == rendered[field]
    kube.applied.clear(), kube.calls.clear()
    owned_event(kube, memo, kind, name)  # the put-back's own event
    assert kube.applied == [] and kube.calls == []
    other = copy.deepcopy(now)
    other["metadata"]["ownerReferences"][0]["uid"] = "uid-0"  # not this model's
    kube.put(other)
    owned_event(kube, memo, kind, name)
    assert kube.applied == []


@pytest.mark.parametrize("kind,name", [("Service", "moe-small"), ("ConfigMap", "moe-small-gate")])
def test_the_event_of_our_own_service_or_configmap_apply_seen_before_its_answer_puts_nothing_back(kube, monkeypatch,
                                                                                                  kind, name):
    """Our apply's event can come before its answer is recorded: checked again once the apply in
    flight has ended (the Service, applied outside the model's turn) and in the model's turn (the
    ConfigMap, applied in it)."""
    from sparsegate.handlers.pools import model_turn

    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    applied, inputs = AppliedObjects(interval_s=3600), StatusInputs()
    applied_at_generation(kube, applied, inputs)
    memo = drift_memo(kube, applied, inputs)
    key, ref = ("ns", "moe-small"), {"kind": kind, "metadata": {"name": name}}

    async def main() -> None:
        async with model_turn("ns", "moe-small"):  # our reconcile, its apply in flight
            applied.begin(key, ref) if kind == "Service" else None
            ours = kube.put(kube.objects[(kind, "ns", name)])  # its write, at a new resourceVersion
            event = asyncio.create_task(sparsemodel.owned_object_changed(
                type="MODIFIED", body=kopf.Body(copy.deepcopy(ours)), memo=memo, logger=LOG, **live_views(kube)))
            await asyncio.sleep(0.05)
            if kind == "ConfigMap":
                applied.record(key, ref, now=0, answer=ours)  # its answer, in the reconcile's turn
        if kind == "Service":  # the Service apply ends after the turn
            await asyncio.sleep(0.1)
            applied.record(key, ref, now=0, answer=ours)
        await event

    asyncio.run(main())
    assert kube.applied == []


def test_a_service_written_by_someone_else_before_our_apply_in_flight_is_recorded_is_put_back(kube, monkeypatch):
    """Our Service apply answered, someone wrote the Service right after, and the write's event comes
    before that answer is recorded: once it is, the write is newer than it, and put back."""
    monkeypatch.setattr(sparsemodel, "post_event", lambda *a: None)
    applied, inputs = AppliedObjects(interval_s=3600), StatusInputs()
    applied_at_generation(kube, applied, inputs)
    memo = drift_memo(kube, applied, inputs)
    key, ref = ("ns", "moe-small"), {"kind": "Service", "metadata": {"name": "moe-small"}}
    rendered = copy.deepcopy(kube.objects[("Service", "ns", "moe-small")])

    async def main() -> None:
        applied.begin(key, ref)
        ours = kube.put(rendered)  # our apply's write; its answer not recorded yet
        edited = copy.deepcopy(ours)
        edit_by_hand("Service", edited)
        theirs = kube.put(edited)
        event = asyncio.create_task(sparsemodel.owned_object_changed(
            type="MODIFIED", body=kopf.Body(copy.deepcopy(theirs)), memo=memo, logger=LOG, **live_views(kube)))
        await asyncio.sleep(0.1)
        applied.record(key, ref, now=0, answer=ours)
        await event

    asyncio.run(main())
    assert "Service" in kube.applied
    assert kube.objects[("Service", "ns", "moe-small")]["spec"] == rendered["spec"]
