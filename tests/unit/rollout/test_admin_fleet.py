"""The rollout controller's fleet: which pods get the admin channel, against an in-memory stand-in
for our Kube wrapper (mocked at our own layer, never at HTTP; the real API server runs the same
flow in tests/e2e/operator/test_admin_channel.py)."""

from __future__ import annotations

import datetime

from sparsegate.domain import admin_tls, render
from sparsegate.controllers.rollout import RolloutLoop, RolloutCache
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
    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods
        self.secret = self.make_secret("1")
        self.calls: list[str] = []

    @staticmethod
    def make_secret(rv: str) -> dict:
        material = admin_tls.new_material(server_name=names.admin_server_name(model="m", namespace=NS), now=NOW)
        return {"metadata": {"name": "m-admin", "namespace": NS, "uid": "s-uid", "resourceVersion": rv},
                "data": material.secret_data()}

    def get(self, kind: str, *, namespace: str, name: str) -> dict | None:
        self.calls.append(f"get {kind}")
        return {"SparseModel": MODEL, "Deployment": DEPLOYMENT, "Secret": self.secret}[kind]

    def request(self, method: str, path: str, *, query: dict | None = None, **_: object) -> dict:
        self.calls.append(f"list {path.rsplit('/', 1)[-1]}")
        assert method == "GET" and query == {"labelSelector": f"{names.MODEL_LABEL} in (m)"}
        return {"items": self.pods if path.endswith("/pods") else [RS]}


async def test_only_pods_owned_through_the_chain_get_credentials() -> None:
    kube = FakeKube([pod("real"), pod("impostor", owned=False), pod("old", admin_port=False),
                     pod("pending", ip=None)])
    cache = RolloutCache()
    fleet = await RolloutLoop(kube=kube)._fleet(namespace=NS, models=["m"], cache=cache)
    assert set(fleet.targets) == {"real", "old"}
    assert fleet.all_pods == ("old", "pending", "real")  # the impostor is no part of the rollout
    assert fleet.withheld == {"impostor": ("impostor-uid", "no controller ReplicaSet")}
    real = fleet.targets["real"]
    assert (real.port, real.admin_port, real.admin_base) == (8080, 8443, "https://127.0.0.9:8443")
    assert real.admin is not None and real.admin.server_name == "m.ns.admin.sparsegate.dev"
    assert real.admin.token == admin_tls.material_from_secret(kube.secret).token
    assert fleet.targets["old"].admin_port is None
    # Pods are listed before ReplicaSets (every live pod's ReplicaSet is then in the list).
    lists = [c for c in kube.calls if c.startswith("list")]
    assert lists == ["list pods", "list replicasets"]


async def test_a_changed_secret_takes_effect_at_the_next_refresh() -> None:
    kube = FakeKube([pod("real")])
    cache = RolloutCache()
    loop = RolloutLoop(kube=kube)
    first = (await loop._fleet(namespace=NS, models=["m"], cache=cache)).targets["real"]
    same = (await loop._fleet(namespace=NS, models=["m"], cache=cache)).targets["real"]
    assert same.admin is first.admin  # unchanged resourceVersion: nothing rebuilt
    kube.secret = FakeKube.make_secret("2")
    rotated = (await loop._fleet(namespace=NS, models=["m"], cache=cache)).targets["real"]
    assert rotated.admin.token == admin_tls.material_from_secret(kube.secret).token != first.admin.token
    assert rotated.previous_admin is first.admin  # for pods whose volume still shows the old files
    kube.secret = None
    gone = (await loop._fleet(namespace=NS, models=["m"], cache=cache)).targets["real"]
    assert gone.admin is None and "not found" in gone.refusal
