"""The chart's monitoring templates (Grafana dashboard ConfigMap, ServiceMonitors, PodMonitors)
through the real helm binary, and every dashboard query parsed by a real Prometheus server (the
PrometheusRule's alerts: test_prometheus_rule.py).

Fails (never skips) when helm or prometheus is missing: build them with
``dev/setup/binaries.sh helm prometheus``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any
from pathlib import Path

import grafana_dashboard  # dev/ (pytest pythonpath)
import pytest
import yaml
from localcluster.prometheus import Prometheus, exporter

from sparsegate.domain import render as model_render
from sparsegate_contracts import names

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))

MONITOR_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
# Values a Grafana user would pick; $__rate_interval/$__range as Grafana computes them for 1 h.
VARIABLES = {"datasource": "prom", "namespace": "team-a", "gateconfig": "gate", "model": ".*",
             "__rate_interval": "1m", "__range": "1h"}


def helm(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def render(*sets: str) -> list[dict]:
    args = ["template", "rel", str(CHART), "--namespace", "sg-system"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def of_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_template(docs: list[dict], kind: str) -> dict:
    (obj,) = [d for d in docs if d["kind"] == kind]
    return obj["spec"]["template"]


def port_names(template: dict) -> set[str]:
    return {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}


# --- off by default ------------------------------------------------------------------------------

def test_nothing_is_rendered_by_default_or_with_the_switches_off():
    for sets in ((), ("monitoring.serviceMonitor.operator=true", "monitoring.podMonitor.agent=true",
                      "agent.enabled=true")):
        docs = render(*sets)
        assert not [d for d in docs if d["kind"] in MONITOR_KINDS]
        assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboards")]


# --- dashboard ConfigMap ------------------------------------------------------------------------

def dashboards_configmap(*sets: str) -> dict:
    (cm,) = [d for d in render("monitoring.dashboards.enabled=true", *sets)
             if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboards")]
    return cm


def test_dashboard_configmap_carries_the_sidecar_label_and_the_generated_json():
    cm = dashboards_configmap()
    assert cm["metadata"]["namespace"] == "sg-system"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(cm["data"]) == {"sparsegate.json"}
    assert json.loads(cm["data"]["sparsegate.json"]) == json.loads(grafana_dashboard.OUT.read_text())
    custom = dashboards_configmap("monitoring.dashboards.label=my_dash", "monitoring.dashboards.labelValue=yes",
                                  "monitoring.dashboards.namespace=grafana",
                                  "monitoring.dashboards.annotations.grafana_folder=sparsegate")
    assert custom["metadata"]["namespace"] == "grafana"
    assert custom["metadata"]["labels"]["my_dash"] == "yes" and "grafana_dashboard" not in custom["metadata"]["labels"]
    assert custom["metadata"]["annotations"] == {"grafana_folder": "sparsegate"}


def test_committed_dashboard_is_what_the_generator_writes():
    assert grafana_dashboard.main(["--check"]) == 0, "run: python dev/grafana_dashboard.py"


def test_dashboard_shape_variables_and_datasource():
    dash = json.loads(grafana_dashboard.OUT.read_text())
    assert dash["schemaVersion"] >= 39 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "gateconfig", "model"} <= set(variables)
    for name in ("namespace", "gateconfig", "model"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    titles = {p["title"] for p in dash["panels"]}
    assert {"Rollout phase", "Canary weight and share", "Error rate by role", "p99 latency by role",
            "Active experts per token by role", "XDP policy: allowed vs dropped packets", "Top allowed flows",
            "Reconciles by kind and outcome"} <= titles


# --- every query is valid PromQL, as a real Prometheus parses it ----------------------------------

@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from run_prometheus(tmp_path_factory.mktemp("promql"), {"global": {}})


def run_prometheus(work: Path, config: Mapping[str, Any]) -> Iterator[str]:
    prom = Prometheus(binary=BIN / "prometheus", work=work, config=config)
    try:
        yield prom.url
    finally:
        prom.stop()


def query_status(url: str, expr: str) -> tuple[str, str]:
    q = urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
    return body["status"], body.get("error", "")


def test_every_panel_query_is_valid_promql(prometheus: str):
    dash = json.loads(grafana_dashboard.OUT.read_text())
    queries = grafana_dashboard.panel_queries(dash)
    assert len(queries) >= 20
    bad = []
    for title, ref, expr in queries:
        concrete = grafana_dashboard.substitute(expr, VARIABLES)
        # Grafana variables left over ($name, ${name}); label_replace's "$1" is PromQL, not one.
        assert not re.search(r"\$\{?[A-Za-z_]", concrete), f"{title}/{ref}: unknown variable in {concrete}"
        status, error = query_status(prometheus, concrete)
        if status != "success":
            bad.append(f"{title}/{ref}: {error}")
    assert bad == []


def test_variable_queries_select_valid_series(prometheus: str):
    dash = json.loads(grafana_dashboard.OUT.read_text())
    for v in dash["templating"]["list"]:
        if v["type"] != "query":
            continue
        # label_values(<selector>, <label>) is Grafana's; its selector must be valid PromQL.
        inner = v["query"].removeprefix("label_values(").rsplit(",", 1)[0]
        status, error = query_status(prometheus, grafana_dashboard.substitute(inner, VARIABLES))
        assert status == "success", f"variable {v['name']}: {error}"


# --- what the canary-vs-stable panels compute, on series a real Prometheus scraped ------------------

def _exposition(elapsed: float) -> str:
    """Namespace ns: GateConfigs a (stable g-1, canary g-2; model ma) and b (stable g-1, the same
    params: the same content-addressed version; model mb). a's pods serve 10 requests/s of each
    version without errors; b's pod 100/s, half of them 5xx. As the operator (scraped with
    honor_labels) and the model pods (namespace, pod and model target labels) export them."""
    lines = []
    for gc, role, version in (("a", "stable", "g-1"), ("a", "canary", "g-2"), ("b", "stable", "g-1")):
        lines.append(f'sparsegate_rollout_version_info{{namespace="ns",gateconfig="{gc}",role="{role}",'
                     f'version="{version}"}} 1')
    for gc, model in (("a", "ma"), ("b", "mb")):
        lines.append(f'sparsegate_gateconfig_model_info{{namespace="ns",gateconfig="{gc}",model="{model}"}} 1')
    for pod, model, version, per_s, errors in (("ma-0", "ma", "g-1", 10, 0.0), ("ma-1", "ma", "g-2", 10, 0.0),
                                               ("mb-0", "mb", "g-1", 100, 0.5)):
        labels = f'namespace="ns",pod="{pod}",model="{model}",gate_version="{version}"'
        lines.append(f'sparsegate_requests_total{{{labels},code="200"}} {per_s * elapsed * (1 - errors)}')
        lines.append(f'sparsegate_requests_total{{{labels},code="500"}} {per_s * elapsed * errors}')
    # Inter-token latency: ma's pods make 10 tokens/s each, all 25-50 ms apart; mb's (GateConfig b)
    # 100/s, all 0.5-0.75 s apart (which a's panel must not show).
    for pod, model, per_s, upper in (("ma-0", "ma", 10, "0.05"), ("ma-1", "ma", 10, "0.05"), ("mb-0", "mb", 100, "0.75")):
        labels = f'namespace="ns",pod="{pod}",model="{model}",model_name="{model}"'
        for le in ("0.025", "0.05", "0.5", "0.75", "+Inf"):
            count = per_s * elapsed if float(le) >= float(upper) else 0
            lines.append(f'vllm:inter_token_latency_seconds_bucket{{{labels},le="{le}"}} {count}')
    # The agents' LRU maps on two nodes.
    for node, fills in (("n1", {"flows": 0.5, "conntrack": 0.1}), ("n2", {"flows": 0.95, "conntrack": 0.2})):
        for m, fill in fills.items():
            lines.append(f'sparsegate_xdp_map_pressure{{node="{node}",map="{m}"}} {fill}')
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def two_gateconfigs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    started = time.monotonic()
    with exporter(lambda: _exposition(time.monotonic() - started)) as target:
        config = {"global": {"scrape_interval": "1s"},
                  "scrape_configs": [{"job_name": "fleet", "honor_labels": True,
                                      "static_configs": [{"targets": [target]}]}]}
        for url in run_prometheus(tmp_path_factory.mktemp("scraped"), config):
            deadline = time.monotonic() + 60
            while not instant(url, "count_over_time(sparsegate_requests_total[1m]) >= 4"):
                assert time.monotonic() < deadline, "no four scrapes within 60 s"
                time.sleep(0.5)
            yield url


def instant(url: str, expr: str) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as resp:
        return json.loads(resp.read())["data"]["result"]


def test_canary_vs_stable_panels_keep_to_the_gateconfigs_own_models(two_gateconfigs: str):
    """Gate versions are content addresses: GateConfig b, with a's stable params, runs a's stable
    version. a's panels joined every series of that version in the namespace to a's roles, so b's
    traffic and errors showed as a's stable (error rate 0.45 where a's pods answer none)."""
    dash = json.loads(grafana_dashboard.OUT.read_text())
    values = {**VARIABLES, "namespace": "ns", "gateconfig": "a", "__rate_interval": "1m"}
    by_title = {title: expr for title, _, expr in grafana_dashboard.panel_queries(dash)}

    def by_role(title: str) -> dict[str, float]:
        result = instant(two_gateconfigs, grafana_dashboard.substitute(by_title[title], values))
        return {r["metric"]["role"]: float(r["value"][1]) for r in result}

    assert by_role("Error rate by role") == {"stable": 0.0, "canary": 0.0}
    served = by_role("Requests by role")
    assert set(served) == {"stable", "canary"}
    assert served["stable"] == pytest.approx(served["canary"], rel=0.05)  # 10/s each, not 110 vs 10
    # The SparseModel variable lists a's models only.
    (model_var,) = [v for v in dash["templating"]["list"] if v["name"] == "model"]
    inner = model_var["query"].removeprefix("label_values(").rsplit(",", 1)[0]
    assert {r["metric"]["model"] for r in instant(two_gateconfigs, grafana_dashboard.substitute(inner, values))} == {"ma"}


def test_token_latency_and_map_pressure_panels(two_gateconfigs: str):
    """The inter-token latency panel shows p50/p99 per SparseModel of the GateConfig (its series carry
    no gate version), and the map pressure panel each LRU map's fill on the fullest node."""
    dash = json.loads(grafana_dashboard.OUT.read_text())
    values = {**VARIABLES, "namespace": "ns", "gateconfig": "a", "__rate_interval": "1m"}
    queries = {(title, ref): expr for title, ref, expr in grafana_dashboard.panel_queries(dash)}

    def by(title: str, label: str, ref: str = "A") -> dict[str, float]:
        result = instant(two_gateconfigs, grafana_dashboard.substitute(queries[(title, ref)], values))
        return {r["metric"][label]: float(r["value"][1]) for r in result}

    assert by("Inter-token latency", "model", "A") == {"ma": pytest.approx(0.0375)}
    assert by("Inter-token latency", "model", "B") == {"ma": pytest.approx(0.04975)}
    assert {ref for title, ref in queries if title in ("Time to first token", "Time per output token (per request)")} \
        == {"A", "B"}
    assert by("XDP map pressure", "map") == {"flows": 0.95, "conntrack": 0.2}
    (pressure,) = [p for p in dash["panels"] if p["title"] == "XDP map pressure"]
    assert pressure["fieldConfig"]["defaults"]["unit"] == "percentunit"
    assert {"color": "red", "value": 0.9} in pressure["fieldConfig"]["defaults"]["thresholds"]["steps"]
    state = {t["expr"] for p in dash["panels"] if p["title"].startswith("Agents:") for t in p["targets"]}
    assert "sum(sparsegate_xdp_flows_idle_expired)" in state


def test_a_broken_query_is_refused(prometheus: str):
    """The check above can fail: Prometheus answers bad_data for a parse error."""
    assert query_status(prometheus, "sum by (role) (rate(x[1m])")[0] == "error"


# --- ServiceMonitors ----------------------------------------------------------------------------

def test_service_monitors_select_the_operator_service_and_the_model_services():
    docs = render("monitoring.serviceMonitor.enabled=true", "monitoring.labels.release=kps",
                  "monitoring.interval=15s")
    sms = of_kind(docs, "ServiceMonitor")
    assert set(sms) == {"rel-sparsegate-operator", "rel-sparsegate-models"}
    for sm in sms.values():
        assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["namespace"] == "sg-system"
        assert sm["metadata"]["labels"]["release"] == "kps"
        assert all(e["interval"] == "15s" and e["path"] == "/metrics" for e in sm["spec"]["endpoints"])

    op = sms["rel-sparsegate-operator"]
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-operator-metrics")]
    assert op["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert op["spec"]["namespaceSelector"] == {"matchNames": ["sg-system"]}
    (ep,) = op["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]} and ep["honorLabels"] is True

    models = sms["rel-sparsegate-models"]
    model = {"apiVersion": names.API_VERSION, "kind": "SparseModel",
             "metadata": {"name": "m", "namespace": "team-a", "uid": "u"}, "spec": {}}
    service = model_render.render_service(model)  # what the operator creates per SparseModel
    assert models["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (ep,) = models["spec"]["endpoints"]
    assert ep["port"] == service["spec"]["ports"][0]["name"] == model_render.PORT_NAME
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_sparsegate_dev_model"], "targetLabel": "model"} in ep["relabelings"]
    # Namespaced operator: the namespaces it serves; cluster-wide: all.
    assert models["spec"]["namespaceSelector"] == {"matchNames": ["sg-system"]}
    wide = of_kind(render("monitoring.serviceMonitor.enabled=true", "operator.clusterWide=true"), "ServiceMonitor")
    assert wide["rel-sparsegate-models"]["spec"]["namespaceSelector"] == {"any": True}
    listed = of_kind(render("monitoring.serviceMonitor.enabled=true", "operator.watchNamespaces={a,b}"),
                     "ServiceMonitor")
    assert listed["rel-sparsegate-models"]["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
    # No metrics Service, no operator ServiceMonitor.
    off = of_kind(render("monitoring.serviceMonitor.enabled=true", "operator.metrics.enabled=false"), "ServiceMonitor")
    assert set(off) == {"rel-sparsegate-models"}


# --- PodMonitors --------------------------------------------------------------------------------

def test_pod_monitors_select_the_operator_model_and_agent_pods_by_their_labels_and_ports():
    docs = render("monitoring.podMonitor.enabled=true", "monitoring.podMonitor.operator=true",
                  "monitoring.podMonitor.models=true", "agent.enabled=true", "monitoring.scrapeTimeout=5s")
    pms = of_kind(docs, "PodMonitor")
    assert set(pms) == {"rel-sparsegate-operator", "rel-sparsegate-models", "rel-sparsegate-agent"}
    for pm in pms.values():
        assert pm["apiVersion"] == "monitoring.coreos.com/v1"
        assert all(e["scrapeTimeout"] == "5s" and e["interval"] == "30s" for e in pm["spec"]["podMetricsEndpoints"])

    for name, kind in (("rel-sparsegate-operator", "Deployment"), ("rel-sparsegate-agent", "DaemonSet")):
        template = pod_template(docs, kind)
        pm = pms[name]
        assert pm["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), name
        (ep,) = pm["spec"]["podMetricsEndpoints"]
        assert ep["port"] in port_names(template), name
        assert pm["spec"]["namespaceSelector"] == {"matchNames": ["sg-system"]}
    assert pms["rel-sparsegate-operator"]["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True

    models = pms["rel-sparsegate-models"]
    model = {"apiVersion": names.API_VERSION, "kind": "SparseModel",
             "metadata": {"name": "m", "namespace": "team-a", "uid": "u"}, "spec": {}}
    labels = model_render.common_labels("m")  # what the operator puts on model-server pods
    assert models["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels[names.MODEL_LABEL] == "m"  # relabelled to `model` below
    (ep,) = models["spec"]["podMetricsEndpoints"]
    assert ep["port"] == model_render.PORT_NAME and model_render.serving_port(model) == model_render.DEFAULT_PORT
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_sparsegate_dev_model"], "targetLabel": "model"} in ep["relabelings"]


def test_pod_monitor_defaults_cover_the_agent_only_and_only_when_it_runs():
    assert set(of_kind(render("monitoring.podMonitor.enabled=true"), "PodMonitor")) == set()
    assert set(of_kind(render("monitoring.podMonitor.enabled=true", "agent.enabled=true"), "PodMonitor")) == {
        "rel-sparsegate-agent"}
    both = render("monitoring.podMonitor.enabled=true", "monitoring.serviceMonitor.enabled=true", "agent.enabled=true")
    assert set(of_kind(both, "PodMonitor")) == {"rel-sparsegate-agent"}
    assert set(of_kind(both, "ServiceMonitor")) == {"rel-sparsegate-operator", "rel-sparsegate-models"}


def test_a_target_on_in_both_monitor_kinds_is_refused_naming_the_fields():
    proc = helm("template", "rel", str(CHART), "--set", "monitoring.serviceMonitor.enabled=true",
                "--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.podMonitor.models=true", ok=False)
    assert proc.returncode != 0
    assert "monitoring.serviceMonitor.models and monitoring.podMonitor.models" in proc.stderr


@pytest.mark.parametrize(("interval", "timeout", "refused"), [
    ("30s", "45s", True), ("59m59s", "1h", True), ("1s", "1001ms", True),
    ("30s", "30s", False), ("1m30s", "90s", False), ("30s", "29s999ms", False), ("", "45s", False),
])
def test_a_scrape_timeout_longer_than_the_interval_is_refused(interval: str, timeout: str, refused: bool):
    """Prometheus refuses such a scrape config ("scrape timeout greater than scrape interval") and
    the Prometheus Operator skips the monitor: the render used to pass, and nothing was scraped.
    With the interval empty (Prometheus' own) nothing can be compared."""
    proc = helm("template", "rel", str(CHART), "--set", "monitoring.serviceMonitor.enabled=true",
                "--set", f"monitoring.interval={interval}", "--set", f"monitoring.scrapeTimeout={timeout}", ok=False)
    if refused:
        assert proc.returncode != 0, "rendered"
        assert f"monitoring.scrapeTimeout ({timeout}) is longer than monitoring.interval ({interval})" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("bad,field", [
    ("monitoring.interval=soon", "interval"),
    ("monitoring.podMonitor.everything=true", "everything"),
    ("monitoring.dashboards.label=", "label"),
])
def test_schema_rejects_bad_monitoring_values(bad: str, field: str):
    proc = helm("template", "rel", str(CHART), "--set", bad, ok=False)
    assert proc.returncode != 0 and field in proc.stderr, proc.stderr


def test_the_monitoring_scenario_renders_every_kind():
    """ci/monitoring-values.yaml (linted with every scenario by test_helm_chart.py)."""
    out = helm("template", "rel", str(CHART), "-f", str(CHART / "ci" / "monitoring-values.yaml")).stdout
    kinds = [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out) if d]
    assert {("ServiceMonitor", "rel-sparsegate-operator"), ("ServiceMonitor", "rel-sparsegate-models"),
            ("PodMonitor", "rel-sparsegate-agent"), ("ConfigMap", "rel-sparsegate-dashboards"),
            ("PrometheusRule", "rel-sparsegate")} <= set(kinds)
