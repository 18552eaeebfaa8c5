"""GateConfig → SparseModel binding (the rollout logic itself lives in controllers.rollout).

A model's reconcile resolves its gate from the GateConfig as watched (``fleetindex``), and two
events re-reconcile a model whose rendered gate no longer matches what its GateConfig resolves to:
- every GateConfig event, for the models that reference it: the comparison reads the GateConfig as
  the event delivered it and the models' watched views, so the frequent rollout status writes cost
  no API request; only a model that is stale is read and reconciled. A model never reconciled yet
  is skipped there (its own pending reconcile resolves the gate), and so
- every SparseModel event, against its GateConfig as watched: a reconcile that read the GateConfig
  just before it changed writes a status whose event arrives either before the GateConfig's event
  (which then sees the old version in the model's view) or after it (and is caught here). Without
  this, a GateConfig changed while its new model's first reconcile ran kept the old gate.
A model already waiting for such a reconcile is not queued twice (it reads the gate when it starts).
A re-render that fails (an API error) is tried again (``RETRY_S``, with backoff) until none fails:
Kopf never retries an event handler, and a deleted GateConfig sends no later event.

``status.stable`` is written by the rollout state machine alone (its first tick records the spec's
version); until then a model resolves the GateConfig's spec.params.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import metrics
from sparsegate.clients.kube import KubeError
from sparsegate.controllers.inventory import Inventory
from sparsegate.handlers import modelsync
from sparsegate.handlers.periodic import Retries
from sparsegate.handlers.pools import model_turn, run_model_work
from sparsegate.handlers.sparsemodel import GROUP, VERSION, finish_service, reconcile, watched_deployment, watched_gates

# (namespace, model) → the re-reconcile queued here and not started yet (a token): on the event loop.
_queued: dict[tuple[str, str], object] = {}
# Re-reconciles' Service applies being finished (``_finish``), referenced until done.
_finishing: set[asyncio.Task[None]] = set()


@kopf.on.event(GROUP, VERSION, names.GATECONFIGS)
async def gateconfig_changed(type: str | None, body: kopf.Body, namespace: str, name: str,
                             models_by_gate: kopf.Index, memo: kopf.Memo,
                             logger: logging.Logger, **kwargs: Any) -> None:
    with metrics.observe("GateConfig"):
        inventory = Inventory.from_kopf(kwargs)
        failed = await _rerender_stale(None if type == "DELETED" else dict(body), memo, inventory, models_by_gate,
                                       namespace=namespace, name=name, logger=logger)
        if failed is not None:
            # Kopf never retries an event handler, and a deleted GateConfig sends no later event.
            _retries.start((namespace, name), lambda: _rerendered(memo, inventory, models_by_gate, namespace=namespace,
                                                                  name=name, logger=logger),
                           delay_s=RETRY_S, max_delay_s=RETRY_MAX_S)
            raise failed  # the handler still fails (Kopf logs it), after every model had its turn


async def _rerender_stale(gate_config: Mapping[str, Any] | None, memo: kopf.Memo, inventory: Inventory,
                          models_by_gate: kopf.Index, *, namespace: str, name: str,
                          logger: logging.Logger) -> Exception | None:
    """Re-render the GateConfig's models that are stale against ``gate_config`` (None: it is gone);
    the first failure, after every model had its turn."""
    views = [v for m in sorted(set(models_by_gate.get((namespace, name), [])))
             if (v := inventory.model(namespace, m)) is not None]
    failed: Exception | None = None
    for model in modelsync.stale_models(gate_config, views):
        logger.info("re-rendering SparseModel %s for GateConfig %s", model, name)
        try:
            await rereconcile(memo, inventory, namespace=namespace, name=model, logger=logger)
        except Exception as e:  # one model's failure must not leave the others on the old gate
            logger.error("re-rendering SparseModel %s for GateConfig %s failed: %s", model, name, e)
            failed = failed or e
    return failed


# A GateConfig some of whose models failed to re-render: its stale models (against the GateConfig as
# watched then) are re-rendered again after RETRY_S, doubling up to RETRY_MAX_S, until none fails.
RETRY_S = 10.0
RETRY_MAX_S = 300.0
_retries = Retries("GateConfig re-render")


async def _rerendered(memo: kopf.Memo, inventory: Inventory, models_by_gate: kopf.Index, *, namespace: str,
                      name: str, logger: logging.Logger) -> bool:
    return await _rerender_stale(inventory.gate(namespace, name), memo, inventory, models_by_gate,
                                 namespace=namespace, name=name, logger=logger) is None


@kopf.on.cleanup()
async def stop_rerender_retries(**_: Any) -> None:
    await _retries.stop()


@kopf.on.event(GROUP, VERSION, names.SPARSEMODELS)
async def model_gate_check(type: str | None, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                           logger: logging.Logger, **kwargs: Any) -> None:
    if type in (None, "DELETED") or body.metadata.get("deletionTimestamp"):
        return  # None: the initial listing, which the resume handler reconciles anyway
    ref = modelsync.gate_ref(body)
    if not ref:
        return
    inventory = Inventory.from_kopf(kwargs)
    if modelsync.stale_models(inventory.gate(namespace, ref), [body]):
        logger.info("re-rendering SparseModel %s: GateConfig %s changed since its status was written", name, ref)
        await rereconcile(memo, inventory, namespace=namespace, name=name, logger=logger)


async def rereconcile(memo: kopf.Memo, inventory: Inventory, *, namespace: str, name: str,
                      logger: logging.Logger) -> None:
    """Read the model and reconcile it in the model pool, unless that is queued already."""
    key, token = (namespace, name), object()
    if key in _queued:
        return
    _queued[key] = token
    loop = asyncio.get_running_loop()

    def forget() -> None:
        if _queued.get(key) is token:  # not a later one queued after this one started
            del _queued[key]

    try:
        # Not beside Kopf's handler of this model: the one that read it last must apply last.
        async with model_turn(namespace, name):
            reconciled = await run_model_work(
                memo, _read_and_reconcile, memo, namespace=namespace, name=name, logger=logger,
                pods=inventory.pods(namespace, name), watched=watched_deployment(inventory, namespace, name),
                gates=watched_gates(inventory), started=lambda: loop.call_soon_threadsafe(forget))
    finally:
        forget()
    if reconciled is not None and reconciled.service is not None:
        # Status written while the Service apply was in flight held Ready back (ServiceNotApplied,
        # Reconciling=True) or assumed its outcome: finished as the Kopf handler finishes it, or it
        # stays so (kstatus InProgress) until something else writes the model's status. In a task:
        # the GateConfig's loop over its stale models does not wait for each Service.
        task = asyncio.create_task(_finish(memo, reconciled.service, namespace=namespace, name=name, logger=logger))
        _finishing.add(task)
        task.add_done_callback(_finishing.discard)


async def _finish(memo: kopf.Memo, service: modelsync.PendingService, *, namespace: str, name: str,
                  logger: logging.Logger) -> None:
    try:
        await finish_service(memo, service)
    except KubeError as e:  # failed: the rewrite reported it (Degraded, ApplyFailed)
        logger.warning("Service of SparseModel %s/%s not applied: %s", namespace, name, e)


def _read_and_reconcile(memo: kopf.Memo, *, namespace: str, name: str, logger: logging.Logger,
                        pods: list[Mapping[str, Any]], watched: modelsync.WatchedDeployment,
                        gates: modelsync.WatchedGate, started: Callable[[], object]) -> modelsync.Reconciled | None:
    started()  # from here on, a newer change needs a reconcile of its own
    model = memo.kube.get("SparseModel", namespace=namespace, name=name)
    if model is None:
        return None
    return reconcile(memo, model, pods=pods, logger=logger, watched=watched, gates=gates)
