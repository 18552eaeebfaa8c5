"""GateConfig → SparseModel binding (the rollout logic itself lives in controllers.rollout).

On every GateConfig event: re-reconcile the models that reference it and render a different gate
than it now resolves to. Comparing versions keeps this level-triggered and cheap under frequent
rollout status writes. ``status.stable`` is written by the rollout state machine alone (its first
tick records the spec's version); until then a model resolves the GateConfig's spec.params.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import metrics
from sparsegate.handlers import modelsync
from sparsegate.handlers.sparsemodel import GROUP, VERSION, post_event


@kopf.on.event(GROUP, VERSION, names.GATECONFIGS)
def gateconfig_changed(type: str | None, body: kopf.Body, namespace: str, name: str,
                       models_by_gate: kopf.Index, memo: kopf.Memo,
                       logger: logging.Logger, **_: Any) -> None:
    with metrics.observe("GateConfig"):
        names = sorted(set(models_by_gate.get((namespace, name), [])))
        for model in modelsync.models_to_resync(memo.kube, namespace=namespace, names=names):
            logger.info("re-rendering SparseModel %s for GateConfig %s", model["metadata"]["name"], name)
            with metrics.observe("SparseModel") as outcome:
                outcome.value = modelsync.reconcile(memo.kube, model, events=post_event,
                                                    logger=logger)
