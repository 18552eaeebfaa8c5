"""Where policy documents come from: a local file (polled) or a ConfigMap (watched).

Each source calls `on_document(text)` with the raw `policy.json` text whenever it changes;
validation and the swap happen in the agent. The ConfigMap-to-text step is a pure function.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sparsegate_contracts.flowpolicy import DOCUMENT_KEY

log = logging.getLogger(__name__)

POLICY_KEY = DOCUMENT_KEY
OnDocument = Callable[[str], None]


def document_from_configmap(obj: Any) -> str | None:
    """The policy text from a ConfigMap (kubernetes model or dict); None when the key is absent."""
    data = obj.get("data") if isinstance(obj, Mapping) else getattr(obj, "data", None)
    if not data:
        return None
    return data.get(POLICY_KEY)


class _Dedup:
    """Forward a document only when its content changed (watches and polls repeat)."""

    def __init__(self, on_document: OnDocument) -> None:
        self._on_document = on_document
        self._last: str | None = None

    def __call__(self, text: str) -> None:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest != self._last:
            self._last = digest
            self._on_document(text)


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
    """Watch one ConfigMap with the kubernetes client; re-read and re-watch on any error.

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
    backoff = 1.0
    while not stop.is_set():
        try:
            cm = api.read_namespaced_config_map(name, namespace)
            text = document_from_configmap(cm)
            if text is not None:
                emit(text)
            else:
                log.warning("ConfigMap %s/%s has no %s key", namespace, name, POLICY_KEY)
            w = watch.Watch()
            for event in w.stream(
                api.list_namespaced_config_map,
                namespace,
                field_selector=f"metadata.name={name}",
                resource_version=cm.metadata.resource_version,
                timeout_seconds=30,
            ):
                if stop.is_set():
                    w.stop()
                    break
                if event["type"] in ("ADDED", "MODIFIED"):
                    text = document_from_configmap(event["object"])
                    if text is not None:
                        emit(text)
            backoff = 1.0
        except Exception as exc:
            log.warning("watching ConfigMap %s/%s: %s (retrying in %.0fs)", namespace, name, exc, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)
