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
from collections.abc import Mapping
from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import metrics
from sparsegate.clients.kube import Kube
from sparsegate.controllers.inventory import Inventory
from sparsegate.domain import conditions
from sparsegate.handlers import modelsync
from sparsegate.handlers.pools import run_model_work

GROUP, VERSION = names.GROUP, names.VERSION


def post_event(body: Any, type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message[:1024])


@kopf.index(GROUP, VERSION, names.SPARSEMODELS)
async def models_by_gate(namespace: str, name: str, spec: kopf.Spec, **_: Any) -> dict | None:
    """(namespace, GateConfig name) → names of the models that reference it."""
    ref = (spec.get("gateConfigRef") or {}).get("name")
    return {(namespace, ref): name} if ref else None


@kopf.on.resume(GROUP, VERSION, names.SPARSEMODELS)
@kopf.on.create(GROUP, VERSION, names.SPARSEMODELS)
@kopf.on.update(GROUP, VERSION, names.SPARSEMODELS)
async def reconcile_model(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger,
                          **kwargs: Any) -> None:
    pods = Inventory.from_kopf(kwargs).pods(namespace, name)  # read on the event loop, where Kopf writes it
    await run_model_work(memo, _reconcile, memo.kube, dict(body), pods=pods, logger=logger)


def _reconcile(kube: Kube, model: Mapping[str, Any], *, pods: list[Mapping[str, Any]], logger: logging.Logger) -> None:
    with metrics.observe("SparseModel") as outcome:
        outcome.value = modelsync.reconcile(kube, model, events=post_event, logger=logger, pods=pods)


@kopf.on.event("apps", "v1", "deployments",
               labels={names.NAME_LABEL: names.MODEL_SERVER_NAME,
                       names.MANAGED_BY_LABEL: names.MANAGED_BY})
async def deployment_changed(type: str | None, body: kopf.Body, memo: kopf.Memo,
                             logger: logging.Logger, **kwargs: Any) -> None:
    model = body.metadata.labels.get(names.MODEL_LABEL)
    if not model or type is None:  # None: the initial listing; resume handlers cover it
        return
    namespace = body.metadata.namespace
    pods = Inventory.from_kopf(kwargs).pods(namespace, model)
    await run_model_work(memo, _deployment_changed, memo.kube, type=type, deployment=dict(body), model=model,
                         pods=pods, logger=logger)


def _deployment_changed(kube: Kube, *, type: str, deployment: Mapping[str, Any], model: str,
                        pods: list[Mapping[str, Any]], logger: logging.Logger) -> None:
    namespace = deployment["metadata"]["namespace"]
    with metrics.observe("Deployment"):
        if type == "DELETED":
            # Deleted by someone else while its model lives on: put it back (self-healing).
            owner = modelsync.live_owner(kube, namespace=namespace, name=model,
                                         owner_refs=deployment["metadata"].get("ownerReferences") or [])
            if owner is not None:
                logger.warning("Deployment %s was deleted; re-creating it", model)
                modelsync.reconcile(kube, owner, events=post_event, logger=logger, pods=pods)
                return
        modelsync.refresh_from_deployment(
            kube, namespace=namespace, name=model, deployment=None if type == "DELETED" else deployment,
            pods=pods, events=post_event)


def _stuck(body: kopf.Body, **_: Any) -> bool:
    return conditions.is_stuck(body)


@kopf.on.event("", "v1", "pods", labels={names.NAME_LABEL: names.MODEL_SERVER_NAME}, when=_stuck)
async def pod_stuck(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    model = body.metadata.labels.get(names.MODEL_LABEL)
    if not model:
        return
    namespace = body.metadata.namespace
    pods = Inventory.from_kopf(kwargs).pods(namespace, model)
    await run_model_work(memo, _pod_stuck, memo.kube, namespace=namespace, model=model, pods=pods)


def _pod_stuck(kube: Kube, *, namespace: str, model: str, pods: list[Mapping[str, Any]]) -> None:
    with metrics.observe("Pod"):
        deployment = kube.get("Deployment", namespace=namespace, name=model)
        modelsync.refresh_from_deployment(kube, namespace=namespace, name=model, deployment=deployment, pods=pods,
                                          events=post_event)
