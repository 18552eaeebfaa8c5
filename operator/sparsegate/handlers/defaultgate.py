"""The default gate onto the running pods of a model whose ``spec.gateConfigRef`` was removed.

The logic is ``domain.default_gate``: the model's reconcile marks it ``DefaultGateApplied=False``
in the status write that renders the default over another gate; while that holds, a loop per
model (``handlers.periodic``: no finalizer) runs :meth:`DefaultGateSync.tick` every
``SPARSEGATE_DEFAULT_GATE_RESYNC_S`` (default 5), and at once when the model or one of its pods
changes: ``/healthz`` of its pods, ``PUT /admin/gate`` of the default to each pod serving another
gate (after the rollout controller's owner checks, ``RolloutLoop.fleet``, over the same pinned TLS
channel), and the condition written True once every live pod serves it, which ends the loop.
Every other model has no loop and costs nothing.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import envvars
from sparsegate.clients.kube import Kube, KubeError
from sparsegate.clients.podadmin import PodAdmin
from sparsegate.controllers.inventory import Inventory
from sparsegate.controllers.rollout import PUSHES, FleetCache, RolloutLoop
from sparsegate.domain import default_gate
from sparsegate.handlers.periodic import ObjectLoops

GROUP, VERSION = names.GROUP, names.VERSION
TICK_S = envvars.seconds("SPARSEGATE_DEFAULT_GATE_RESYNC_S", 5.0)

log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class DefaultGateSync:
    def __init__(self, *, kube: Kube, admin: PodAdmin | None = None) -> None:
        self.kube = kube
        self.admin = admin or PodAdmin()
        self.fleets = RolloutLoop(kube=kube, admin=self.admin)

    async def tick(self, *, namespace: str, name: str, cache: FleetCache, inventory: Inventory,
                   logger: logging.Logger | logging.LoggerAdapter = log) -> dict[str, str] | None:
        """One round for one model; returns the condition written (None: nothing to do)."""
        model = await asyncio.to_thread(self.kube.get, "SparseModel", namespace=namespace, name=name)
        if model is None or model["metadata"].get("deletionTimestamp") or not default_gate.pending(model):
            return None
        document = default_gate.wanted_document(model)
        if document is None:
            return None  # the default is not rendered yet: the reconcile's status write wakes the loop
        version = document.version
        fleet = await self.fleets.fleet(namespace=namespace, models=[name], inventory=inventory)
        health = await self.admin.health(list(fleet.targets.values()))
        serving = {p: h.serving for p, h in health.items()}
        errors = {p: h.error for p, h in health.items() if h.error}
        push = default_gate.pods_to_push(version, reachable=sorted(fleet.targets), serving=serving)
        if push:
            targets = await self.fleets.credentials(namespace=namespace, fleet=fleet, pods=push, cache=cache)
            results = await self.admin.push([(targets[p], document.to_json()) for p in push])
            for p, r in results.items():
                PUSHES.labels(result="ok" if r.ok else "error").inc()
                if r.ok:
                    serving[p] = version
                    errors.pop(p, None)
                else:
                    errors[p] = str(r.error)
            RolloutLoop.log_push_failures([(r.name, None if r.ok else str(r.error)) for r in results.values()],
                                          pods=fleet.targets, cache=cache, logger=logger,
                                          what=f"default gate {version} for {namespace}/{name} to pod %s")
        wanted = default_gate.condition(version, pods=fleet.all_pods, serving=serving, errors=errors)
        meta = model["metadata"]

        def mutate(current: dict[str, Any]) -> dict[str, Any] | None:
            if current["metadata"].get("uid") != meta.get("uid") or default_gate.referenced(current):
                return None  # re-created under the name, or a GateConfig again: not this round's to write
            return default_gate.status_patch(current.get("status") or {}, wanted=wanted, version=version,
                                             generation=current["metadata"].get("generation"), now=_now())

        await asyncio.to_thread(self.kube.update_status, "SparseModel", namespace=namespace, name=name,
                                mutate=mutate)
        return wanted


# ---------------------------------------------------------------- Kopf wiring

_loops = ObjectLoops(kind="SparseModel default gate", interval_s=TICK_S)


def _sync(memo: kopf.Memo) -> DefaultGateSync:
    sync = getattr(memo, "default_gate_sync", None)
    if sync is None:  # a memo made before startup ran (tests)
        sync = memo.default_gate_sync = DefaultGateSync(kube=memo.kube)
    if getattr(memo, "default_gate_cache", None) is None:
        memo.default_gate_cache = FleetCache()
    return sync


@kopf.on.event(GROUP, VERSION, names.SPARSEMODELS)
async def sparsemodel_default_gate_loop(type: str | None, body: kopf.Body, namespace: str, name: str,
                                        memo: kopf.Memo, logger: logging.Logger, **kwargs: Any) -> None:
    """Runs the model's default-gate round while ``DefaultGateApplied`` is False (the initial listing
    resumes it after an operator restart)."""
    if not default_gate.pending(body):
        # Most models, at 10,000 of them: no loop, no copy of the body. By uid: a late event of an
        # earlier model of the name must not end a re-created one's loop.
        _loops.discard((namespace, name), uid=body.get("metadata", {}).get("uid"))
        return
    inventory = Inventory.from_kopf(kwargs)

    async def tick(_: Mapping[str, Any]) -> None:
        try:
            await _sync(memo).tick(namespace=namespace, name=name, cache=memo.default_gate_cache,
                                   inventory=inventory, logger=logger)
        except KubeError as e:
            logger.warning("default gate round for %s/%s: %s", namespace, name, e)

    meta = body.get("metadata") or {}
    view = {"metadata": {k: meta[k] for k in ("name", "namespace", "uid", "deletionTimestamp") if k in meta}}
    if _loops.seen(key=(namespace, name), event_type=type, body=view, tick=tick, logger=logger):
        _loops.wake([(namespace, name)])


@kopf.on.event("", "v1", "pods", labels={names.NAME_LABEL: names.MODEL_SERVER_NAME})
async def model_pod_changed_default_gate(body: kopf.Body, namespace: str, **_: Any) -> None:
    """A pod of a model with a pending default gate changed (got its address, became Ready): its
    round runs now. A dict lookup for every other model."""
    model = (body.get("metadata", {}).get("labels") or {}).get(names.MODEL_LABEL)
    if model and (namespace, model) in _loops:
        _loops.wake([(namespace, model)])


@kopf.on.cleanup()
async def stop_default_gate_loops(**_: Any) -> None:
    await _loops.stop()
