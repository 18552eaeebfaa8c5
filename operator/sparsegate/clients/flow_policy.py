"""The flow allow-list ConfigMap (`sparsegate-flow-policy`, key `policy.json`) the eBPF agents read.

Written only by the routing-policy sync; create-or-replace, skipped when the version is unchanged.
The sync Kubernetes client runs in a worker thread so Kopf's event loop never blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client import ApiException

from sparsegate_contracts import flowpolicy, names

NAME = flowpolicy.CONFIGMAP_NAME
KEY = flowpolicy.DOCUMENT_KEY

_loaded = False


def _core_api() -> kubernetes.client.CoreV1Api:
    global _loaded
    if not _loaded:
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        _loaded = True
    return kubernetes.client.CoreV1Api()


class FlowPolicyConfigMap:
    def __init__(self, *, namespace: str, name: str = NAME) -> None:
        self.namespace = namespace
        self.name = name

    def _read(self) -> dict[str, Any] | None:
        try:
            cm = _core_api().read_namespaced_config_map(self.name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raw = (cm.data or {}).get(KEY)
        return json.loads(raw) if raw else None

    def _write(self, document: Mapping[str, Any]) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {names.PART_OF_LABEL: names.PART_OF, names.COMPONENT_LABEL: names.FLOW_POLICY_COMPONENT,
                           names.MANAGED_BY_LABEL: names.MANAGED_BY},
                "annotations": {names.FLOW_POLICY_VERSION_ANNOTATION: str(document.get("version", ""))},
            },
            "data": {KEY: flowpolicy.document_text(document)},
        }
        api = _core_api()
        try:
            api.replace_namespaced_config_map(self.name, self.namespace, body)
        except ApiException as e:
            if e.status != 404:
                raise
            api.create_namespaced_config_map(self.namespace, body)

    async def read(self) -> dict[str, Any] | None:
        """The published document, None when there is none yet."""
        return await asyncio.to_thread(self._read)

    async def publish(self, document: Mapping[str, Any]) -> None:
        await asyncio.to_thread(self._write, document)
