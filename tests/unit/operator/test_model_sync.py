"""The reconcile steps (handlers.modelsync) against an in-memory stand-in for our Kube wrapper.

Mocked at our own wrapper layer (clients.kube.Kube), never at HTTP; the real API server runs the
same flows in tests/e2e/operator.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import yaml

from sparsegate.clients.kube import KubeError
from sparsegate.domain import admin_tls, fleet_view
from sparsegate.handlers import modelsync

ROOT = Path(__file__).resolve().parents[3]
LOG = logging.getLogger("test")


class MemoryKube:
    """Objects by (kind, namespace, name); apply replaces, create_if_absent creates once."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.applied: list[str] = []
        self.replaced: list[str] = []
        self.fail_apply: str | None = None
        self.rv = 0

    def put(self, obj: dict) -> dict:
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        m = obj["metadata"]
        self.objects[(obj["kind"], m["namespace"], m["name"])] = obj
        return obj

    def get(self, kind, *, namespace, name):
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def apply(self, obj):
        if self.fail_apply == obj["kind"]:
            raise KubeError(422, "Invalid", {"message": f"{obj['kind']} refused"})
        self.applied.append(obj["kind"])
        return self.put(obj)

    def replace(self, obj):
        m = obj["metadata"]
        current = self.objects.get((obj["kind"], m["namespace"], m["name"]))
        if current is None or current["metadata"]["resourceVersion"] != m.get("resourceVersion"):
            raise KubeError(409, "Conflict", {"message": "resourceVersion changed"})
        self.replaced.append(obj["kind"])
        return self.put(obj)

    def create_if_absent(self, obj):
        m = obj["metadata"]
        if (obj["kind"], m["namespace"], m["name"]) in self.objects:
            return False
        self.put(obj)
        return True

    def update_status(self, kind, *, namespace, name, mutate, attempts=5, current=None):
        current = self.get(kind, namespace=namespace, name=name)
        if current is None:
            return None
        patch = mutate(current)
        if patch is not None:
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
    outcome = modelsync.reconcile(kube, model_of(kube), events=lambda *a: events.append(a), logger=LOG)
    assert outcome == "degraded" and kube.applied == []
    assert conditions(kube)["Degraded"]["reason"] == "GateConfigNotFound"
    assert ("Warning", "DegradedTrue") in {(e[1], e[2]) for e in events}


def test_reconcile_renders_everything_once_and_records_the_gate(kube):
    gateconfig(kube)
    events = []
    assert modelsync.reconcile(kube, model_of(kube), events=lambda *a: events.append(a), logger=LOG) == "success"
    assert kube.applied == ["ConfigMap", "Service", "Deployment"]
    secret = kube.get("Secret", namespace="ns", name="moe-small-admin")
    assert sorted(secret["data"]) == ["tls.crt", "tls.key", "token"]
    assert admin_tls.certificate_names(admin_tls.material_from_secret(secret).cert_pem) == [
        "moe-small.ns.admin.sparsegate.dev"]
    modelsync.reconcile(kube, model_of(kube), events=lambda *a: events.append(a), logger=LOG)
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
        modelsync.reconcile(kube, model_of(kube), events=lambda *a: None, logger=LOG)
    assert conditions(kube)["Degraded"]["reason"] == "ApplyFailed"
    assert "Service refused" in conditions(kube)["Degraded"]["message"]


def test_gate_too_wide_for_the_model_is_invalid(kube):
    gateconfig(kube, maxExpertsPerToken=16)  # the example model has 8 experts
    assert modelsync.reconcile(kube, model_of(kube), events=lambda *a: None, logger=LOG) == "degraded"
    assert conditions(kube)["Degraded"]["reason"] == "GateConfigInvalid"


def test_stale_models_follow_the_resolved_gate_from_the_views(kube):
    gateconfig(kube)
    modelsync.reconcile(kube, model_of(kube), events=lambda *a: None, logger=LOG)
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


def test_status_writes_skip_a_recreated_model(kube):
    old = model_of(kube)
    kube.objects[("SparseModel", "ns", "moe-small")]["metadata"]["uid"] = "uid-2"
    gateconfig(kube)
    modelsync.reconcile(kube, old, events=lambda *a: None, logger=LOG)
    assert "status" not in model_of(kube)



def test_model_without_image_gets_the_operators_default_from_env(kube, monkeypatch):
    """The chart passes modelServer.image as SPARSEGATE_MODEL_IMAGE(_PULL_POLICY)."""
    gateconfig(kube)
    model = model_of(kube)
    model["spec"].pop("image", None)  # examples/ leave it out
    kube.put(model)
    monkeypatch.setenv("SPARSEGATE_MODEL_IMAGE", "localhost/sparsegate-model-server:dev")
    monkeypatch.setenv("SPARSEGATE_MODEL_IMAGE_PULL_POLICY", "Never")
    modelsync.reconcile(kube, model_of(kube), events=lambda *a: None, logger=LOG)
    (c,) = kube.get("Deployment", namespace="ns", name="moe-small")["spec"]["template"]["spec"]["containers"]
    assert (c["image"], c["imagePullPolicy"]) == ("localhost/sparsegate-model-server:dev", "Never")


def stuck_pod(k, name, reason, message):
    k.put({"kind": "Pod", "metadata": {"name": name, "namespace": "ns", "labels": {"sparsegate.dev/model": "moe-small"}},
           "status": {"phase": "Running", "containerStatuses": [
               {"name": "server", "ready": False, "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": message}}}]}})


def test_ready_names_pods_whose_containers_cannot_start(kube):
    gateconfig(kube)
    modelsync.reconcile(kube, model_of(kube), events=lambda *a: None, logger=LOG)
    stuck_pod(kube, "moe-small-a", "ErrImageNeverPull", 'Container image "x" is not present with pull policy of Never')
    stuck_pod(kube, "moe-small-b", "ContainerCreating", "")  # just takes time: not named
    deployment = kube.get("Deployment", namespace="ns", name="moe-small")
    deployment["status"] = {"replicas": 2, "readyReplicas": 0, "updatedReplicas": 2}
    pods = [fleet_view.pod_view(p) for (kind, _, _), p in kube.objects.items() if kind == "Pod"]
    modelsync.refresh_from_deployment(kube, namespace="ns", name="moe-small", deployment=deployment, pods=pods,
                                      events=lambda *a: None)
    ready = conditions(kube)["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "ContainersWaiting"
    assert "moe-small-a/server: ErrImageNeverPull" in ready["message"] and "moe-small-b" not in ready["message"]
    # Once every replica is ready the pods are not looked at, and Ready is True.
    deployment["status"] = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1}
    deployment["metadata"]["generation"] = 1
    modelsync.refresh_from_deployment(kube, namespace="ns", name="moe-small", deployment=deployment, pods=pods,
                                      events=lambda *a: None)
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
    modelsync.reconcile(kube, model_of(kube), events=lambda *a: None, logger=LOG)
    assert conditions(kube)["Ready"]["status"] == "True"


@pytest.mark.parametrize("case", ["token-only", "other-model", "expiring"])
def test_an_unusable_admin_secret_is_replaced_with_a_complete_one(kube, case):
    """A Secret from an operator before the TLS admin channel (token only), one whose certificate
    names another model, or one ending within 30 days, is replaced (PUT with its resourceVersion)."""
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
        data = admin_tls.AdminMaterial(token="old-token", cert_pem=cert, key_pem=key).secret_data()
    kube.put({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": "moe-small-admin", "namespace": "ns"}, "data": data})
    events = []
    assert modelsync.reconcile(kube, model_of(kube), events=lambda *a: events.append(a), logger=LOG) == "success"
    assert kube.replaced == ["Secret"]
    secret = kube.get("Secret", namespace="ns", name="moe-small-admin")
    assert admin_tls.secret_problem(secret, server_name="moe-small.ns.admin.sparsegate.dev", now=now) is None
    assert admin_tls.material_from_secret(secret).token != "old-token"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert any(e[2] == "AdminSecretReplaced" for e in events)
    # Complete now: the next reconcile leaves it alone.
    modelsync.reconcile(kube, model_of(kube), events=lambda *a: None, logger=LOG)
    assert kube.replaced == ["Secret"]
