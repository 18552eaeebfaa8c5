"""The flow allow-list ConfigMaps (`sparsegate-flow-policy`, key `policy.json`, and its shards) the
eBPF agents read.

Written only by the routing-policy sync, which skips a publish when the version and the decision
basis are unchanged; here each publish is create-or-replace.
A document larger than `max_bytes` is sharded (`sparsegate_contracts.flowpolicy_shards`): the
shard ConfigMaps `sparsegate-flow-policy-<k>` are written first, the head last, then the shards the
previous head named and the new one does not are emptied (`flowpolicy_shards.publish_steps`; the
operator's RBAC grants no delete); the first publish of a process, and the one after a publish that
failed, empty every shard name the new head does not use (a publish cut short may have written
more). A small document stays one ConfigMap in the layout of before.
Reading a sharded head whose shards do not match it (an operator stopped mid-publish), or a
``policy.json`` that is not a JSON object (edited by hand), yields no document and sets
``half_published``: the operator then leaves the ConfigMaps as they are (the
agents keep enforcing the last whole document they read) until OPA has decided and the sync
republishes the whole set. The sync Kubernetes client runs in a worker thread so
Kopf's event loop never blocks; each request is bounded (``REQUEST_TIMEOUT_S``): the sync holds
its lock across a publish, so one answer that never came stopped every later policy change.

Beside the document, annotation `sparsegate.dev/flow-policy-basis` records what its allow entries
were decided from (`domain.policy.decision_basis`: Rego, trust domain, each RoutingPolicy's
generation and spec digest; and the class each identity stands for,
`domain.policy_compile.identity_classes`). An operator that starts while OPA is down reads it to
tell which policies changed meanwhile and must fail closed (`domain.policy_compile.narrow_undecided`). The
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

from sparsegate_contracts import flowpolicy, flowpolicy_shards, names
from sparsegate_contracts.canonical import canonical_json

from sparsegate.clients.kube import REQUEST_TIMEOUT_S

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
    def __init__(self, *, namespace: str, name: str = NAME,
                 max_bytes: int = flowpolicy_shards.SHARD_MAX_BYTES, api_client: Any = None) -> None:
        self._api_client = api_client  # None: in-cluster config, else the kubeconfig
        self.namespace = namespace
        self.name = name
        self.max_bytes = max_bytes  # per ConfigMap; a larger document is sharded
        self.shards: list[str] = []  # the shards the published head names
        # Every other shard name emptied since this process started, by a publish that completed: a
        # publish cut short (here, or in a process that stopped mid-publish) may have written shards
        # no head names; the next one empties every name its head does not use.
        self.swept = False
        self.half_published = False  # the last read found a head whose shards do not match it

    def _core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self._api_client) if self._api_client is not None else _core_api()

    def _get(self, name: str) -> Any:
        try:
            return self._core().read_namespaced_config_map(name, self.namespace, _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _read(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        self.half_published = False
        cm = self._get(self.name)
        if cm is None:
            return None, None
        raw = (cm.data or {}).get(KEY)
        basis = _basis((cm.metadata.annotations or {}).get(BASIS_ANNOTATION))
        self.shards = flowpolicy_shards.shards_named(raw)
        try:
            document = json.loads(raw) if raw else None
        except ValueError:
            document = raw
        if raw and not isinstance(document, dict):
            # Not a document (edited by hand, cut short): the agents refuse it and keep their last
            # policy; read as half-published, so it is left as it is until a sync republishes.
            self.half_published = True
            return None, None
        if isinstance(document, dict) and flowpolicy_shards.is_head(document):
            texts = {}
            for name in self.shards:
                shard = self._get(name)
                texts[name] = ((shard.data or {}).get(flowpolicy_shards.SHARD_KEY) if shard is not None else None)
            try:
                document = flowpolicy_shards.join(document, texts, head_name=self.name)
            except flowpolicy.FlowPolicyError:
                self.half_published = True
                return None, None  # a half-published set: republish whole on the next sync
        return document, basis

    def _write(self, document: Mapping[str, Any], basis: Mapping[str, Any] | None) -> None:
        annotations = {names.FLOW_POLICY_VERSION_ANNOTATION: str(document.get("version", ""))}
        recorded = canonical_json(basis) if basis is not None else ""
        if recorded and len(recorded) <= BASIS_ANNOTATION_MAX:
            annotations[BASIS_ANNOTATION] = recorded
        layout = flowpolicy_shards.split(document, head_name=self.name, max_bytes=self.max_bytes)
        previous = self.shards if self.swept else flowpolicy_shards.shard_names(self.name)
        steps = flowpolicy_shards.publish_steps(layout, head_name=self.name, previous_shards=previous)
        self.swept = False
        for step in steps:
            if step.action == "clear":
                self._clear(step.name)
            else:
                self._put(step.name, {step.key: step.text},
                          annotations if step.name == self.name else
                          {names.FLOW_POLICY_VERSION_ANNOTATION: str(document.get("version", ""))})
        self.shards = [name for name, _ in layout.shards]
        self.swept = True

    def _put(self, name: str, data: dict[str, str], annotations: dict[str, str]) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {names.PART_OF_LABEL: names.PART_OF, names.COMPONENT_LABEL: names.FLOW_POLICY_COMPONENT,
                           names.MANAGED_BY_LABEL: names.MANAGED_BY},
                "annotations": annotations,
            },
            "data": data,
        }
        api = self._core()
        try:
            api.replace_namespaced_config_map(name, self.namespace, body, _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as e:
            if e.status != 404:
                raise
            api.create_namespaced_config_map(self.namespace, body, _request_timeout=REQUEST_TIMEOUT_S)

    def _clear(self, name: str) -> None:
        """Empty a shard no head names any more (never created when absent)."""
        try:
            self._core().replace_namespaced_config_map(name, self.namespace, {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": {names.PART_OF_LABEL: names.PART_OF,
                                        names.COMPONENT_LABEL: names.FLOW_POLICY_COMPONENT,
                                        names.MANAGED_BY_LABEL: names.MANAGED_BY}},
                "data": {}}, _request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as e:
            if e.status != 404:
                raise

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
