"""A model's ``spec.gateConfigRef`` removed: its running pods get the default gate pushed
(``domain.default_gate``, ``handlers.defaultgate``).

Before, the reconcile rendered the default into ``<model>-gate`` and ``status.gateVersion`` and no
one pushed it: the GateConfig's rollout no longer counted the model, so its running pods kept the
GateConfig's gate (a canary too, mid-rollout) while new pods started with the default, until the
pods restarted. The reconcile now marks the model ``DefaultGateApplied=False`` in the same status
write, and a loop pushes the default until every pod serves it (level-based: a failed push or an
operator restart only delays it). And the old GateConfig no longer counts the model: its index
entry stayed (``models_by_gate`` returned None), so its rollout went on pushing the model's pods.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import kopf

from sparsegate.clients.podadmin import PodHealth, PodTarget, PushResult
from sparsegate.controllers.rollout import Fleet, RolloutCache
from sparsegate.domain import default_gate
from sparsegate.domain.gate import default_document
from sparsegate.handlers import defaultgate
from sparsegate_contracts.canary import set_key
from test_model_sync import conditions, gateconfig, kube, model_of, reconcile  # noqa: F401 (kube: a fixture)

LOG = logging.getLogger("test.default_gate")
PODS = ("moe-small-0", "moe-small-1")
DEFAULT = default_document(8)


class FakeFleets:
    def __init__(self, pods: tuple[str, ...] = PODS) -> None:
        self.pods = pods

    async def fleet(self, **_: Any) -> Fleet:
        targets = {p: PodTarget(name=p, ip=f"10.0.0.{i}", port=8080, admin_port=8443) for i, p in enumerate(self.pods)}
        return Fleet(targets=targets, all_pods=self.pods, model_of=dict.fromkeys(self.pods, "moe-small"))

    async def credentials(self, *, pods: Any, fleet: Fleet, **_: Any) -> dict[str, PodTarget]:
        return {p: fleet.targets[p] for p in pods}


class Pods:
    """What each pod serves; a push lands unless the pod refuses it."""

    def __init__(self, serving: dict[str, str]) -> None:
        self.serving = dict(serving)
        self.refuse: set[str] = set()
        self.pushed: list[tuple[str, str]] = []

    async def health(self, targets: Any) -> dict[str, PodHealth]:
        return {t.name: PodHealth(name=t.name, version=self.serving[t.name].split("+")[0], served=self.serving[t.name])
                for t in targets}

    async def push(self, pushes: Any) -> dict[str, PushResult]:
        out = {}
        for t, doc in pushes:
            self.pushed.append((t.name, doc["version"]))
            if t.name in self.refuse:
                out[t.name] = PushResult(name=t.name, ok=False, error="PUT /admin/gate: ClientConnectorError")
            else:
                self.serving[t.name] = doc["version"]
                out[t.name] = PushResult(name=t.name, ok=True, version=doc["version"])
        return out


def sync(k: Any, pods: Pods) -> defaultgate.DefaultGateSync:
    s = defaultgate.DefaultGateSync(kube=k, admin=pods)  # type: ignore[arg-type]
    s.fleets = FakeFleets()  # type: ignore[assignment]
    return s


def tick(s: defaultgate.DefaultGateSync) -> dict[str, str] | None:
    return asyncio.run(s.tick(namespace="ns", name="moe-small", cache=RolloutCache(), inventory=None,  # type: ignore[arg-type]
                              logger=LOG))


def drop_ref(k: Any) -> None:
    m = model_of(k)
    m["spec"].pop("gateConfigRef")
    m["metadata"]["generation"] += 1
    k.put(m)
    reconcile(k, model_of(k))


def test_removing_the_ref_pushes_the_default_gate_to_every_running_pod(kube) -> None:
    gateconfig(kube, entropyBeta=0.3)  # a gate other than the default
    reconcile(kube, model_of(kube))
    referenced = model_of(kube)["status"]["gateVersion"]
    assert referenced != DEFAULT.version and "DefaultGateApplied" not in conditions(kube)
    pods = Pods(dict.fromkeys(PODS, referenced))  # what the GateConfig's rollout left on them

    drop_ref(kube)
    assert model_of(kube)["status"]["gateVersion"] == DEFAULT.version
    # Written with the default gate itself: the pods still serve the GateConfig's.
    assert conditions(kube)["DefaultGateApplied"]["status"] == "False"
    assert default_gate.pending(model_of(kube))

    wanted = tick(sync(kube, pods))
    assert sorted(pods.pushed) == [(p, DEFAULT.version) for p in PODS]
    assert pods.serving == dict.fromkeys(PODS, DEFAULT.version)
    assert wanted is not None and wanted["status"] == "True" and wanted["reason"] == "AllPodsServeDefault"
    assert conditions(kube)["DefaultGateApplied"]["status"] == "True"
    assert not default_gate.pending(model_of(kube))  # the loop ends with its next event


def test_a_canary_of_a_gateconfig_whose_stable_is_the_default_is_replaced_too(kube) -> None:
    # The example GateConfig's params are exactly the built-in defaults: its stable version is the
    # default's, so status.gateVersion does not move when the ref goes; a canary is still on the pods.
    gateconfig(kube)
    reconcile(kube, model_of(kube))
    assert model_of(kube)["status"]["gateVersion"] == DEFAULT.version
    canary = set_key(DEFAULT.version, "g-0123456789ab", 0.2)
    pods = Pods({PODS[0]: canary, PODS[1]: DEFAULT.version})

    drop_ref(kube)
    assert conditions(kube)["DefaultGateApplied"]["status"] == "False"
    tick(sync(kube, pods))
    assert pods.pushed == [(PODS[0], DEFAULT.version)]  # the pod already on the default is left alone
    assert conditions(kube)["DefaultGateApplied"]["status"] == "True"


def test_a_failed_push_or_an_operator_restart_only_delays_it(kube) -> None:
    gateconfig(kube, entropyBeta=0.3)
    reconcile(kube, model_of(kube))
    pods = Pods(dict.fromkeys(PODS, model_of(kube)["status"]["gateVersion"]))
    pods.refuse = {PODS[1]}
    drop_ref(kube)

    wanted = tick(sync(kube, pods))
    assert wanted is not None and wanted["status"] == "False" and PODS[1] in wanted["message"]
    assert conditions(kube)["DefaultGateApplied"]["status"] == "False"  # still pending, in status
    reconcile(kube, model_of(kube))  # a later reconcile (a touch) keeps it pending
    assert conditions(kube)["DefaultGateApplied"]["status"] == "False"

    pods.refuse = set()
    pods.pushed.clear()
    tick(sync(kube, pods))  # a new controller (operator restarted): status alone says what is left
    assert pods.pushed == [(PODS[1], DEFAULT.version)]
    assert conditions(kube)["DefaultGateApplied"]["status"] == "True"


def test_a_model_that_never_had_a_gateconfig_gets_no_condition_and_no_loop(kube) -> None:
    m = model_of(kube)
    m["spec"].pop("gateConfigRef")
    kube.put(m)
    reconcile(kube, model_of(kube))
    assert model_of(kube)["status"]["gateVersion"] == DEFAULT.version
    assert "DefaultGateApplied" not in conditions(kube)
    reconcile(kube, model_of(kube))
    assert "DefaultGateApplied" not in conditions(kube)

    async def event() -> int:
        await defaultgate.sparsemodel_default_gate_loop(
            type="MODIFIED", body=kopf.Body(copy.deepcopy(model_of(kube))), namespace="ns", name="moe-small",
            memo=kopf.Memo(), logger=LOG)
        return len(defaultgate._loops)

    assert asyncio.run(event()) == 0  # no loop, no request: the Kopf indexes are not even read


def test_a_ref_back_drops_the_condition_and_the_round_does_nothing(kube) -> None:
    gateconfig(kube, entropyBeta=0.3)
    reconcile(kube, model_of(kube))
    drop_ref(kube)
    assert conditions(kube)["DefaultGateApplied"]["status"] == "False"
    stale = model_of(kube)
    m = model_of(kube)
    m["spec"]["gateConfigRef"] = {"name": "default-gate"}
    m["metadata"]["generation"] += 1
    kube.put(m)
    reconcile(kube, model_of(kube))
    assert "DefaultGateApplied" not in conditions(kube)  # the GateConfig's rollout has the pods again
    pods = Pods(dict.fromkeys(PODS, "g-aaaaaaaaaaaa"))
    assert tick(sync(kube, pods)) is None and pods.pushed == []
    # A round that read the model before the ref came back writes nothing over it.
    class Stale:
        def get(self, kind: str, **kw: Any) -> dict:
            return copy.deepcopy(stale)

        def update_status(self, kind: str, **kw: Any) -> Any:
            return kube.update_status(kind, **kw)

    assert tick(sync(Stale(), pods)) is not None and pods.pushed  # (pushed from the stale read)
    assert "DefaultGateApplied" not in conditions(kube)


def test_the_loop_runs_while_pending_and_ends_with_the_condition_true(kube) -> None:
    gateconfig(kube, entropyBeta=0.3)
    reconcile(kube, model_of(kube))
    drop_ref(kube)
    rounds: list[str] = []

    class Recording:
        async def tick(self, *, name: str, **_: Any) -> None:
            rounds.append(name)

    memo = kopf.Memo()
    memo.default_gate_sync, memo.default_gate_cache = Recording(), RolloutCache()
    indexes = dict(sparsegate_model_views={}, sparsegate_model_pod_views={}, sparsegate_model_deployment_views={},
                   sparsegate_model_replicaset_views={}, sparsegate_gate_views={})

    async def events() -> tuple[int, int]:
        async def event(body: dict) -> None:
            await defaultgate.sparsemodel_default_gate_loop(type="MODIFIED", body=kopf.Body(copy.deepcopy(body)),
                                                            namespace="ns", name="moe-small", memo=memo,
                                                            logger=LOG, **indexes)
        await event(model_of(kube))  # pending: a loop, its first round at once
        await asyncio.sleep(0.05)
        running = len(defaultgate._loops)
        await sync(kube, Pods(dict.fromkeys(PODS, "g-aaaaaaaaaaaa"))).tick(
            namespace="ns", name="moe-small", cache=RolloutCache(), inventory=None, logger=LOG)  # type: ignore[arg-type]
        await event(model_of(kube))  # True now: the loop goes
        left = len(defaultgate._loops)
        await defaultgate._loops.stop()
        return running, left

    assert asyncio.run(events()) == (1, 0)
    assert rounds == ["moe-small"]


def test_a_removed_ref_leaves_its_old_gateconfigs_index_entry(kube) -> None:
    """Kopf keeps an object's index entries when its indexing function returns None (it replaces
    only on a result, discards only on an error or a filter miss): ``models_by_gate`` returned
    None for a model without a ref, so a model whose ref was removed stayed listed under its old
    GateConfig, whose rollout went on pushing its gates (and canary) to the model's pods."""
    from kopf._core.actions.execution import Outcome
    from kopf._core.engines.indexing import OperatorIndexer, OperatorIndexers

    from sparsegate.handlers import sparsemodel

    indexers = OperatorIndexers()
    indexers["models_by_gate"] = OperatorIndexer()  # type: ignore[index]

    async def index(body: dict) -> None:
        result = await sparsemodel.models_by_gate(namespace="ns", name="moe-small", body=kopf.Body(body))
        indexers.replace(kopf.Body(body), {"models_by_gate": Outcome(final=True, result=result)})  # type: ignore[dict-item]

    with_ref = model_of(kube)
    without = copy.deepcopy(with_ref)
    without["spec"].pop("gateConfigRef")
    asyncio.run(index(with_ref))
    assert list(indexers.indices["models_by_gate"].get(("ns", "default-gate"), [])) == ["moe-small"]
    asyncio.run(index(without))
    assert list(indexers.indices["models_by_gate"].get(("ns", "default-gate"), [])) == []
