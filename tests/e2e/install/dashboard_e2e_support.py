"""Helpers for the dashboard e2e test (a module of its own: test files cannot import each other or
conftests by name).

* :func:`podmonitor_scrape_configs`: a PodMonitor as Prometheus scrape jobs, modelled on what the
  Prometheus Operator generates (kubernetes_sd ``role: pod``; keep pods whose labels match the
  selector and whose container port has the endpoint's name, drop finished pods;
  ``namespace``/``pod``/``container``/``endpoint``/``job`` target labels; then the endpoint's own
  relabelings; ``honorLabels``, interval, path). No Prometheus Operator runs here; only the
  fields the chart's PodMonitors use are translated, anything else fails loudly.
* :func:`stop`: a helper process ended (terminate, then kill).
The real Prometheus the test runs is ``localcluster.prometheus.Prometheus``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PY = sys.executable

# PodMonitor endpoint fields this translation understands (the chart's monitors use no others).
_ENDPOINT_FIELDS = {"port", "path", "honorLabels", "interval", "scrapeTimeout", "relabelings"}
_RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
                 "regex": "regex", "replacement": "replacement", "action": "action", "modulus": "modulus"}


def _sanitize(label: str) -> str:
    """Kubernetes label name → the ``__meta_kubernetes_pod_label_<name>`` suffix Prometheus uses."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def podmonitor_scrape_configs(pm: Mapping[str, Any], *, kubeconfig: Path) -> list[dict[str, Any]]:
    meta, spec = pm["metadata"], pm["spec"]
    selector = spec["selector"]
    assert set(selector) <= {"matchLabels"}, f"untranslated selector fields: {selector}"
    nsel = spec.get("namespaceSelector") or {}
    sd: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
    if not nsel.get("any"):
        sd["namespaces"] = {"names": list(nsel.get("matchNames") or [meta["namespace"]])}
    jobs = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        assert set(ep) <= _ENDPOINT_FIELDS, f"untranslated endpoint fields: {set(ep) - _ENDPOINT_FIELDS}"
        relabel: list[dict[str, Any]] = []
        for key, value in selector.get("matchLabels", {}).items():
            name = _sanitize(key)
            relabel.append({"action": "keep", "regex": f"({re.escape(value)});true",
                            "source_labels": [f"__meta_kubernetes_pod_label_{name}",
                                              f"__meta_kubernetes_pod_labelpresent_{name}"]})
        relabel += [
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": ep["port"]},
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
            {"target_label": "endpoint", "replacement": ep["port"]},
        ]
        for r in ep.get("relabelings") or []:
            assert set(r) <= set(_RELABEL_KEYS), f"untranslated relabeling fields: {r}"
            relabel.append({_RELABEL_KEYS[k]: v for k, v in r.items()})
        job = {"job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{i}",
               "honor_labels": bool(ep.get("honorLabels", False)),
               "metrics_path": ep.get("path", "/metrics"),
               "kubernetes_sd_configs": [sd], "relabel_configs": relabel}
        if ep.get("interval"):
            job["scrape_interval"] = ep["interval"]
        if ep.get("scrapeTimeout"):
            job["scrape_timeout"] = ep["scrapeTimeout"]
        jobs.append(job)
    return jobs


def stop(proc: subprocess.Popen[Any], *, timeout_s: float = 20) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode
