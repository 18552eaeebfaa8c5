"""GateConfig status → the ``sparsegate_rollout_*`` gauges, on every watch event.

A handler of its own (not part of the rollout loop): the gauges follow the status the API server
holds, whoever wrote it, and the rollout controller needs no metrics code. Kopf shares one watch
per resource among its handlers, so this adds no API traffic.
"""

from __future__ import annotations

from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import metrics
from sparsegate.handlers import modelsync


@kopf.on.event(names.GROUP, names.VERSION, names.GATECONFIGS)
async def gateconfig_rollout_gauges(type: str | None, body: kopf.Body, namespace: str, name: str,
                                    sparsegate_gate_views: kopf.Index, **_: Any) -> None:
    if type == "DELETED":
        # Kopf drops a deleted object from its indexes before the handlers run: one still indexed
        # under the name was created again (its events came first), and the gauges are its own.
        if (namespace, name) not in sparsegate_gate_views:
            metrics.forget_gateconfig(namespace=namespace, name=name)
    else:
        metrics.observe_gateconfig(namespace=namespace, name=name, status=body.get("status"))


@kopf.on.event(names.GROUP, names.VERSION, names.SPARSEMODELS)
async def sparsemodel_gateconfig_binding(type: str | None, body: kopf.Body, namespace: str, name: str,
                                         sparsegate_model_views: kopf.Index, **_: Any) -> None:
    """``sparsegate_gateconfig_model_info``: which GateConfig each SparseModel names, so the
    dashboard keeps a GateConfig's canary-vs-stable panels to its own models."""
    if type == "DELETED":
        if (namespace, name) not in sparsegate_model_views:  # (as above: not one created again)
            metrics.bind_model(namespace=namespace, name=name, gateconfig=None)
    else:
        metrics.bind_model(namespace=namespace, name=name, gateconfig=modelsync.gate_ref(body))
