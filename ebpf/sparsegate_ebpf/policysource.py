"""Where policy documents come from: a local file (polled) or a ConfigMap (watched).

Each source calls `on_document(text)` with the raw `policy.json` text whenever it changes;
validation and the swap happen in the agent. The ConfigMap-to-text step is a pure function.

A ConfigMap source reads both layouts (`sparsegate_contracts.flowpolicy_shards`): a head holding
the whole document, or a head naming shard ConfigMaps `<name>-<k>`. It watches the head (the
writer's commit point) and, for a sharded head, gets each shard and forwards the rebuilt document
only when every shard matches the head's digests and version; a half-updated set is not forwarded
(the agent keeps the policy it enforces). While the set stays inconsistent the source keeps watching
the head (a new head is read at once) and re-reads the whole set 1 s later, then at doubling
intervals up to 30 s (shards are large).

`LivePolicyFilter` sits between a source and the agent: it also follows which RoutingPolicies
exist (`watch_routing_policies`) and drops the allow entries of deleted ones, so a policy's access
ends when the policy goes even while the operator is down (the operator republishes the same
narrowing when it runs). It only ever narrows: until the first list succeeds, and while the API
server is unreachable, documents pass as published.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sparsegate_contracts import names
from sparsegate_contracts import flowpolicy_shards
from sparsegate_contracts.flowpolicy import (DOCUMENT_KEY, FlowPolicyError, document_text, rows_of,
                                             without_policies)

log = logging.getLogger(__name__)

POLICY_KEY = DOCUMENT_KEY
OnDocument = Callable[[str], None]
OnPolicies = Callable[[set[str]], None]


def document_from_configmap(obj: Any) -> str | None:
    """The policy text from a ConfigMap (kubernetes model or dict); None when the key is absent."""
    data = obj.get("data") if isinstance(obj, Mapping) else getattr(obj, "data", None)
    if not data:
        return None
    return data.get(POLICY_KEY)


def assemble(head_text: str, get_shard: Callable[[str], str | None], *, head_name: str) -> str:
    """The policy text a head ConfigMap's ``policy.json`` stands for: itself (single layout), or the
    document rebuilt from its shards (``get_shard(name)``: a shard's ``shard.json``, None if absent).
    ShardsNotReady for an inconsistent set, FlowPolicyError for a malformed head."""
    try:
        head = json.loads(head_text)
    except ValueError:
        return head_text  # the agent's parser reports it
    if not isinstance(head, Mapping) or not flowpolicy_shards.is_head(head):
        return head_text
    texts = {name: get_shard(name) for name in flowpolicy_shards.shards_named(head_text)}
    return document_text(flowpolicy_shards.join(head, texts, head_name=head_name))


class _Dedup:
    """Forward a document only when its content changed (watches and polls repeat). A document
    whose handling raised is not recorded, so the source's next read or retry forwards it again."""

    def __init__(self, on_document: OnDocument) -> None:
        self._on_document = on_document
        self._last: str | None = None

    def __call__(self, text: str) -> None:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest != self._last:
            self._on_document(text)
            self._last = digest


def watch_file(*, path: Path, on_document: OnDocument, stop: threading.Event, interval: float = 1.0) -> None:
    """Poll `path` (content hash, so editors that replace the file are fine) until `stop`."""
    emit = _Dedup(on_document)
    missing_logged = False
    while not stop.is_set():
        try:
            emit(path.read_text())
            missing_logged = False
        except FileNotFoundError:
            if not missing_logged:
                log.warning("policy file %s does not exist (yet)", path)
                missing_logged = True
        except Exception:
            log.exception("policy update from %s failed", path)
        stop.wait(interval)


def watch_configmap(*, namespace: str, name: str, on_document: OnDocument, stop: threading.Event,
                    api_client: Any = None) -> None:
    """Watch the head ConfigMap ``name`` with the kubernetes client (getting its shards when it names
    some, ``assemble``); re-read and re-watch on any error.

    Without `api_client`: in-cluster service account, else $KUBECONFIG / ~/.kube/config.
    """
    from kubernetes import client, config, watch  # only this source needs the client

    if api_client is None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    api = client.CoreV1Api(api_client)
    emit = _Dedup(on_document)

    def shard(shard_name: str) -> str | None:
        try:
            cm = api.read_namespaced_config_map(shard_name, namespace)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return (cm.data or {}).get(flowpolicy_shards.SHARD_KEY)

    def forward(obj: Any) -> bool:
        """Emit the policy of a head object; False when its shards are not consistent (yet)."""
        text = document_from_configmap(obj)
        if text is None:
            log.warning("ConfigMap %s/%s has no %s key", namespace, name, POLICY_KEY)
            return True
        try:
            emit(assemble(text, shard, head_name=name))
        except flowpolicy_shards.ShardsNotReady as exc:
            log.info("flow policy shards not consistent yet, keeping the live policy: %s", exc)
            return False
        except FlowPolicyError as exc:
            log.error("flow policy head %s/%s refused, keeping the live policy: %s", namespace, name, exc)
        return True

    backoff = 1.0
    pending = 0  # while the set is inconsistent: seconds to the next full re-read (1 s doubling to 30 s)
    while not stop.is_set():
        try:
            cm = api.read_namespaced_config_map(name, namespace)
            pending = 0 if forward(cm) else min(max(pending * 2, 1), 30)
            w = watch.Watch()
            for event in w.stream(
                api.list_namespaced_config_map,
                namespace,
                field_selector=f"metadata.name={name}",
                resource_version=cm.metadata.resource_version,
                timeout_seconds=pending or 30,  # the stream's end is the re-read
            ):
                if stop.is_set():
                    w.stop()
                    break
                if event["type"] in ("ADDED", "MODIFIED") and not forward(event["object"]) and not pending:
                    w.stop()  # a head whose shards do not match (yet): re-read, then on the re-read period
                    break
            backoff = 1.0
        except Exception as exc:
            log.warning("watching ConfigMap %s/%s: %s (retrying in %.0fs)", namespace, name, exc, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)


class LivePolicyFilter:
    """The latest published document, minus allow entries of RoutingPolicies that no longer exist."""

    def __init__(self, on_document: OnDocument) -> None:
        self._emit = _Dedup(on_document)
        self._lock = threading.Lock()
        self._text: str | None = None
        self._live: set[str] | None = None  # None: not listed yet (nothing is dropped)
        self.dropped_entries = 0

    def document(self, text: str) -> None:
        with self._lock:
            self._text = text
            self._forward()

    def policies(self, live: set[str]) -> None:
        with self._lock:
            self._live = set(live)
            self._forward()

    def _forward(self) -> None:
        if self._text is None:
            return
        text, self.dropped_entries = self._text, 0
        if self._live is not None:
            try:
                document = json.loads(self._text)
                narrowed = without_policies(document, live=self._live) if isinstance(document, dict) else None
            except (ValueError, TypeError, AttributeError):
                narrowed = None  # the agent's parser reports what is wrong with it
            if narrowed is not None:
                self.dropped_entries = len(rows_of(document)) - len(rows_of(narrowed))
                text = document_text(narrowed)
                log.info("dropping %d allow entries of deleted RoutingPolicies", self.dropped_entries)
        self._emit(text)


def watch_routing_policies(*, on_policies: OnPolicies, stop: threading.Event, namespaces: list[str] | None = None,
                           api_client: Any = None) -> None:
    """List then watch RoutingPolicies (every namespace, or ``namespaces``); report the live ``ns/name`` set.

    Objects with a deletionTimestamp count as gone. Re-lists on any error; the last set reported
    stands in between (an unreachable API server never widens what the filter keeps).
    """
    from kubernetes import client, config, watch  # only this source needs the client

    if api_client is None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    api = client.CustomObjectsApi(api_client)
    scopes: list[str | None] = list(namespaces) if namespaces else [None]

    def live_key(obj: Mapping[str, Any]) -> str | None:
        meta = obj.get("metadata") or {}
        return None if meta.get("deletionTimestamp") else f"{meta.get('namespace')}/{meta.get('name')}"

    def lister(ns: str | None) -> tuple[Any, tuple[Any, ...]]:
        plural = (names.GROUP, names.VERSION, names.ROUTINGPOLICIES)
        if ns is None:
            return api.list_cluster_custom_object, plural
        return api.list_namespaced_custom_object, (plural[0], plural[1], ns, plural[2])

    backoff = 1.0
    while not stop.is_set():
        try:
            live: dict[str | None, set[str]] = {}
            versions: dict[str | None, str] = {}
            for ns in scopes:
                fn, args = lister(ns)
                listed = fn(*args)
                live[ns] = {k for o in listed.get("items") or () if (k := live_key(o))}
                versions[ns] = listed["metadata"]["resourceVersion"]
            on_policies(set().union(*live.values()))
            # One scope watched at a time would starve the others: with several namespaces, poll
            # (re-list every 5 s); with one scope, watch it.
            if len(scopes) > 1:
                stop.wait(5.0)
                continue
            ns = scopes[0]
            fn, args = lister(ns)
            w = watch.Watch()
            for event in w.stream(fn, *args, resource_version=versions[ns], timeout_seconds=30):
                if stop.is_set():
                    w.stop()
                    break
                obj, key = event["object"], None
                meta = obj.get("metadata") or {}
                key = f"{meta.get('namespace')}/{meta.get('name')}"
                if event["type"] == "DELETED" or live_key(obj) is None:
                    live[ns].discard(key)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    live[ns].add(key)
                else:
                    continue
                on_policies(set(live[ns]))
            backoff = 1.0
        except Exception as exc:
            log.warning("watching RoutingPolicies: %s (retrying in %.0fs)", exc, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)
