"""The probe configuration and report ConfigMaps (contract: ``sparsegate_contracts.probes``).

The operator writes ``sparsegate-probe-config`` whole (PUT, only when its data changed; ``holds``
lets it notice a deletion or a hand edit and write it again) and
creates ``sparsegate-probe-reports`` empty if it is missing, so each agent can merge-patch its own
key into it with RBAC on that one name (no create). With no probe and no configuration published
yet it writes neither. Reports that do not parse are skipped and
logged: one bad agent must not hide the others. The operator also drops the report keys of nodes
that no longer exist (``prune_reports``), the only thing that ever removes a key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from typing import Any

from sparsegate_contracts import names
from sparsegate_contracts.probes import (
    CONFIG_CONFIGMAP_NAME,
    REPORT_CONFIGMAP_NAME,
    NodeReport,
    ProbeDocumentError,
    document_text,
    parse_report,
)

from sparsegate.clients.kube import Conflict, Kube
from sparsegate.domain.telemetry_probe import stale_report_keys

log = logging.getLogger(__name__)
COMPONENT = "probe-config"


def _configmap(*, namespace: str, name: str, data: Mapping[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {names.PART_OF_LABEL: names.PART_OF, names.COMPONENT_LABEL: COMPONENT,
                                    names.MANAGED_BY_LABEL: names.MANAGED_BY}},
            "data": dict(data)}


class ProbeConfigMaps:
    def __init__(self, *, kube: Kube, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace

    def _publish(self, configs: Mapping[str, Mapping[str, Any]]) -> bool:
        data = {node: document_text(doc) for node, doc in configs.items()}
        current = self.kube.get("ConfigMap", namespace=self.namespace, name=CONFIG_CONFIGMAP_NAME)
        if current is None and not data:
            # No probe, and no configuration to take back: agents read a missing ConfigMap as "no
            # probe", and the reports ConfigMap is needed only once an agent has a probe to report on.
            # (Writing them anyway failed on every node event where the namespace does not exist:
            # 1,512 failed POSTs in a 10,000-model bench_scale run of the standalone operator.)
            return False
        self.kube.create_if_absent(_configmap(namespace=self.namespace, name=REPORT_CONFIGMAP_NAME, data={}))
        if current is None:
            self.kube.create(_configmap(namespace=self.namespace, name=CONFIG_CONFIGMAP_NAME, data=data))
            return True
        if (current.get("data") or {}) == data:
            return False
        body = _configmap(namespace=self.namespace, name=CONFIG_CONFIGMAP_NAME, data=data)
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        self.kube.replace(body)  # 409 if someone wrote meanwhile: the next sync retries
        return True

    def _holds(self, configs: Mapping[str, Mapping[str, Any]]) -> bool:
        cm = self.kube.get("ConfigMap", namespace=self.namespace, name=CONFIG_CONFIGMAP_NAME)
        data = {node: document_text(doc) for node, doc in configs.items()}
        return not data if cm is None else (cm.get("data") or {}) == data

    def _reports(self) -> dict[str, NodeReport]:
        cm = self.kube.get("ConfigMap", namespace=self.namespace, name=REPORT_CONFIGMAP_NAME)
        out: dict[str, NodeReport] = {}
        for node, text in ((cm or {}).get("data") or {}).items():
            try:
                report = parse_report(text)
            except ProbeDocumentError as exc:
                log.warning("skipping the probe report of node %s: %s", node, exc)
                continue
            if report.node != node:
                log.warning("skipping the probe report under key %s: it names node %s", node, report.node)
                continue
            out[node] = report
        return out

    def _prune_reports(self, nodes: Collection[str]) -> list[str] | None:
        cm = self.kube.get("ConfigMap", namespace=self.namespace, name=REPORT_CONFIGMAP_NAME)
        data = (cm or {}).get("data") or {}
        stale = stale_report_keys(report_keys=data, nodes=nodes)
        if cm is None or not stale:
            return []
        # PUT of what was read (its resourceVersion): an agent's patch since makes it 409, so a key
        # just written is never lost; the operator's RBAC on this ConfigMap is get and update.
        drop = set(stale)
        try:
            self.kube.replace({**cm, "data": {k: v for k, v in data.items() if k not in drop}})
        except Conflict:
            return None
        return stale

    async def prune_reports(self, nodes: Collection[str]) -> list[str] | None:
        """Drop the report keys of nodes not in ``nodes`` (the node list just read); the keys
        dropped, or None when an agent wrote meanwhile (nothing dropped: try again later)."""
        return await asyncio.to_thread(self._prune_reports, nodes)

    async def publish(self, configs: Mapping[str, Mapping[str, Any]]) -> bool:
        """Make the configuration ConfigMap hold exactly ``configs``; True when it was written."""
        return await asyncio.to_thread(self._publish, configs)

    async def holds(self, configs: Mapping[str, Mapping[str, Any]]) -> bool:
        """Whether the configuration ConfigMap holds exactly ``configs`` (absent: only when empty);
        one GET, writes nothing."""
        return await asyncio.to_thread(self._holds, configs)

    async def reports(self) -> dict[str, NodeReport]:
        """Every node's valid report (node name -> report)."""
        return await asyncio.to_thread(self._reports)
