"""The chart's PrometheusRule (``monitoring.prometheusRule``) through the real helm binary, its
alerts checked by a real Prometheus server.

* every alert reads only metric names the components register: the set is built from the source
  definitions (the prometheus_client constructors and ``*MetricFamily`` calls of the operator, the
  model server and the node agent, and the operator's rollout collector), and each expression is
  parsed by Prometheus itself (``/api/v1/parse_query``), so a renamed metric fails here;
* the rendered groups, written as a rules file, load into Prometheus (a bad expression makes it
  refuse the file: the start fails the test) and every rule evaluates with health ``ok``;
* on series that break every condition (a static exporter, and scrape jobs named as the chart's
  monitors name them that cannot be reached), every alert of the chart becomes active, with its
  object labels in the summary; with no series at all none is.

Fails (never skips) when helm or prometheus is missing: build them with
``dev/setup/binaries.sh helm prometheus``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from localcluster.ports import free_port
from localcluster.prometheus import Prometheus, exporter

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))
# Where each component defines its metrics.
SOURCES = (ROOT / "operator" / "sparsegate", ROOT / "workloads" / "sparsegate_workload", ROOT / "ebpf" / "sparsegate_ebpf")
ON = ("monitoring.prometheusRule.enabled=true",)
# Series Prometheus makes itself for every target.
SYNTHETIC = {"up"}


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


def prometheus_rule(*sets: str) -> dict:
    (rule,) = [d for d in render(*ON, *sets) if d["kind"] == "PrometheusRule"]
    return rule


def alerts(rule: dict) -> dict[str, dict]:
    found = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    by_name = {r["alert"]: r for r in found}
    assert len(by_name) == len(found), "an alert name is used twice"
    return by_name


# --- the metric names the components register -----------------------------------------------------

_CONSTRUCTORS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary",
                 "Info": "info", "Enum": "gauge", "CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge",
                 "HistogramMetricFamily": "histogram", "SummaryMetricFamily": "summary", "InfoMetricFamily": "info"}


def _sample_names(name: str, kind: str) -> set[str]:
    """The series names a metric of ``kind`` named ``name`` is exposed as (prometheus_client)."""
    if kind == "counter":
        base = name.removesuffix("_total")
        return {f"{base}_total", f"{base}_created"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
    if kind == "summary":
        return {name, f"{name}_sum", f"{name}_count", f"{name}_created"}
    if kind == "info":
        return {f"{name.removesuffix('_info')}_info"}
    return {name}


def defined_metrics() -> dict[str, str]:
    """Metric name → type of every metric the operator, the model server and the agent define with
    a literal name, and the operator's rollout gauges (named from a table)."""
    found: dict[str, str] = {}
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            if "tests" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                arg = node.args[0]
                if func in _CONSTRUCTORS and isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                        and arg.value.startswith(("sparsegate_", "vllm:")):
                    found[arg.value] = _CONSTRUCTORS[func]
    from sparsegate.metrics import ROLLOUT  # families built from a table at scrape time

    for family in ROLLOUT.describe():
        found[family.name] = family.type
    return found


def exported_series_names() -> set[str]:
    return {s for name, kind in defined_metrics().items() for s in _sample_names(name, kind)}


def test_the_metric_scan_finds_every_component():
    metrics = defined_metrics()
    # one of each component, of each shape (the scan reads constructors and metric families)
    assert metrics["sparsegate_operator_reconcile_errors_total"] == "counter"  # operator Counter
    assert metrics["sparsegate_rollout_phase"] == "gauge"  # operator collector table
    assert metrics["vllm:time_to_first_token_seconds"] == "histogram"  # model server
    assert metrics["sparsegate_xdp_map_pressure"] == "gauge"  # agent GaugeMetricFamily
    assert metrics["sparsegate_agent_policy_errors"] == "counter"  # agent CounterMetricFamily
    assert metrics["sparsegate_agent_attached_without_policy"] == "gauge"  # agent handover collector
    names = exported_series_names()
    assert {"sparsegate_agent_policy_errors_total", "vllm:time_to_first_token_seconds_bucket",
            "sparsegate_rollouts_total"} <= names
    assert len(metrics) >= 60


# --- a real Prometheus ----------------------------------------------------------------------------

def selected_metric_names(prom: Prometheus, expr: str) -> set[str]:
    """The metric names an expression's selectors name, as Prometheus parses it."""
    body = prom.get("/api/v1/parse_query", query=expr)
    assert body["status"] == "success", f"{expr}: {body.get('error')}"
    names: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for m in node.get("matchers") or []:
                if m["name"] == "__name__":
                    assert m["type"] == "=", f"{expr}: a metric name by regex cannot be checked"
                    names.add(m["value"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(body["data"])
    return names


@pytest.fixture(scope="module")
def parser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    prom = Prometheus(binary=BIN / "prometheus", work=tmp_path_factory.mktemp("parse"), config={"global": {}})
    try:
        yield prom
    finally:
        prom.stop()


# --- rendering ------------------------------------------------------------------------------------

def test_nothing_is_rendered_by_default():
    for sets in ((), ("monitoring.serviceMonitor.enabled=true", "monitoring.podMonitor.enabled=true",
                      "agent.enabled=true", "monitoring.prometheusRule.labels.release=kps")):
        assert not [d for d in render(*sets) if d["kind"] == "PrometheusRule"]


def test_one_prometheus_rule_with_the_labels_namespace_and_groups():
    rule = prometheus_rule("monitoring.labels.release=kps", "monitoring.labels.team=a",
                           "monitoring.prometheusRule.labels.release=other", "agent.enabled=true")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == "rel-sparsegate" and rule["metadata"]["namespace"] == "sg-system"
    labels = rule["metadata"]["labels"]
    assert labels["release"] == "other" and labels["team"] == "a"  # prometheusRule.labels win
    assert labels["app.kubernetes.io/instance"] == "rel"
    assert [g["name"] for g in rule["spec"]["groups"]] == [
        "sparsegate-operator", "sparsegate-rollouts", "sparsegate-model-server", "sparsegate-agent"]
    found = alerts(rule)
    assert len(found) == 19, sorted(found)
    for name, r in found.items():
        assert name.startswith("Sparsegate") and r["expr"].strip(), name
        assert r["labels"]["severity"] in {"critical", "warning"}, name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        assert "{{ $labels." in r["annotations"]["summary"], f"{name}: the summary names no object"
        assert r["for"], name
    elsewhere = prometheus_rule("monitoring.prometheusRule.namespace=monitoring")
    assert elsewhere["metadata"]["namespace"] == "monitoring"


def test_alert_switches_thresholds_and_additional_rules():
    base = alerts(prometheus_rule())
    assert "SparsegateAgentDown" not in base  # no agent without agent.enabled
    tuned = prometheus_rule("monitoring.prometheusRule.alerts.xdpMapPressure.threshold=0.75",
                            "monitoring.prometheusRule.alerts.xdpMapPressure.for=2m",
                            "monitoring.prometheusRule.alerts.xdpMapPressure.severity=page",
                            "monitoring.prometheusRule.alerts.rolloutRolledBack.enabled=false",
                            "monitoring.prometheusRule.additionalRules[0].alert=Custom",
                            "monitoring.prometheusRule.additionalRules[0].expr=vector(1)",
                            "monitoring.prometheusRule.additionalRules[1].record=sparsegate:x",
                            "monitoring.prometheusRule.additionalRules[1].expr=vector(2)")
    found = alerts(tuned)
    pressure = found["SparsegateXdpMapPressureHigh"]
    assert pressure["expr"].endswith("> 0.75") and pressure["for"] == "2m" and pressure["labels"]["severity"] == "page"
    assert "SparsegateRolloutRolledBack" not in found and "SparsegateRolloutFailed" in found
    (extra,) = [g for g in tuned["spec"]["groups"] if g["name"] == "sparsegate-additional"]
    assert extra["rules"] == [{"alert": "Custom", "expr": "vector(1)"}, {"record": "sparsegate:x", "expr": "vector(2)"}]
    # Every alert of a group off: the group is left out, not rendered empty.
    off = [f"monitoring.prometheusRule.alerts.{a}.enabled=false" for a in (
        "modelServerQueueFull", "modelServerErrors", "modelServerTimeToFirstTokenHigh", "modelServerAccessUnavailable")]
    assert "sparsegate-model-server" not in [g["name"] for g in prometheus_rule(*off)["spec"]["groups"]]
    # No metrics Service/port, no operator target to watch.
    assert "SparsegateOperatorDown" not in alerts(prometheus_rule("operator.metrics.enabled=false"))


@pytest.mark.parametrize(("bad", "field"), [
    ("monitoring.prometheusRule.alerts.rolloutFailed.for=30s5m", "for"),  # the CRD wants y w d h m s ms order
    ("monitoring.prometheusRule.alerts.xdpMapPressure.threshold=high", "threshold"),
    ("monitoring.prometheusRule.alerts.xdpMapPressure.threshold=2", "threshold"),  # a fraction
    ("monitoring.prometheusRule.alerts.noSuchAlert.enabled=true", "noSuchAlert"),
    ("monitoring.prometheusRule.namespace=Bad_NS", "namespace"),
])
def test_schema_rejects_bad_prometheus_rule_values(bad: str, field: str):
    proc = helm("template", "rel", str(CHART), *[a for s in (*ON, bad) for a in ("--set", s)], ok=False)
    assert proc.returncode != 0 and field in proc.stderr, proc.stderr


def test_an_empty_for_fires_at_once():
    rule = alerts(prometheus_rule("monitoring.prometheusRule.alerts.rolloutFailed.for="))["SparsegateRolloutFailed"]
    assert "for" not in rule


def test_the_down_alerts_select_the_jobs_of_the_chart_monitors():
    """The Prometheus Operator names a ServiceMonitor's job after the Service, a PodMonitor's
    <namespace>/<name>; the up{job} selectors must match what the chart's monitors give."""
    import re

    docs = render(*ON, "agent.enabled=true", "monitoring.serviceMonitor.enabled=true",
                  "monitoring.podMonitor.enabled=true", "monitoring.serviceMonitor.operator=false",
                  "monitoring.podMonitor.operator=true")
    found = alerts([d for d in docs if d["kind"] == "PrometheusRule"][0])
    (pattern,) = re.findall(r'up\{job=~"([^"]+)"\} == 0', found["SparsegateOperatorDown"]["expr"])
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-operator-metrics")]
    pms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    assert re.fullmatch(pattern, svc["metadata"]["name"])  # ServiceMonitor's job: the Service
    op = pms["rel-sparsegate-operator"]
    assert re.fullmatch(pattern, f"{op['metadata']['namespace']}/{op['metadata']['name']}")
    agent = pms["rel-sparsegate-agent"]
    assert found["SparsegateAgentDown"]["expr"] == f'up{{job="{agent["metadata"]["namespace"]}/{agent["metadata"]["name"]}"}} == 0'


# --- every alert reads metrics the code exports ---------------------------------------------------

def unknown_metrics(prom: Prometheus, expr: str, exported: set[str]) -> set[str]:
    return selected_metric_names(prom, expr) - exported - SYNTHETIC


def test_every_alert_reads_only_metrics_the_components_export(parser: Prometheus):
    exported = exported_series_names()
    found = alerts(prometheus_rule("agent.enabled=true"))
    unknown = {name: unknown_metrics(parser, r["expr"], exported) for name, r in found.items()}
    assert {name: u for name, u in unknown.items() if u} == {}
    # And each alert reads at least one metric of a component (not only `up`), except the down ones.
    for name, r in found.items():
        if not name.endswith("Down"):
            assert selected_metric_names(parser, r["expr"]) - SYNTHETIC, name


def test_a_renamed_metric_is_caught(parser: Prometheus):
    """The check above can fail: a misspelt or renamed metric is reported by name."""
    exported = exported_series_names()
    assert unknown_metrics(parser, "max by (map) (sparsegate_xdp_map_presure) > 0.9", exported) == {
        "sparsegate_xdp_map_presure"}
    assert unknown_metrics(parser, 'rate(vllm:time_to_first_token_seconds[5m])', exported) == {
        "vllm:time_to_first_token_seconds"}  # a histogram is exposed as _bucket/_sum/_count
    assert unknown_metrics(parser, "sparsegate_agent_policy_errors_total", exported) == set()


# --- loaded into Prometheus -----------------------------------------------------------------------

def rules_file(work: Path, rule: dict) -> Path:
    path = work / "sparsegate.rules.yml"
    path.write_text(json.dumps({"groups": rule["spec"]["groups"]}))  # JSON is YAML
    return path


def start_with_rules(work: Path, rule: dict, scrape_configs: list[dict] | None = None) -> Prometheus:
    return Prometheus(binary=BIN / "prometheus", work=work,
                      config={"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                              "rule_files": [str(rules_file(work, rule))],
                              "scrape_configs": scrape_configs or []})


def wait_evaluated(prom: Prometheus, expected: int) -> list[dict]:
    deadline = time.monotonic() + 30
    while True:
        rules = prom.rules()
        if len(rules) == expected and all(r["health"] != "unknown" and not r["lastEvaluation"].startswith("0001")
                                          for r in rules):
            return rules
        assert time.monotonic() < deadline, f"rules not all evaluated within 30 s: {rules}"
        time.sleep(0.3)


def every_rule(rule: dict) -> list[dict]:
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def test_every_rule_loads_and_evaluates_ok_and_none_fires_without_series(tmp_path: Path):
    rule = prometheus_rule("agent.enabled=true", "monitoring.prometheusRule.additionalRules[0].record=sparsegate:up",
                           "monitoring.prometheusRule.additionalRules[0].expr=sum(up)")
    prom = start_with_rules(tmp_path, rule)
    try:
        rules = wait_evaluated(prom, len(every_rule(rule)))
        assert {r["name"] for r in rules} == {r.get("alert") or r["record"] for r in every_rule(rule)}
        assert [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
        assert prom.alerts() == []  # quiet when nothing is wrong (here: nothing at all)
    finally:
        prom.stop()


def test_a_rules_file_with_a_bad_expression_is_refused(tmp_path: Path):
    """The load above can fail: Prometheus refuses to start on a rules file it cannot parse."""
    rule = prometheus_rule("monitoring.prometheusRule.additionalRules[0].alert=Broken",
                           "monitoring.prometheusRule.additionalRules[0].expr=sum by (x) (rate(up[5m])")
    with pytest.raises(AssertionError, match="prometheus exited"):
        start_with_rules(tmp_path, rule).stop()


# --- every alert becomes active on series that break its condition ------------------------------------

def _broken(elapsed: float) -> str:
    """What the operator (its own labels; GateConfig namespace by honor_labels), a model-server pod
    and a node agent would export were everything wrong; counters grow with ``elapsed``."""
    t = max(elapsed, 0.0) + 1
    op, model, agent = 'namespace="sg-system",pod="op-0"', 'namespace="ns",pod="m-0",model="m"', \
        'namespace="sg-system",pod="agent-1",node="n1"'
    lines = [
        f'sparsegate_operator_reconcile_errors_total{{{op},kind="SparseModel"}} {t}',
        f'sparsegate_operator_reconcile_errors_total{{{op},kind="GateConfig"}} 0',
        *(f'sparsegate_operator_reconcile_duration_seconds_bucket{{{op},kind="SparseModel",le="{le}"}} {n}'
          for le, n in (("60", 0), ("120", t), ("+Inf", t))),
        f'sparsegate_flow_policy_too_large{{{op}}} 1',
        f'sparsegate_opa_available{{{op}}} 0',
        f'sparsegate_access_pushes_total{{{op},result="ok"}} {t}',
        f'sparsegate_access_pushes_total{{{op},result="error"}} {t}',
        f'sparsegate_rollout_gate_pushes_total{{{op},result="ok"}} {t}',
        f'sparsegate_rollout_gate_pushes_total{{{op},result="error"}} {t}',
        'sparsegate_rollout_phase{namespace="ns",gateconfig="rb",phase="RolledBack"} 1',
        'sparsegate_rollout_phase{namespace="ns",gateconfig="rb",phase="Succeeded"} 0',
        'sparsegate_rollout_phase{namespace="ns",gateconfig="fl",phase="Failed"} 1',
        'sparsegate_rollout_phase{namespace="ns",gateconfig="st",phase="Progressing"} 1',
        'sparsegate_rollout_phase{namespace="ns",gateconfig="ok",phase="Succeeded"} 1',
        f'sparsegate_requests_total{{{model},code="200",gate_version="g-1"}} {10 * t}',
        f'sparsegate_requests_total{{{model},code="429",gate_version="g-1"}} {5 * t}',
        f'sparsegate_requests_total{{{model},code="503",gate_version="g-1"}} {5 * t}',
        *(f'vllm:time_to_first_token_seconds_bucket{{{model},model_name="m",le="{le}"}} {n}'
          for le, n in (("5.0", 0), ("10.0", t), ("+Inf", t))),
        f'sparsegate_request_access_total{{{model},result="no_rules",expert_group=""}} {t}',
        f'sparsegate_request_access_total{{{model},result="allowed",expert_group=""}} {t}',
        f'sparsegate_agent_bpf_available{{{agent}}} 0',
        f'sparsegate_agent_attached_without_policy{{{agent}}} 1',
        f'sparsegate_agent_policy_errors_total{{{agent}}} {t}',
        f'sparsegate_xdp_map_pressure{{{agent},map="flows"}} 0.95',
        f'sparsegate_xdp_map_pressure{{{agent},map="conntrack"}} 0.1',
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def broken_exporter() -> Iterator[str]:
    started = time.monotonic()
    with exporter(lambda: _broken(time.monotonic() - started)) as target:
        yield target


def test_every_alert_becomes_active_when_its_condition_holds(tmp_path: Path, broken_exporter: str):
    rule = prometheus_rule("agent.enabled=true")
    found = alerts(rule)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: up == 0
    jobs = [{"job_name": "components", "honor_labels": True, "static_configs": [{"targets": [broken_exporter]}]},
            # named as the chart's PodMonitors name their jobs (<namespace>/<name>)
            {"job_name": "sg-system/rel-sparsegate-operator", "static_configs": [
                {"targets": [dead], "labels": {"namespace": "sg-system", "pod": "op-0"}}]},
            {"job_name": "sg-system/rel-sparsegate-agent", "static_configs": [
                {"targets": [dead], "labels": {"namespace": "sg-system", "pod": "agent-1", "node": "n1"}}]}]
    prom = start_with_rules(tmp_path, rule, jobs)
    try:
        deadline = time.monotonic() + 60
        while True:
            active = prom.alerts()
            names = {a["labels"]["alertname"] for a in active}
            if names >= set(found):
                break
            rules = prom.rules()
            assert time.monotonic() < deadline, (
                f"never active: {sorted(set(found) - names)}; unhealthy: "
                f"{[(r['name'], r.get('lastError')) for r in rules if r['health'] != 'ok']}")
            time.sleep(0.5)
        assert [(r["name"], r.get("lastError")) for r in prom.rules() if r["health"] != "ok"] == []
    finally:
        prom.stop()
    assert names == set(found)
    by = {}
    for a in active:
        by.setdefault(a["labels"]["alertname"], []).append(a)
    assert all(a["state"] in {"pending", "firing"} for a in active)
    # One alert per broken object, with its labels in the summary.
    (pressure,) = by["SparsegateXdpMapPressureHigh"]
    assert pressure["labels"]["map"] == "flows" and pressure["labels"]["severity"] == "warning"
    assert pressure["annotations"]["summary"] == "sparsegate node agent on n1: XDP map flows nearly full"
    assert {a["labels"]["gateconfig"] for a in by["SparsegateRolloutRolledBack"]} == {"rb"}
    assert {a["labels"]["gateconfig"] for a in by["SparsegateRolloutFailed"]} == {"fl"}
    (stalled,) = by["SparsegateRolloutStalled"]
    assert stalled["annotations"]["summary"] == "GateConfig ns/st: rollout stalled in Progressing"
    assert {a["labels"]["kind"] for a in by["SparsegateReconcileErrors"]} == {"SparseModel"}
    (queue,) = by["SparsegateModelServerQueueFull"]
    assert queue["annotations"]["summary"] == "SparseModel ns/m: requests refused, queue full"
    assert float(queue["value"]) == pytest.approx(0.25, rel=0.05)
    (down,) = by["SparsegateOperatorDown"]
    assert down["labels"]["severity"] == "critical" and down["labels"]["pod"] == "op-0"
