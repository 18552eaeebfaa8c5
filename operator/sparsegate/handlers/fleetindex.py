"""Kopf indexes of the objects a model's fleet is made of (``domain.fleet_view`` projections).

The rollout controller and the access sync read a model's pods, ReplicaSets, Deployment and the
SparseModel itself from these instead of the API server (``controllers.inventory``); a model's
reconcile reads its GateConfig from here too. Kopf fills
every index from its initial listing before any handler runs, so a restarted operator never
ticks on an empty view. The watches are the ones the operator holds anyway (pods, Deployments,
SparseModels, GateConfigs) plus ReplicaSets, which its role already lets it list and watch. Keys
and projections hold interned strings (``domain.interned``): they live as long as the objects.
"""

from __future__ import annotations

from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate.domain import fleet_view, interned


@kopf.index(names.GROUP, names.VERSION, names.SPARSEMODELS)
async def sparsegate_model_views(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    """(namespace, model) → the SparseModel's projection."""
    return {interned.deep((namespace, name)): fleet_view.model_view(body)}


@kopf.index("", "v1", "pods", labels={names.MODEL_LABEL: kopf.PRESENT})
async def sparsegate_model_pod_views(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict:
    """(namespace, model) → the projections of the pods labelled as the model's (owner checks decide
    later which of them are really its pods)."""
    return {interned.deep((namespace, labels[names.MODEL_LABEL])): fleet_view.pod_view(body)}


@kopf.index("apps", "v1", "deployments", labels={names.NAME_LABEL: names.MODEL_SERVER_NAME})
async def sparsegate_model_deployment_views(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    """(namespace, Deployment name) → its projection (owner and replica status)."""
    return {interned.deep((namespace, name)): fleet_view.deployment_view(body)}


@kopf.index("apps", "v1", "replicasets", labels={names.NAME_LABEL: names.MODEL_SERVER_NAME})
async def sparsegate_model_replicaset_views(namespace: str, uid: str, body: kopf.Body, **_: Any) -> dict:
    """(namespace, ReplicaSet uid) → its projection (pods name their ReplicaSet by uid)."""
    return {interned.deep((namespace, uid)): fleet_view.owner_view(body)}


@kopf.index(names.GROUP, names.VERSION, names.GATECONFIGS)
async def sparsegate_gate_views(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    """(namespace, GateConfig) → what a model's gate resolves from (``fleet_view.gate_view``)."""
    return {interned.deep((namespace, name)): fleet_view.gate_view(body)}
