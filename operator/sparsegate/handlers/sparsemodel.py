"""Kopf wiring for SparseModel: each handler is a thin call into handlers.modelsync.

- create/update/resume → render and server-side apply the owned objects, write status.
- any event of an owned Deployment → refresh replica counts and Ready/Progressing.
- a model pod whose container cannot start (missing image, crash loop) → the same refresh, so
  Ready=False names the pod, container and reason (ContainersWaiting).
- GateConfig events → write status.stable on first sight (if nothing else did) and re-reconcile
  models whose rendered gate no longer matches (see handlers.gatebinding).
  A Deployment deleted while its model lives is re-created.
Deletion needs no handler (and so no finalizer): owned objects carry ownerReferences and the
garbage collector removes them. No timers either: Kopf gives timed resources a finalizer, and a
SparseModel must stay deletable while the operator is down.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import metrics
from sparsegate.domain import conditions
from sparsegate.handlers import modelsync

GROUP, VERSION = names.GROUP, names.VERSION


def post_event(body: Any, type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


@kopf.index(GROUP, VERSION, names.SPARSEMODELS)
def models_by_gate(namespace: str, name: str, spec: kopf.Spec, **_: Any) -> dict | None:
    """(namespace, GateConfig name) → names of the models that reference it."""
    ref = (spec.get("gateConfigRef") or {}).get("name")
    return {(namespace, ref): name} if ref else None


@kopf.on.resume(GROUP, VERSION, names.SPARSEMODELS)
@kopf.on.create(GROUP, VERSION, names.SPARSEMODELS)
@kopf.on.update(GROUP, VERSION, names.SPARSEMODELS)
def reconcile_model(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    with metrics.observe("SparseModel") as outcome:
        outcome.value = modelsync.reconcile(memo.kube, body, events=post_event, logger=logger)


@kopf.on.event("apps", "v1", "deployments",
               labels={names.NAME_LABEL: names.MODEL_SERVER_NAME,
                       names.MANAGED_BY_LABEL: names.MANAGED_BY})
def deployment_changed(type: str | None, body: kopf.Body, memo: kopf.Memo,
                       logger: logging.Logger, **_: Any) -> None:
    model = body.metadata.labels.get(names.MODEL_LABEL)
    if not model or type is None:  # None: the initial listing; resume handlers cover it
        return
    with metrics.observe("Deployment"):
        if type == "DELETED":
            # Deleted by someone else while its model lives on: put it back (self-healing).
            owner = modelsync.live_owner(memo.kube, namespace=body.metadata.namespace, name=model,
                                         owner_refs=body.metadata.get("ownerReferences") or [])
            if owner is not None:
                logger.warning("Deployment %s was deleted; re-creating it", model)
                modelsync.reconcile(memo.kube, owner, events=post_event, logger=logger)
                return
        modelsync.refresh_from_deployment(
            memo.kube, namespace=body.metadata.namespace, name=model,
            deployment=None if type == "DELETED" else dict(body), events=post_event)


def _stuck(body: kopf.Body, **_: Any) -> bool:
    return conditions.is_stuck(body)


@kopf.on.event("", "v1", "pods", labels={names.NAME_LABEL: names.MODEL_SERVER_NAME}, when=_stuck)
def pod_stuck(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    model = body.metadata.labels.get(names.MODEL_LABEL)
    if not model:
        return
    namespace = body.metadata.namespace
    with metrics.observe("Pod"):
        deployment = memo.kube.get("Deployment", namespace=namespace, name=model)
        modelsync.refresh_from_deployment(memo.kube, namespace=namespace, name=model, deployment=deployment,
                                          events=post_event)
