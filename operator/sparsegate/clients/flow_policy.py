"""The flow allow-list ConfigMap (`sparsegate-flow-policy`, key `policy.json`) the eBPF agents read.

Written only by the routing-policy sync; create-or-replace, skipped when the version is unchanged.
The sync Kubernetes client runs in a worker thread so Kopf's event loop never blocks.

Beside the document, annotation `sparsegate.dev/flow-policy-basis` records what its allow entries
were decided from (`domain.policy.decision_basis`: Rego, trust domain, each RoutingPolicy's
generation and spec digest). An operator that starts while OPA is down reads it to tell which
policies changed meanwhile and must fail closed (`domain.policy_compile.narrow_undecided`). The
agents never read it, so the flow-policy document format is unchanged. Without the annotation (an
older operator wrote the ConfigMap, or the record outgrew the annotation budget) every policy
counts as changed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client import ApiException

from sparsegate_contracts import flowpolicy, names
from sparsegate_contracts.canonical import canonical_json

NAME = flowpolicy.CONFIGMAP_NAME
KEY = flowpolicy.DOCUMENT_KEY
BASIS_ANNOTATION = names.FLOW_POLICY_BASIS_ANNOTATION
# Kubernetes allows 256 KiB of annotations per object; leave room for the others. A larger record
# is not written (fail closed on the next start without OPA, never a refused write).
BASIS_ANNOTATION_MAX = 200_000

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

    def _read(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        try:
            cm = _core_api().read_namespaced_config_map(self.name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None, None
            raise
        raw = (cm.data or {}).get(KEY)
        return (json.loads(raw) if raw else None), _basis((cm.metadata.annotations or {}).get(BASIS_ANNOTATION))

    def _write(self, document: Mapping[str, Any], basis: Mapping[str, Any] | None) -> None:
        annotations = {names.FLOW_POLICY_VERSION_ANNOTATION: str(document.get("version", ""))}
        recorded = canonical_json(basis) if basis is not None else ""
        if recorded and len(recorded) <= BASIS_ANNOTATION_MAX:
            annotations[BASIS_ANNOTATION] = recorded
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {names.PART_OF_LABEL: names.PART_OF, names.COMPONENT_LABEL: names.FLOW_POLICY_COMPONENT,
                           names.MANAGED_BY_LABEL: names.MANAGED_BY},
                "annotations": annotations,
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
        return (await self.read_published())[0]

    async def read_published(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The published document and the decision basis recorded with it (each None when absent)."""
        return await asyncio.to_thread(self._read)

    async def publish(self, document: Mapping[str, Any], *, basis: Mapping[str, Any] | None = None) -> None:
        """Replace the document; `basis`: what its allow entries were decided from (None: unknown)."""
        await asyncio.to_thread(self._write, document, basis)


def _basis(raw: str | None) -> dict[str, Any] | None:
    """The recorded basis, None when absent or unreadable (then nothing counts as decided)."""
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("policies"), dict) else None
