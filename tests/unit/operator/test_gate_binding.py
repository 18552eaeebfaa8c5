"""handlers.gatebinding: a model whose status was written from a GateConfig that has changed since
is reconciled again from its own event (the race the GateConfig's event alone misses: a new model's
first reconcile read the old GateConfig, and the GateConfig's event came while the model had no
status yet, so it was skipped as never reconciled); a model already queued is not queued twice; a
re-render's Service apply is finished as the Kopf handler finishes it (status written again)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kopf
import pytest
import yaml

from sparsegate.controllers.applied_objects import AppliedObjects
from sparsegate.controllers.status_inputs import StatusInputs
from sparsegate.domain import fleet_view, gate
from sparsegate.handlers import gatebinding, pools, sparsemodel
from test_model_sync import GatedServiceKube, available
from test_model_sync import conditions as sync_conditions, gateconfig as store_gateconfig, model_of as sync_model_of
from test_model_sync import start as sync_start

ROOT = Path(__file__).resolve().parents[3]
LOG = logging.getLogger("test")


def gateconfig(**params: Any) -> dict:
    gc = yaml.safe_load((ROOT / "examples" / "gateconfig.yaml").read_text())
    gc["metadata"]["namespace"] = "ns"
    gc["spec"]["params"].update(params)
    return gc


def model(*, gate_version: str | None) -> dict:
    m = yaml.safe_load((ROOT / "examples" / "sparsemodel.yaml").read_text())
    m["metadata"].update(namespace="ns", uid="uid-1")
    if gate_version:
        m["status"] = {"gateVersion": gate_version}
    return m


def version(gc: dict) -> str:
    experts = int(model(gate_version=None)["spec"]["model"]["experts"])
    return gate.resolve(gc, referenced=True, num_experts=experts).document.version


class Harness:
    """The handler's Kopf arguments: indexes as dicts, a memo whose model pool can be held."""

    def __init__(self, gc: dict | None) -> None:
        self.gc_name = gateconfig()["metadata"]["name"]
        self.gates = {("ns", self.gc_name): [fleet_view.gate_view(gc)]} if gc else {}
        self.reconciled: list[tuple[str, str | None]] = []
        self.memo = kopf.Memo()
        self.memo.model_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def kwargs(self) -> dict:
        return dict(sparsegate_model_views={}, sparsegate_model_pod_views={}, sparsegate_model_deployment_views={},
                    sparsegate_model_replicaset_views={}, sparsegate_gate_views=self.gates)

    def reconcile(self, memo: kopf.Memo, m: dict, *, gates: Any, **_: Any) -> None:
        view = gates("ns", self.gc_name)  # what the reconcile resolves from: read when it runs
        self.reconciled.append((m["metadata"]["name"], version(view) if view else None))

    async def event(self, body: dict, type_: str | None = "MODIFIED") -> None:
        await gatebinding.model_gate_check(type=type_, body=kopf.Body(copy.deepcopy(body)), namespace="ns",
                                           name=body["metadata"]["name"], memo=self.memo, logger=LOG,
                                           **self.kwargs())


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch):
    def make(gc: dict | None) -> Harness:
        h = Harness(gc)
        monkeypatch.setattr(gatebinding, "reconcile", h.reconcile)
        monkeypatch.setattr(gatebinding, "_queued", {})
        h.memo.kube = type("K", (), {"get": lambda self, kind, *, namespace, name: model(gate_version="x")})()
        return h
    return make


def test_a_model_written_from_an_older_gate_is_reconciled_from_its_own_event(harness) -> None:
    old, new = gateconfig(), gateconfig(entropyBeta=0.3)
    assert version(old) != version(new)
    h = harness(new)
    asyncio.run(h.event(model(gate_version=version(new))))
    assert h.reconciled == []  # in line with the watched GateConfig: nothing to do
    asyncio.run(h.event(model(gate_version=version(old))))
    assert h.reconciled == [("moe-small", version(new))]  # re-rendered from the GateConfig as now watched


def test_never_reconciled_initial_listing_and_deleted_models_are_left_alone(harness) -> None:
    h = harness(gateconfig(entropyBeta=0.3))
    stale = model(gate_version=version(gateconfig()))
    asyncio.run(h.event(model(gate_version=None)))  # its own pending reconcile resolves the gate
    asyncio.run(h.event(stale, None))  # the initial listing: the resume handler reconciles every model
    asyncio.run(h.event(stale, "DELETED"))
    deleting = copy.deepcopy(stale)
    deleting["metadata"]["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    asyncio.run(h.event(deleting))
    assert h.reconciled == []


def test_a_model_rendered_from_a_gateconfig_now_gone_is_reconciled(harness) -> None:
    h = harness(None)
    asyncio.run(h.event(model(gate_version=version(gateconfig()))))
    assert h.reconciled == [("moe-small", None)]  # it resolves to no gate: Degraded


def test_a_queued_model_is_not_queued_twice_but_a_started_one_is(harness) -> None:
    old, new = gateconfig(), gateconfig(entropyBeta=0.3)
    h = harness(new)
    stale = model(gate_version=version(old))

    async def main() -> None:
        busy = threading.Event()
        h.memo.model_pool.submit(busy.wait, 5)  # the pool's one thread is busy: reconciles queue
        first = asyncio.create_task(h.event(stale))
        await asyncio.sleep(0.05)
        await h.event(stale)  # the same model while queued: dropped (the queued one reads the gate later)
        await h.event(stale)
        assert set(gatebinding._queued) == {("ns", "moe-small")} and h.reconciled == []
        busy.set()
        await first
        assert h.reconciled == [("moe-small", version(new))] and gatebinding._queued == {}
        await h.event(stale)  # after it started: a change since needs a reconcile of its own

    asyncio.run(main())
    assert len(h.reconciled) == 2


def test_a_finished_reconcile_does_not_forget_one_queued_after_it_started(harness, monkeypatch) -> None:
    h = harness(gateconfig(entropyBeta=0.3))
    stale = model(gate_version=version(gateconfig()))
    inside, release = threading.Event(), threading.Event()
    plain = h.reconcile

    def first_blocks(memo: kopf.Memo, m: dict, **kw: Any) -> None:
        if not h.reconciled:
            inside.set()
            release.wait(5)
        plain(memo, m, **kw)

    monkeypatch.setattr(gatebinding, "reconcile", first_blocks)

    async def main() -> None:
        first = asyncio.create_task(h.event(stale))
        await asyncio.to_thread(inside.wait, 5)  # the first has started (and blocks the one thread)
        await asyncio.sleep(0.05)
        busy = threading.Event()
        h.memo.model_pool.submit(busy.wait, 5)  # next in the pool's queue: the second cannot start yet
        second = asyncio.create_task(h.event(stale))  # queued behind both
        await asyncio.sleep(0.05)
        release.set()
        await first
        assert set(gatebinding._queued) == {("ns", "moe-small")}  # the second is still known as queued
        await h.event(stale)  # so this one is dropped
        busy.set()
        await second

    asyncio.run(main())
    assert len(h.reconciled) == 2


def test_a_re_render_finishes_its_service_apply_so_ready_is_not_held_back_for_good() -> None:
    """A re-render (here from the model's own event) may apply the model's Service again (its record
    expired: --reapply-interval). Written while that apply is in flight, status holds Ready back
    (ServiceNotApplied, Reconciling=True: kstatus InProgress, Argo CD Progressing); the apply must be
    finished as the Kopf handler finishes it, so status is written again once it lands. Nothing else
    writes it while the Deployment and pods stay as they are."""
    k = GatedServiceKube()
    m = yaml.safe_load((ROOT / "examples" / "sparsemodel.yaml").read_text())
    m["metadata"].update(namespace="ns", uid="uid-1", generation=1)
    k.put(m)
    store_gateconfig(k)
    k.service_gate.set()
    first = sync_start(k, sync_model_of(k))  # the first reconcile, Service landed, every replica ready
    first.service.finish()
    deployment = available(k)
    store_gateconfig(k, entropyBeta=0.3)  # a new stable gate: the model is re-rendered
    k.service_gate = threading.Event()  # this time its Service apply stays in flight until opened
    gc = k.get("GateConfig", namespace="ns", name=gateconfig()["metadata"]["name"])
    memo = kopf.Memo()
    memo.kube, memo.status_inputs = k, StatusInputs()
    memo.applied_objects = AppliedObjects(interval_s=600)  # no record: applied again
    memo.model_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    memo.status_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    kwargs = dict(sparsegate_model_views={}, sparsegate_model_pod_views={}, sparsegate_model_replicaset_views={},
                  sparsegate_model_deployment_views={("ns", "moe-small"): [fleet_view.deployment_view(deployment)]},
                  sparsegate_gate_views={("ns", gc["metadata"]["name"]): [fleet_view.gate_view(gc)]})

    def ready() -> dict:
        return sync_conditions(k)["Ready"]

    async def until(check: Any) -> bool:
        for _ in range(300):
            if check():
                return True
            await asyncio.sleep(0.01)
        return False

    async def main() -> None:
        event = asyncio.create_task(gatebinding.model_gate_check(
            type="MODIFIED", body=kopf.Body(sync_model_of(k)), namespace="ns", name="moe-small", memo=memo,
            logger=LOG, **kwargs))
        assert await until(lambda: ready()["reason"] == "ServiceNotApplied"), ready()
        k.service_gate.set()
        await event
        assert await until(lambda: ready()["status"] == "True"), ready()

    asyncio.run(main())
    assert ready()["reason"] == "AllReplicasReady" and sync_conditions(k)["Reconciling"]["status"] == "False"


def test_a_re_render_waits_for_kopfs_reconcile_of_the_same_model(harness, monkeypatch) -> None:
    """Kopf's handler and a re-render each read, render and apply the model: side by side (two pool
    threads), the one that read the older spec could apply last."""
    h = harness(gateconfig(entropyBeta=0.3))
    h.memo.model_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    stale = model(gate_version=version(gateconfig()))
    inside, release = threading.Event(), threading.Event()
    order: list[str] = []

    def kopf_reconcile(memo: kopf.Memo, m: dict, **_: Any) -> SimpleNamespace:
        order.append("handler")
        inside.set()
        release.wait(5)
        order.append("handler applied")
        return SimpleNamespace(service=None)

    plain = h.reconcile

    def re_render(memo: kopf.Memo, m: dict, **kw: Any) -> None:
        order.append("re-render")
        plain(memo, m, **kw)

    monkeypatch.setattr(sparsemodel, "reconcile", kopf_reconcile)
    monkeypatch.setattr(gatebinding, "reconcile", re_render)

    async def main() -> None:
        handler = asyncio.create_task(sparsemodel.reconcile_model(
            body=kopf.Body(copy.deepcopy(stale)), namespace="ns", name="moe-small", memo=h.memo, logger=LOG,
            **h.kwargs()))
        await asyncio.to_thread(inside.wait, 5)
        other = asyncio.create_task(h.event(stale))
        await asyncio.sleep(0.2)  # a free pool thread: without the turn it would run now
        assert order == ["handler"]
        release.set()
        await handler
        await other
        assert pools._model_turns == {}  # the last one out removes the entry

    asyncio.run(main())
    assert order == ["handler", "handler applied", "re-render"]


def test_one_models_failed_re_render_does_not_stop_the_gateconfigs_other_models(harness, monkeypatch) -> None:
    """A GateConfig event re-renders each of its stale models in turn; Kopf never retries an event
    handler, so a model whose reconcile raises (its apply refused, an API error) must not leave the
    models after it on the old gate until something else happens to them."""
    old, new = gateconfig(), gateconfig(entropyBeta=0.3)
    h = harness(new)
    names = ["a-model", "b-model", "c-model"]
    views = {}
    for name in names:
        m = model(gate_version=version(old))
        m["metadata"]["name"] = name
        views[("ns", name)] = [fleet_view.model_view(m)]
    plain = h.reconcile

    def a_fails(memo: kopf.Memo, m: dict, **kw: Any) -> None:
        plain(memo, m, **kw)
        if m["metadata"]["name"] == "a-model":
            raise gatebinding.KubeError(422, "Unprocessable Entity", "refused")

    monkeypatch.setattr(gatebinding, "reconcile", a_fails)
    h.memo.kube = type("K", (), {"get": lambda self, kind, *, namespace, name: {
        **model(gate_version=version(old)), "metadata": {"namespace": namespace, "name": name, "uid": name}}})()
    kwargs = {**h.kwargs(), "sparsegate_model_views": views}
    with pytest.raises(gatebinding.KubeError):  # still a failed handler: Kopf logs it
        asyncio.run(gatebinding.gateconfig_changed(
            type="MODIFIED", body=kopf.Body(copy.deepcopy(new)), namespace="ns", name=h.gc_name,
            models_by_gate={("ns", h.gc_name): names}, memo=h.memo, logger=LOG, **kwargs))
    assert [n for n, _ in h.reconciled] == names
    assert gatebinding._queued == {}


def test_a_failed_re_render_after_its_gateconfig_was_deleted_is_tried_again(harness, monkeypatch) -> None:
    """The GateConfig's DELETED is the last event it sends: a model whose re-render then fails (an
    API error) must be tried again, or it keeps its status from the deleted GateConfig (Ready, its
    gate version, no Degraded GateConfigNotFound) until the model itself changes."""
    h = harness(None)  # the GateConfig is gone from the index
    views = {("ns", "a-model"): [fleet_view.model_view({**model(gate_version=version(gateconfig())),
                                                         "metadata": {"namespace": "ns", "name": "a-model",
                                                                      "uid": "uid-a"}})]}
    plain, calls = h.reconcile, []

    def fails_once(memo: kopf.Memo, m: dict, **kw: Any) -> None:
        calls.append(m["metadata"]["name"])
        if len(calls) == 1:
            raise gatebinding.KubeError(503, "Service Unavailable", "etcd leader changed")
        plain(memo, m, **kw)

    monkeypatch.setattr(gatebinding, "reconcile", fails_once)
    monkeypatch.setattr(gatebinding, "RETRY_S", 0.01)
    h.memo.kube = type("K", (), {"get": lambda self, kind, *, namespace, name: {
        **model(gate_version=version(gateconfig())), "metadata": {"namespace": namespace, "name": name, "uid": name}}})()
    kwargs = {**h.kwargs(), "sparsegate_model_views": views}

    async def main() -> None:
        with pytest.raises(gatebinding.KubeError):  # still a failed handler: Kopf logs it
            await gatebinding.gateconfig_changed(
                type="DELETED", body=kopf.Body(gateconfig()), namespace="ns", name=h.gc_name,
                models_by_gate={("ns", h.gc_name): ["a-model"]}, memo=h.memo, logger=LOG, **kwargs)
        for _ in range(300):
            if h.reconciled:
                break
            await asyncio.sleep(0.01)
        await gatebinding.stop_rerender_retries()

    asyncio.run(main())
    assert h.reconciled == [("a-model", None)], "the failed re-render was not tried again"
