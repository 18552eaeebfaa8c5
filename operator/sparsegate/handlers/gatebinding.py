"""GateConfig → SparseModel binding (the rollout logic itself lives in controllers.rollout).

On every GateConfig event: re-reconcile the models that reference it and render a different gate
than it now resolves to. The comparison reads the GateConfig as the event delivered it and the
models' watched views (``handlers.fleetindex``), so the frequent rollout status writes cost no API
request; only a model that is stale is read and reconciled. ``status.stable`` is written by the
rollout state machine alone (its first tick records the spec's version); until then a model
resolves the GateConfig's spec.params.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import metrics
from sparsegate.controllers.inventory import Inventory
from sparsegate.handlers import modelsync
from sparsegate.handlers.pools import run_model_work
from sparsegate.handlers.sparsemodel import GROUP, VERSION, reconcile, watched_deployment


@kopf.on.event(GROUP, VERSION, names.GATECONFIGS)
async def gateconfig_changed(type: str | None, body: kopf.Body, namespace: str, name: str,
                             models_by_gate: kopf.Index, memo: kopf.Memo,
                             logger: logging.Logger, **kwargs: Any) -> None:
    with metrics.observe("GateConfig"):
        inventory = Inventory.from_kopf(kwargs)
        views = [v for m in sorted(set(models_by_gate.get((namespace, name), [])))
                 if (v := inventory.model(namespace, m)) is not None]
        stale = modelsync.stale_models(None if type == "DELETED" else dict(body), views)
        for model in stale:
            logger.info("re-rendering SparseModel %s for GateConfig %s", model, name)
            await run_model_work(memo, _reconcile, memo, namespace=namespace, name=model, logger=logger,
                                 pods=inventory.pods(namespace, model),
                                 watched=watched_deployment(inventory, namespace, model))


def _reconcile(memo: kopf.Memo, *, namespace: str, name: str, logger: logging.Logger,
               pods: list[Mapping[str, Any]], watched: modelsync.WatchedDeployment) -> None:
    model = memo.kube.get("SparseModel", namespace=namespace, name=name)
    if model is not None:
        reconcile(memo, model, pods=pods, logger=logger, watched=watched)
