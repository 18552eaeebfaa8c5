"""The rollout controller's fleet: which pods get the admin channel, read from the watched views
(``controllers.inventory``) and an in-memory stand-in for our Kube wrapper (mocked at our own
layer, never at HTTP; the real API server and Kopf indexes run the same flow in
tests/e2e/operator/test_admin_channel.py)."""

from __future__ import annotations

import datetime
import json

from sparsegate.controllers.inventory import Inventory
from sparsegate.controllers.rollout import RolloutCache, RolloutLoop
from sparsegate.domain import admin_tls, conditions, fleet_view, render
from sparsegate.domain.pod_ownership import ownership_problem
from sparsegate_contracts import names

NS = "ns"
MODEL = {"apiVersion": names.API_VERSION, "kind": "SparseModel",
         "metadata": {"name": "m", "namespace": NS, "uid": "model-uid"},
         "spec": {"servingPort": 8080, "model": {"experts": 8}}}
DEPLOYMENT = {"metadata": {"name": "m", "namespace": NS, "uid": "dep-uid", "ownerReferences": [
    {"apiVersion": names.API_VERSION, "kind": "SparseModel", "name": "m", "uid": "model-uid", "controller": True}]}}
RS = {"metadata": {"name": "m-abc", "namespace": NS, "uid": "rs-uid", "ownerReferences": [
    {"apiVersion": "apps/v1", "kind": "Deployment", "name": "m", "uid": "dep-uid", "controller": True}]}}
NOW = datetime.datetime.now(datetime.timezone.utc)


def pod(name: str, *, owned: bool = True, admin_port: bool = True, ip: str | None = "127.0.0.9") -> dict:
    ports = [{"name": "http", "containerPort": 8080}]
    if admin_port:
        ports.append({"name": "admin", "containerPort": 8443})
    meta = {"name": name, "namespace": NS, "uid": f"{name}-uid", "labels": {names.MODEL_LABEL: "m"}}
    if owned:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "m-abc",
                                    "uid": "rs-uid", "controller": True}]
    return {"metadata": meta, "spec": {"containers": [{"name": render.CONTAINER_NAME, "ports": ports}]},
            "status": {"phase": "Running", **({"podIP": ip} if ip else {})}}


class FakeKube:
    """Serves the model's admin Secret, and the ReplicaSet by name for a view the watch has not delivered
    (no Deployment: a model's Deployment the watch has not delivered is one being re-created)."""

    def __init__(self) -> None:
        self.secret = self.make_secret("1")
        self.model: dict | None = None  # the SparseModel, as a renewal of its Secret reads it
        self.calls: list[str] = []

    @staticmethod
    def make_secret(rv: str) -> dict:
        material = admin_tls.new_material(server_name=names.admin_server_name(model="m", namespace=NS), now=NOW)
        return {"metadata": {"name": "m-admin", "namespace": NS, "uid": "s-uid", "resourceVersion": rv},
                "data": material.secret_data()}

    def get(self, kind: str, *, namespace: str, name: str) -> dict | None:
        self.calls.append(f"get {kind} {name}")
        return {"Secret": self.secret, "ReplicaSet": RS if name == "m-abc" else None,
                "SparseModel": self.model, "Deployment": None}[kind]


def inventory(pods: list[dict], *, replicasets: list[dict] = [RS]) -> Inventory:  # noqa: B006 (never mutated)
    """The watched projections, as the Kopf indexes of handlers.fleetindex hold them."""
    return Inventory(
        models={(NS, "m"): [fleet_view.model_view(MODEL)]},
        pods={(NS, "m"): [fleet_view.pod_view(p) for p in pods]},
        deployments={(NS, "m"): [fleet_view.owner_view(DEPLOYMENT)]},
        replicasets={(NS, rs["metadata"]["uid"]): [fleet_view.owner_view(rs)] for rs in replicasets},
        gates={})


async def test_only_pods_owned_through_the_chain_are_targets_and_no_api_is_read() -> None:
    kube = FakeKube()
    inv = inventory([pod("real"), pod("impostor", owned=False), pod("old", admin_port=False), pod("pending", ip=None)])
    fleet = await RolloutLoop(kube=kube)._fleet(namespace=NS, models=["m", "gone"], inventory=inv)  # type: ignore[arg-type]
    assert set(fleet.targets) == {"real", "old"}
    assert fleet.all_pods == ("old", "pending", "real")  # the impostor is no part of the rollout
    assert fleet.withheld == {"impostor": ("impostor-uid", "no controller ReplicaSet")}
    real = fleet.targets["real"]
    assert (real.port, real.admin_port, real.admin_base) == (8080, 8443, "https://127.0.0.9:8443")
    assert real.admin is None  # credentials only when something is to be sent
    assert fleet.targets["old"].admin_port is None
    assert kube.calls == []  # read from the watched views alone


async def test_a_model_whose_deployment_is_being_replaced_has_no_fleet_pods_but_counts_as_a_model() -> None:
    # Deleted (the operator re-creates it): its pods are refused the token and no part of the
    # rollout, while the model still uses the GateConfig (a step waits for pods: domain.rollout).
    inv = Inventory(models={(NS, "m"): [fleet_view.model_view(MODEL)]},
                    pods={(NS, "m"): [fleet_view.pod_view(pod("real"))]},
                    deployments={}, replicasets={(NS, "rs-uid"): [fleet_view.owner_view(RS)]}, gates={})
    kube = FakeKube()
    fleet = await RolloutLoop(kube=kube)._fleet(namespace=NS, models=["m"], inventory=inv)  # type: ignore[arg-type]
    assert fleet.all_pods == () and fleet.withheld == {"real": ("real-uid", "Deployment m not found")}
    assert list(fleet.server_names) == ["m"] and kube.calls == ["get Deployment m"]


async def test_credentials_are_read_when_sent_and_a_changed_secret_takes_effect_at_the_next_send() -> None:
    kube = FakeKube()
    cache = RolloutCache()
    loop = RolloutLoop(kube=kube)  # type: ignore[arg-type]
    fleet = await loop._fleet(namespace=NS, models=["m"], inventory=inventory([pod("real")]))
    first = (await loop.credentials(namespace=NS, fleet=fleet, pods=["real"], cache=cache))["real"]
    assert first.admin is not None and first.admin.server_name == "m.ns.admin.sparsegate.dev"
    assert first.admin.token == admin_tls.material_from_secret(kube.secret).token
    assert kube.calls == ["get Secret m-admin"]
    same = (await loop.credentials(namespace=NS, fleet=fleet, pods=["real"], cache=cache))["real"]
    assert same.admin is first.admin  # unchanged resourceVersion: nothing rebuilt
    kube.secret = FakeKube.make_secret("2")
    rotated = (await loop.credentials(namespace=NS, fleet=fleet, pods=["real"], cache=cache))["real"]
    assert rotated.admin.token == admin_tls.material_from_secret(kube.secret).token != first.admin.token
    assert rotated.previous_admin is first.admin  # for pods whose volume still shows the old files
    kube.secret = None
    gone = (await loop.credentials(namespace=NS, fleet=fleet, pods=["real"], cache=cache))["real"]
    assert gone.admin is None and "not found" in gone.refusal
    assert await loop.credentials(namespace=NS, fleet=fleet, pods=["pending-or-unknown"], cache=cache) == {}


class WritableKube(FakeKube):
    """Also creates and replaces the Secret, as the API server does (resourceVersion checked)."""

    def __init__(self, *, validity: datetime.timedelta) -> None:
        super().__init__()
        self.model = {**MODEL, "metadata": {**MODEL["metadata"], "generation": 1}, "status": {"observedGeneration": 1}}
        cert, key = admin_tls.issue(server_name=names.admin_server_name(model="m", namespace=NS), now=NOW,
                                    validity=validity)
        self.secret = render.render_secret(self.model, material=admin_tls.AdminMaterial("old", cert, key))
        self.secret["metadata"].update(uid="s-uid", resourceVersion="1")
        self.rv = 1

    def _store(self, obj: dict) -> dict:
        self.rv += 1
        self.secret = json.loads(json.dumps(obj))
        self.secret["metadata"].update(uid="s-uid", resourceVersion=str(self.rv))
        return self.secret

    def replace(self, obj: dict) -> dict:
        assert self.secret is not None
        assert obj["metadata"]["resourceVersion"] == self.secret["metadata"]["resourceVersion"]
        self.calls.append("replace Secret")
        return self._store(obj)

    def create_if_absent(self, obj: dict) -> bool:
        if self.secret is not None:
            return False
        self.calls.append("create Secret")
        self._store(obj)
        return True


async def test_an_expiring_or_deleted_secret_is_renewed_when_a_send_reads_it(monkeypatch) -> None:
    """A send reads the model's Secret: one whose certificate ends within 30 days (or has ended:
    every push refused, "certificate has expired") or that is gone is replaced as the model's
    reconcile would, not left until a change of the model reconciles it. The old certificate stays
    the previous credentials for pods whose volume still shows it."""
    import sparsegate.controllers.rollout as controller

    events: list[str] = []
    monkeypatch.setattr(controller.kopf, "event", lambda body, *, type, reason, message: events.append(reason))
    server_name = names.admin_server_name(model="m", namespace=NS)
    for days in (20, 0):  # within the renewal window; already ended
        kube = WritableKube(validity=datetime.timedelta(days=days))
        loop, cache = RolloutLoop(kube=kube), RolloutCache()  # type: ignore[arg-type]
        fleet = await loop._fleet(namespace=NS, models=["m"], inventory=inventory([pod("real")]))
        target = (await loop.credentials(namespace=NS, fleet=fleet, pods=["real"], cache=cache))["real"]
        assert "replace Secret" in kube.calls and events[-1] == "AdminSecretReplaced"
        # now, not NOW (the module's import time): the controller issued it at the real time, and a
        # certificate issued after NOW (minus the backdate) is 'not valid yet' at NOW.
        assert admin_tls.secret_problem(kube.secret, server_name=server_name,
                                        now=datetime.datetime.now(datetime.timezone.utc)) is None
        assert target.admin.token == admin_tls.material_from_secret(kube.secret).token != "old"
        assert target.previous_admin is not None and target.previous_admin.token == "old"
    # Deleted by hand: issued anew at the next send (new pods could not even mount it meanwhile).
    kube.secret, kube.calls = None, []
    target = (await loop.credentials(namespace=NS, fleet=fleet, pods=["real"], cache=cache))["real"]
    assert "create Secret" in kube.calls and target.admin is not None
    assert admin_tls.secret_problem(kube.secret, server_name=server_name,
                                    now=datetime.datetime.now(datetime.timezone.utc)) is None
    # A model being deleted: its Secret goes with it, nothing is re-created.
    kube.secret, kube.calls = None, []
    kube.model = {**kube.model, "metadata": {**kube.model["metadata"], "deletionTimestamp": "2026-12-07T00:00:00Z"}}
    target = (await loop.credentials(namespace=NS, fleet=fleet, pods=["real"], cache=cache))["real"]
    assert kube.secret is None and target.admin is None and "not found" in target.refusal


async def test_a_replicaset_the_watch_has_not_delivered_is_read_once_by_name() -> None:
    kube = FakeKube()
    loop = RolloutLoop(kube=kube)  # type: ignore[arg-type]
    fleet = await loop._fleet(namespace=NS, models=["m"], inventory=inventory([pod("a"), pod("b")], replicasets=[]))
    assert set(fleet.targets) == {"a", "b"} and kube.calls == ["get ReplicaSet m-abc"]
    # A ReplicaSet of that name with another uid is not the pod's controller.
    stranger = {"metadata": {**RS["metadata"], "uid": "other-uid"}}
    kube.get = lambda kind, *, namespace, name: stranger  # type: ignore[method-assign]
    fleet = await loop._fleet(namespace=NS, models=["m"], inventory=inventory([pod("a")], replicasets=[]))
    assert fleet.targets == {} and "not found" in fleet.withheld["a"][1]


def test_views_keep_what_the_checks_read_and_little_else() -> None:
    full = pod("real")
    full["metadata"]["labels"]["team"] = "x"
    full["metadata"]["annotations"] = {"a": "b" * 1000}
    full["status"]["containerStatuses"] = [
        {"name": "server", "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}},
        {"name": "side", "state": {"running": {}}}]
    view = fleet_view.pod_view(full)
    assert view["metadata"]["labels"] == {names.MODEL_LABEL: "m"} and "annotations" not in view["metadata"]
    assert view["spec"]["containers"][0]["ports"] == [{"name": "admin", "containerPort": 8443}]
    assert conditions.container_problems([view]) == conditions.container_problems([full])
    assert ownership_problem(view, replicasets={"rs-uid": fleet_view.owner_view(RS)},
                             deployment=fleet_view.owner_view(DEPLOYMENT), model=fleet_view.model_view(MODEL)) is None
    assert len(json.dumps(view)) < len(json.dumps(full)) / 3


async def test_a_model_without_pods_needs_no_deployment_read() -> None:
    kube = FakeKube()
    inv = Inventory(models={(NS, "m"): [fleet_view.model_view(MODEL)]}, pods={}, deployments={}, replicasets={}, gates={})
    fleet = await RolloutLoop(kube=kube)._fleet(namespace=NS, models=["m"], inventory=inv)  # type: ignore[arg-type]
    assert fleet.all_pods == () and kube.calls == []  # just created: no pods, and no 404 every tick


async def test_withheld_pods_are_reported_once_and_forgotten_once_gone(monkeypatch) -> None:
    """One Warning per pod and reason refused the token, while it is refused; a pod gone (or no
    longer refused) leaves the record. Kept for good, every labelled pod ever refused (a Job or a
    debug copy carrying the model's labels, started again and again) stayed in the GateConfig's
    cache for the operator's life."""
    import sparsegate.controllers.rollout as controller
    events: list[str] = []
    monkeypatch.setattr(controller.kopf, "event", lambda body, *, type, reason, message: events.append(message))
    loop, cache = RolloutLoop(kube=FakeKube()), RolloutCache()  # type: ignore[arg-type]
    body = {"metadata": {"name": "g", "namespace": NS}}
    for n in range(50):  # a new impostor pod every full check, the last one deleted
        impostor = pod(f"impostor-{n}", owned=False)
        fleet = await loop._fleet(namespace=NS, models=["m"], inventory=inventory([pod("real"), impostor]))
        for _ in range(3):  # still refused at the next checks: not reported again
            loop._report_withheld(body, fleet, cache=cache, logger=controller.log)
        assert len(cache.withheld) == 1
    assert len(events) == 50
    fleet = await loop._fleet(namespace=NS, models=["m"], inventory=inventory([pod("real")]))
    loop._report_withheld(body, fleet, cache=cache, logger=controller.log)
    assert cache.withheld == set()
