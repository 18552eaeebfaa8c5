"""Helpers for the dashboard e2e test (a module of its own: test files cannot import each other or
conftests by name).

* :func:`podmonitor_scrape_configs`: a PodMonitor as Prometheus scrape jobs, modelled on what the
  Prometheus Operator generates (kubernetes_sd ``role: pod``; keep pods whose labels match the
  selector and whose container port has the endpoint's name, drop finished pods;
  ``namespace``/``pod``/``container``/``endpoint``/``job`` target labels; then the endpoint's own
  relabelings; ``honorLabels``, interval, path). No Prometheus Operator runs here; only the
  fields the chart's PodMonitors use are translated, anything else fails loudly.
* :class:`Prometheus`: the real ``prometheus`` binary with a config the test writes (scrape jobs,
  and the chart's PrometheusRule groups as a rules file): queries, targets, rules and alerts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
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


class Prometheus:
    """A real Prometheus server with ``config``; ``query`` answers instant vectors."""

    def __init__(self, *, binary: Path, work: Path, config: Mapping[str, Any], port: int) -> None:
        assert binary.is_file(), (f"the real prometheus binary is required at {binary}; run: "
                                  "source dev/env.sh && bash dev/setup/binaries.sh prometheus")
        (work / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.log = work / "prometheus.log"
        self.url = f"http://127.0.0.1:{port}"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(binary), f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"prometheus exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"prometheus not ready: {self.log.read_text()[-2000:]}"
                time.sleep(0.2)

    def _get(self, path: str, **params: str) -> dict[str, Any]:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}" if params else f"{self.url}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self._get("/api/v1/query", query=expr)
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        return body["data"]["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/targets", state="active")["data"]["activeTargets"]

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule (``/api/v1/rules``), each with its group's name as ``group``."""
        body = self._get("/api/v1/rules")
        assert body["status"] == "success", body
        return [dict(r, group=g["name"]) for g in body["data"]["groups"] for r in g["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts (``/api/v1/alerts``)."""
        body = self._get("/api/v1/alerts")
        assert body["status"] == "success", body
        return body["data"]["alerts"]

    def stop(self) -> None:
        stop(self.proc)
