"""Kopf wiring for SparseModel: each handler is a thin call into handlers.modelsync.

- create/update/resume → render and server-side apply the owned objects (the ConfigMap, Service
  and admin-Secret check only when changed since this process last applied them:
  ``controllers.applied_objects``; all of them on an update that is no new generation: a touch),
  write status. The Service is applied beside the rest and the
  status write does not wait for it (``modelsync.PendingService``); the handler waits for it,
  holding no thread, and writes status again only if it ended otherwise than assumed.
- any event of an owned Deployment → refresh replica counts and Ready/Progressing; no request at
  all when the status was last written from the same Deployment counts and pod problems
  (``controllers.status_inputs``). While the Deployment is still rolling out, the refresh waits
  ``STATUS_SETTLE_S`` and reads the newest watched state, one per model however many events
  arrive meanwhile (``controllers.deferred_refresh``).
- a model pod whose container cannot run (missing image, crash loop, repeated non-zero exits:
  ``conditions.failing_container``) → the same refresh, so Ready=False and Stalled=True name the
  pod, container and reason (ContainersFailing; kstatus Failed). A Deployment past its progress
  deadline stalls the model too (ProgressDeadlineExceeded), through the Deployment refresh. Both
  clear on the refresh that finds the pods running again (the Deployment's ready count moves).
- GateConfig events → re-reconcile models whose rendered gate no longer matches (see
  handlers.gatebinding). A model's ``spec.gateConfigRef`` edited → its new GateConfig's rollout
  checks its pods at its next tick (``handlers.gateconfig.model_gate_changed``); removed → the
  default gate is pushed to its pods (``handlers.defaultgate``).
- A Deployment deleted while its model lives is re-created; one whose spec someone else changed
  (its generation past what our last apply returned: ``kubectl scale``, ``kubectl edit``,
  ``kubectl rollout restart``) is applied again (``put_back``): the operator's fields go back to
  the rendered spec, fields others added (a restart annotation) stay. Its status changing moves
  no generation: nothing is applied for it.
- The model's Service or gate ConfigMap deleted while its model lives → put back at once
  (``owned_object_deleted``; watched with a label selector: only the operator's own); written by
  someone else (its resourceVersion past what our last apply of it returned: ``kubectl edit``) →
  applied again (``owned_object_changed``).
- A SparseModel deleted → what this process kept of it (status inputs, applied objects) is dropped.
Status reads the Deployment from the operator's watch (``handlers.fleetindex``) and the apply's
answer, never with a GET.
Deletion needs no handler (and so no finalizer): owned objects carry ownerReferences and the
garbage collector removes them. No timers either: Kopf gives timed resources a finalizer, and a
SparseModel must stay deletable while the operator is down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import metrics
from sparsegate.clients.kube import Kube
from sparsegate.controllers.inventory import Inventory
from sparsegate.domain import conditions, interned, model_status
from sparsegate.domain.pod_ownership import controller_ref
from sparsegate.handlers import gateconfig, modelsync
from sparsegate.handlers.pools import loop_reader, model_turn, run_model_work, run_status_work

GROUP, VERSION = names.GROUP, names.VERSION
# The labels of every object a model owns (``render.common_labels``); the Service and ConfigMap
# watches select on them server-side (``sparsegate.main``).
OWNED_LABELS = {names.NAME_LABEL: names.MODEL_SERVER_NAME, names.MANAGED_BY_LABEL: names.MANAGED_BY}
OWNED_SELECTOR = ",".join(f"{k}={v}" for k, v in sorted(OWNED_LABELS.items()))


def post_event(body: Any, type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


@kopf.index(GROUP, VERSION, names.SPARSEMODELS)
async def models_by_gate(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    """(namespace, GateConfig name) → names of the models that reference it. A model without a ref
    is ``{}``, not None: Kopf keeps an object's earlier entries when its indexer returns None, so a
    model whose ref was removed stayed its old GateConfig's (whose rollout went on pushing its pods)."""
    ref = modelsync.gate_ref(body)
    return {interned.deep((namespace, ref)): interned.text(name)} if ref else {}


@kopf.on.resume(GROUP, VERSION, names.SPARSEMODELS)
@kopf.on.create(GROUP, VERSION, names.SPARSEMODELS)
@kopf.on.update(GROUP, VERSION, names.SPARSEMODELS)
async def reconcile_model(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger,
                          **kwargs: Any) -> None:
    inventory = Inventory.from_kopf(kwargs)
    pods = inventory.pods(namespace, name)  # read on the event loop, where Kopf writes it
    gateconfig.model_gate_changed(namespace, old=kwargs.get("old"), new=body)  # its pods: the new gate's rollout
    async with model_turn(namespace, name):  # not beside a re-render (handlers.gatebinding)
        if modelsync.generation_reconciled(body):
            # No spec change (touched, or a retry): apply everything again, so touching a model puts
            # back an owned object deleted or edited by someone else (an admin Secret issued anew).
            memo.applied_objects.expire((namespace, name))
        reconciled = await run_model_work(memo, reconcile, memo, dict(body), pods=pods, logger=logger,
                                          watched=watched_deployment(inventory, namespace, name),
                                          gates=watched_gates(inventory))
    if reconciled.service is not None:
        await finish_service(memo, reconciled.service)


async def finish_service(memo: kopf.Memo, pending: modelsync.PendingService) -> None:
    """Waits for the model's Service apply holding no thread (the model pool's threads go on with
    other models); status again, in the status pool, only if it ended otherwise than the reconcile
    assumed or a write held Ready back for it meanwhile; a failure fails the handler, which Kopf retries."""
    await asyncio.wrap_future(pending.future)
    error, rewrite = pending.outcome()  # the apply is done: no wait, no request
    if rewrite:
        await run_status_work(memo, pending.rewrite, error)
    modelsync.raise_failed(error)


def watched_deployment(inventory: Inventory, namespace: str, name: str) -> modelsync.WatchedDeployment:
    """The model's Deployment view, readable from the pool thread (call on the event loop)."""
    return loop_reader(lambda: inventory.deployment(namespace, name))


def watched_gates(inventory: Inventory) -> modelsync.WatchedGate:
    """The GateConfig views, readable from the pool thread (call on the event loop)."""
    return loop_reader(inventory.gate)


def reconcile(memo: kopf.Memo, model: Mapping[str, Any], *, pods: list[Mapping[str, Any]], logger: logging.Logger,
              watched: modelsync.WatchedDeployment, gates: modelsync.WatchedGate) -> modelsync.Reconciled:
    """One reconcile of ``model`` (as delivered or just read), timed and counted; in the model pool.
    Its Service apply is timed apart (kind Service) and finished by the caller."""
    with metrics.observe("SparseModel") as outcome:
        reconciled = modelsync.reconcile(memo.kube, model, events=post_event, logger=logger, pods=pods,
                                         watched_deployment=watched, watched_gate=gates,
                                         status_inputs=memo.status_inputs, applied_objects=memo.applied_objects)
        outcome.value = reconciled.outcome
    return reconciled


# How long a Deployment that is still rolling out may move on before its model's status is refreshed
# from what it shows then (controllers.deferred_refresh); a settled one is refreshed at once.
STATUS_SETTLE_S = 1.0


@kopf.on.event("apps", "v1", "deployments",
               labels={names.NAME_LABEL: names.MODEL_SERVER_NAME,
                       names.MANAGED_BY_LABEL: names.MANAGED_BY})
async def deployment_changed(type: str | None, body: kopf.Body, memo: kopf.Memo,
                             logger: logging.Logger, **kwargs: Any) -> None:
    model = body.metadata.labels.get(names.MODEL_LABEL)
    namespace = body.metadata.namespace
    if not model or (type is None and not memo.status_inputs.known(namespace, model)):
        # None: a listing. The first one, of a model this process has not written yet: its resume
        # handler covers it. A later one (Kopf lists again when its watch restarts, as after a
        # 410 Gone: an API server restarted) is the only word of what changed meanwhile.
        return
    inventory = Inventory.from_kopf(kwargs)
    key = (namespace, model)
    if type != "DELETED" and memo.applied_objects.foreign_edit(key, body):
        # Its spec moved past what our last apply of it returned: someone else scaled or edited it.
        # Re-checked in the model's turn, where a reconcile of ours that produced it has recorded it.
        await put_back(memo, inventory, namespace=namespace, model=model, logger=logger,
                       owner_refs=list(body.metadata.get("ownerReferences") or []),
                       due=lambda: memo.applied_objects.foreign_edit(key, inventory.deployment(namespace, model)),
                       what=f"Deployment {model} was changed by another writer")
    pods = inventory.pods(namespace, model)
    if type != "DELETED" and memo.status_inputs.settled(
            namespace, model, uid=modelsync.model_uid(body), inputs=model_status.workload_inputs(body, pods)):
        with metrics.observe("Deployment") as outcome:
            outcome.value = "unchanged"  # the model's status was written from exactly this: no pool thread, no request
        return
    if type != "DELETED" and not model_status.workload_settled(body):
        # Still rolling out: refresh a moment later from the newest watched state (controllers.deferred_refresh).
        scheduled = memo.deferred_refreshes.defer(
            (namespace, model), lambda: _refresh_watched(memo, inventory, namespace=namespace, model=model))
        with metrics.observe("Deployment") as outcome:
            outcome.value = "deferred" if scheduled else "coalesced"
        return
    await run_status_work(memo, _deployment_changed, memo, type=type, deployment=dict(body), model=model,
                          pods=pods, logger=logger, watched=watched_deployment(inventory, namespace, model),
                          gates=watched_gates(inventory))


async def _refresh_watched(memo: kopf.Memo, inventory: Inventory, *, namespace: str, model: str) -> None:
    """A deferred refresh: the model's Deployment and pods as watched now (the indexes are live)."""
    deployment = inventory.deployment(namespace, model)
    if deployment is None:
        return  # deleted meanwhile: its DELETED event refreshes the model
    pods = inventory.pods(namespace, model)
    if memo.status_inputs.settled(namespace, model, uid=modelsync.model_uid(deployment),
                                  inputs=model_status.workload_inputs(deployment, pods)):
        with metrics.observe("Deployment") as outcome:
            outcome.value = "unchanged"
        return
    await run_status_work(memo, _deferred_refresh, memo, namespace=namespace, model=model,
                          watched=watched_deployment(inventory, namespace, model),
                          pods=loop_reader(lambda: inventory.pods(namespace, model)))


def _deferred_refresh(memo: kopf.Memo, *, namespace: str, model: str, watched: modelsync.WatchedDeployment,
                      pods: Callable[[], list[Mapping[str, Any]]]) -> None:
    """In the status pool: the Deployment and pods are read under the model's guard (modelsync.refresh_from_watched)."""
    with metrics.observe("Deployment") as outcome:
        if not modelsync.refresh_from_watched(memo.kube, namespace=namespace, name=model, deployment=watched,
                                              pods=pods, events=post_event, status_inputs=memo.status_inputs,
                                              applied_objects=memo.applied_objects):
            outcome.value = "unchanged"


def _deployment_changed(memo: kopf.Memo, *, type: str, deployment: Mapping[str, Any], model: str,
                        pods: list[Mapping[str, Any]], logger: logging.Logger,
                        watched: modelsync.WatchedDeployment, gates: modelsync.WatchedGate) -> None:
    namespace = deployment["metadata"]["namespace"]
    kube: Kube = memo.kube
    with metrics.observe("Deployment") as outcome:
        if type == "DELETED":
            memo.status_inputs.forget(namespace, model)
            memo.applied_objects.forget((namespace, model))  # the model is gone, or all is applied again
            # Deleted by someone else while its model lives on: put it back (self-healing).
            owner = modelsync.live_owner(kube, namespace=namespace, name=model,
                                         owner_refs=deployment["metadata"].get("ownerReferences") or [])
            if owner is not None:
                logger.warning("Deployment %s was deleted; re-creating it", model)
                reconciled = modelsync.reconcile(kube, owner, events=post_event, logger=logger, pods=pods,
                                                 watched_deployment=watched, watched_gate=gates,
                                                 status_inputs=memo.status_inputs,
                                                 applied_objects=memo.applied_objects)
                if reconciled.service is not None:
                    reconciled.service.finish()
                return
        if not modelsync.refresh_from_deployment(
                kube, namespace=namespace, name=model, deployment=None if type == "DELETED" else deployment,
                pods=pods, events=post_event, status_inputs=memo.status_inputs,
                applied_objects=memo.applied_objects):
            outcome.value = "unchanged"


async def put_back(memo: kopf.Memo, inventory: Inventory, *, namespace: str, model: str, logger: logging.Logger,
                   owner_refs: list[Mapping[str, Any]], due: Callable[[], bool], what: str) -> None:
    """An owned object was changed or deleted by someone else: the model is reconciled again (in
    its turn, as any reconcile), which applies what it renders, so server-side apply takes back the
    fields the operator owns (a field someone else added is theirs and stays). ``due``, called in
    the model's turn, says whether it still has to (and may expire records). Nothing when the model
    is gone or deleting (its owned objects go with it)."""
    async with model_turn(namespace, model):
        if not due():
            return
        logger.warning("%s; applying the model's objects again", what)
        reconciled = await run_model_work(memo, _put_back, memo, namespace=namespace, model=model,
                                          owner_refs=owner_refs, pods=inventory.pods(namespace, model), logger=logger,
                                          watched=watched_deployment(inventory, namespace, model),
                                          gates=watched_gates(inventory))
    if reconciled is not None and reconciled.service is not None:
        await finish_service(memo, reconciled.service)


def _put_back(memo: kopf.Memo, *, namespace: str, model: str, owner_refs: list[Mapping[str, Any]],
              pods: list[Mapping[str, Any]], logger: logging.Logger, watched: modelsync.WatchedDeployment,
              gates: modelsync.WatchedGate) -> modelsync.Reconciled | None:
    owner = modelsync.live_owner(memo.kube, namespace=namespace, name=model, owner_refs=owner_refs)
    if owner is None:
        return None
    return reconcile(memo, owner, pods=pods, logger=logger, watched=watched, gates=gates)


def _deleted(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


@kopf.on.event("", "v1", "services", labels=OWNED_LABELS, when=_deleted)
@kopf.on.event("", "v1", "configmaps", labels=OWNED_LABELS, when=_deleted)
async def owned_object_deleted(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **kwargs: Any) -> None:
    """A model's Service or gate ConfigMap deleted while its model lives: put back at once (its
    record in ``controllers.applied_objects`` would skip it until ``--reapply-interval``). These
    watches carry a label selector (``sparsegate.main``): only the operator's own objects; another
    writer's edit of them: ``owned_object_changed``."""
    model = body.metadata.labels.get(names.MODEL_LABEL)
    namespace = body.metadata.namespace
    inventory = Inventory.from_kopf(kwargs)
    ref = controller_ref(body)
    view = inventory.model(namespace, model) if model else None
    if view is None or ref is None or ref.get("uid") != view["metadata"].get("uid") \
            or view["metadata"].get("deletionTimestamp"):
        return  # the model is gone or going (the garbage collector deletes what it owned), or not its owner
    key = (namespace, model)

    def due() -> bool:
        memo.applied_objects.expire(key)  # in the model's turn: the reconcile below applies everything
        return True
    await put_back(memo, inventory, namespace=namespace, model=model, logger=logger,
                   owner_refs=[ref], due=due, what=f"{body.get('kind')} {body.metadata.name} was deleted")


def _not_deleted(type: str | None, **_: Any) -> bool:
    return type != "DELETED"


# How long an owned object's event waits for our apply of it in flight to record its answer
# (``owned_object_changed``); past that, the apply still queued is later than the write and puts it back.
APPLY_WAIT_S = 60.0


@kopf.on.event("", "v1", "services", labels=OWNED_LABELS, when=_not_deleted)
@kopf.on.event("", "v1", "configmaps", labels=OWNED_LABELS, when=_not_deleted)
async def owned_object_changed(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **kwargs: Any) -> None:
    """A model's Service or gate ConfigMap written by someone else (``kubectl edit``: the Service's
    selector or ports, so traffic goes elsewhere; the ConfigMap's gate, which new pods would start
    with): its event's resourceVersion is past the one our last apply of it returned
    (``AppliedObjects.foreign_write``), and the model is reconciled again with that object's record
    expired, so it is applied as rendered (a field someone else added, a label, stays: the apply
    changes nothing and returns the version it found, so one apply per foreign write). The events
    of our own applies carry their answer's version: nothing but a comparison, no request. One
    that comes before the answer is recorded is checked again once the apply in flight has ended
    (the Service, applied outside the model's turn) and in the model's turn (the ConfigMap,
    applied in it)."""
    model = body.metadata.labels.get(names.MODEL_LABEL)
    namespace = body.metadata.namespace
    key = (namespace, model)
    if not model or not memo.applied_objects.foreign_write(key, body):
        return
    inventory = Inventory.from_kopf(kwargs)
    ref = controller_ref(body)
    view = inventory.model(namespace, model)
    if view is None or ref is None or ref.get("uid") != view["metadata"].get("uid") \
            or view["metadata"].get("deletionTimestamp"):
        return  # the model is gone or going, or this is not its object
    loop = asyncio.get_running_loop()
    deadline = loop.time() + APPLY_WAIT_S
    while memo.applied_objects.applying(key, body) and loop.time() < deadline:
        await asyncio.sleep(0.05)  # our apply in flight may have produced this very event

    def due() -> bool:
        if memo.applied_objects.applying(key, body) or not memo.applied_objects.foreign_write(key, body):
            return False  # ours after all, or an apply started since the write, which puts it back
        memo.applied_objects.expire_object(key, body)  # in the model's turn: the reconcile below applies it
        return True
    await put_back(memo, inventory, namespace=namespace, model=model, logger=logger, owner_refs=[ref], due=due,
                   what=f"{body.get('kind')} {body.metadata.name} was changed by another writer")


@kopf.on.event(GROUP, VERSION, names.SPARSEMODELS, when=_deleted)
async def model_deleted(namespace: str, name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    """What was kept of the model goes with it. Its Deployment's DELETED event does that too, but a
    model that never had one (no usable gate, or its Deployment refused), or whose Deployment went
    first and whose attempt to re-create it recorded them anew (a namespace being deleted), would
    leave its records in this process for good."""
    if Inventory.from_kopf(kwargs).model(namespace, name) is not None:
        return  # re-created under the name meanwhile: the records are the new model's
    memo.status_inputs.forget(namespace, name)
    memo.applied_objects.forget((namespace, name))


@kopf.on.cleanup()
async def stop_deferred_refreshes(memo: kopf.Memo, **_: Any) -> None:
    await memo.deferred_refreshes.close()


def _stuck(body: kopf.Body, **_: Any) -> bool:
    return conditions.is_stuck(body)


@kopf.on.event("", "v1", "pods", labels={names.NAME_LABEL: names.MODEL_SERVER_NAME}, when=_stuck)
async def pod_stuck(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    model = body.metadata.labels.get(names.MODEL_LABEL)
    if not model:
        return
    namespace = body.metadata.namespace
    inventory = Inventory.from_kopf(kwargs)
    deployment = inventory.deployment(namespace, model)
    if deployment is None:
        return  # not delivered by the watch yet: its first event refreshes the status, these pods included
    await run_status_work(memo, _pod_stuck, memo, namespace=namespace, model=model,
                          watched=watched_deployment(inventory, namespace, model),
                          pods=loop_reader(lambda: inventory.pods(namespace, model)))


def _pod_stuck(memo: kopf.Memo, *, namespace: str, model: str, watched: modelsync.WatchedDeployment,
               pods: Callable[[], list[Mapping[str, Any]]]) -> None:
    """The Deployment and pods as watched, read under the model's guard (modelsync.refresh_from_watched):
    read at the event, they could be older than what a refresh that took the guard first wrote."""
    with metrics.observe("Pod") as outcome:
        if not modelsync.refresh_from_watched(memo.kube, namespace=namespace, name=model, deployment=watched,
                                              pods=pods, events=post_event, status_inputs=memo.status_inputs,
                                              applied_objects=memo.applied_objects):
            outcome.value = "unchanged"
