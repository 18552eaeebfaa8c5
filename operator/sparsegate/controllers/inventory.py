"""What a fleet is read from: the watched projections of ``domain.fleet_view``.

In the operator the five mappings are the Kopf indexes of ``handlers.fleetindex`` (key → a store of
the values of every object under that key); in tests, plain dicts of lists. Read on the event loop
only (Kopf updates the indexes there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

Views = Mapping[tuple[str, str], Iterable[Mapping[str, Any]]]


def _first(values: Iterable[Mapping[str, Any]] | None) -> Mapping[str, Any] | None:
    return next(iter(values), None) if values is not None else None


class Inventory:
    def __init__(self, *, models: Views, pods: Views, deployments: Views, replicasets: Views,
                 gates: Views) -> None:
        self._models, self._pods = models, pods
        self._deployments, self._replicasets = deployments, replicasets
        self._gates = gates

    def model(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return _first(self._models.get((namespace, name)))

    def pods(self, namespace: str, model: str) -> list[Mapping[str, Any]]:
        """Pods labelled as the model's (whether they are its pods is the owner check's question)."""
        return list(self._pods.get((namespace, model)) or ())

    def deployment(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return _first(self._deployments.get((namespace, name)))

    def replicaset(self, namespace: str, uid: str) -> Mapping[str, Any] | None:
        return _first(self._replicasets.get((namespace, uid)))

    def gate(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The GateConfig's view (``fleet_view.gate_view``), None when the watch has none."""
        return _first(self._gates.get((namespace, name)))

    @classmethod
    def from_kopf(cls, kwargs: Mapping[str, Any]) -> Inventory:
        """From a Kopf handler's keyword arguments (the indexes arrive under their handler names)."""
        return cls(models=kwargs["sparsegate_model_views"], pods=kwargs["sparsegate_model_pod_views"],
                   deployments=kwargs["sparsegate_model_deployment_views"],
                   replicasets=kwargs["sparsegate_model_replicaset_views"],
                   gates=kwargs["sparsegate_gate_views"])
