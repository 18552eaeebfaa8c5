"""This node's probe configuration (from TelemetryProbes) in, this node's attach report out.

Contract: ``sparsegate_contracts.probes``. The configuration comes from the operator's ConfigMap
(watched; key = node name) or, for tests and hosts without Kubernetes, a JSON file holding the same
map (node -> document), polled. Each source calls ``on_config(config)`` with the node's
``NodeConfig``, or None when no probe selects the node (no key, no ConfigMap, no file): the agent
then attaches to its own ``--interfaces``. An invalid document is logged and ignored (the agent
keeps what it has). The report goes to the report ConfigMap (a merge patch of this node's key only,
so agents never overwrite each other) or to a file.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sparsegate_contracts.probes import NodeConfig, NodeReport, ProbeDocumentError, parse_node_config, report_text

log = logging.getLogger(__name__)

OnConfig = Callable[[NodeConfig | None], None]
_ABSENT = ""  # dedup marker for "no configuration for this node"


class _Follow:
    """Parse and forward the node's document when its text changed; invalid ones are dropped."""

    def __init__(self, on_config: OnConfig) -> None:
        self._on_config = on_config
        self._last: str | None = None
        self.errors = 0

    def __call__(self, text: str | None) -> None:
        text = text or _ABSENT
        if text == self._last:
            return
        self._last = text
        if text == _ABSENT:
            self._on_config(None)
            return
        try:
            config = parse_node_config(text)
        except ProbeDocumentError as exc:
            self.errors += 1
            log.error("rejected the probe configuration for this node (keeping the current one): %s", exc)
            return
        self._on_config(config)


def node_text(data: Mapping[str, Any] | None, node: str) -> str | None:
    """This node's document text from a ConfigMap's data (or the file's map); None when absent."""
    value = (data or {}).get(node)
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)  # the file may hold the document as an object


def _kube_client(api_client: Any) -> Any:
    from kubernetes import client, config  # only the ConfigMap source and sink need the client

    if api_client is None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    return client.CoreV1Api(api_client)


def watch_configmap(*, namespace: str, name: str, node: str, on_config: OnConfig, stop: threading.Event,
                    api_client: Any = None) -> None:
    """Read, then watch, the configuration ConfigMap; a missing one means no probe config (None)."""
    from kubernetes import watch
    from kubernetes.client import ApiException

    api = _kube_client(api_client)
    follow = _Follow(on_config)
    backoff = 1.0
    while not stop.is_set():
        try:
            try:
                cm = api.read_namespaced_config_map(name, namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                follow(None)  # no probe anywhere yet: the agent's own --interfaces
                stop.wait(5.0)
                continue
            follow(node_text(cm.data, node))
            w = watch.Watch()
            for event in w.stream(api.list_namespaced_config_map, namespace, field_selector=f"metadata.name={name}",
                                  resource_version=cm.metadata.resource_version, timeout_seconds=30):
                if stop.is_set():
                    w.stop()
                    break
                if event["type"] in ("ADDED", "MODIFIED"):
                    follow(node_text(event["object"].data, node))
                elif event["type"] == "DELETED":
                    follow(None)
            backoff = 1.0
        except Exception as exc:
            log.warning("watching probe ConfigMap %s/%s: %s (retrying in %.0fs)", namespace, name, exc, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, 30.0)


def watch_file(*, path: Path, node: str, on_config: OnConfig, stop: threading.Event, interval: float = 1.0) -> None:
    """Poll a JSON file holding {node: document}; a missing file means no probe config (None)."""
    follow = _Follow(on_config)
    while not stop.is_set():
        try:
            data = json.loads(path.read_text())
            follow(node_text(data if isinstance(data, dict) else None, node))
        except FileNotFoundError:
            follow(None)
        except ValueError as exc:
            log.error("probe file %s is not JSON (keeping the current configuration): %s", path, exc)
        stop.wait(interval)


ReportSink = Callable[[NodeReport], None]


def configmap_sink(*, namespace: str, name: str, api_client: Any = None) -> ReportSink:
    """Merge-patch this node's key of the report ConfigMap (RBAC: patch on that one name)."""
    api = _kube_client(api_client)

    def write(report: NodeReport) -> None:
        api.patch_namespaced_config_map(name, namespace, {"data": {report.node: report_text(report)}})

    return write


def file_sink(path: Path) -> ReportSink:
    """Write the report as {node: report} to ``path`` (replaced atomically)."""

    def write(report: NodeReport) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({report.node: report.to_json()}, sort_keys=True))
        os.replace(tmp, path)

    return write
