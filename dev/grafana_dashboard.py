"""Generate the chart's Grafana dashboard (``charts/sparsegate/dashboards/sparsegate.json``).

``python dev/grafana_dashboard.py`` rewrites the JSON; ``--check`` exits 1 when it is stale (a
unit test runs it). Panels are written here once, as Python, so the PromQL joins that turn
per-pod metrics into canary-vs-stable series are defined in one place.

Every query uses only series the code exports today:

* operator (``operator/sparsegate/metrics.py``, ``controllers/rollout.py``): reconciles, errors
  and durations by kind; rollout ticks, gate pushes, finished rollouts, step durations; and the
  ``sparsegate_rollout_*`` gauges derived from each GateConfig's status, and
  ``sparsegate_gateconfig_model_info`` (the GateConfig each SparseModel names);
* model servers (``workloads/sparsegate_workload/metrics.py``): ``sparsegate_requests_total``,
  ``sparsegate_request_duration_seconds``, ``sparsegate_tokens_total``,
  ``sparsegate_expert_assignments_total``, ``sparsegate_expert_tokens_total``,
  ``sparsegate_gate_config_info`` (the gate version each pod runs) and, from
  ``workloads/sparsegate_workload/quality.py``, ``sparsegate_quality_{nll,tokens}_total`` and
  ``sparsegate_probe_perplexity``; vLLM's token latency histograms
  ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` and
  ``vllm:request_time_per_output_token_seconds`` (labelled ``model_name``, not by gate version, so
  shown per SparseModel, not by role);
* node agent (``ebpf/sparsegate_ebpf/metrics.py``): XDP packet counters, per-flow counters,
  policy verdicts, attachment and policy state, and the fill of its LRU maps
  (``sparsegate_xdp_map_pressure{map}``, as Cilium's ``cilium_bpf_map_pressure``).

Canary vs stable: a model server reports its gate version (``sparsegate_gate_config_info``), and
the operator reports which version is the GateConfig's stable and which its canary
(``sparsegate_rollout_version_info``). Request, latency, token and assignment series carry the
gate version that served each request as ``gate_version`` (with a request-level canary one pod
serves both versions), relabelled ``version`` and joined on ``(namespace, version)`` to get
``role``; the per-expert series, which no version owns, give each pod's layer count. Every
model-server series is first kept to the GateConfig's models (``sparsegate_gateconfig_model_info``,
from each SparseModel's ``spec.gateConfigRef``): versions are content addresses, so two GateConfigs
with the same params share one. The joins expect the ``namespace`` and
``pod`` target labels that the chart's PodMonitor/ServiceMonitor (and any kubernetes_sd set-up)
attach, the model pods' ``model`` label (the chart's monitors relabel the pod label
``sparsegate.dev/model`` to it), and the operator scraped with ``honor_labels`` (its rollout gauges carry the
GateConfig's ``namespace``). Quality series (``sparsegate_quality_*_total``,
``sparsegate_probe_perplexity``) carry the serving gate version as ``gate_version`` and join the
role on it directly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "charts" / "sparsegate" / "dashboards" / "sparsegate.json"
SCHEMA_VERSION = 41  # Grafana 12; newer Grafana migrates it on load
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"

GC = 'namespace="$namespace", gateconfig="$gateconfig"'
MODEL = 'namespace="$namespace", model=~"$model"'
# The join from a series' gate version to its role. The right side is reduced with `max by` first
# so a target scraped twice (two monitors, two Prometheus jobs) cannot make the match many-to-many.
ROLE_OF_VERSION = ('* on (namespace, version) group_left (role) '
                   f'max by (namespace, version, role) (sparsegate_rollout_version_info{{{GC}}})')
# Versions are content addresses: two GateConfigs of a namespace with the same params share a version
# id, so a series joins the role only once its model is one of this GateConfig's (the operator's
# sparsegate_gateconfig_model_info, from each SparseModel's spec.gateConfigRef).
OF_GATECONFIG = ('* on (namespace, model) group_left () '
                 f'max by (namespace, model) (sparsegate_gateconfig_model_info{{{GC}}})')


def of_gateconfig(expr: str) -> str:
    """``expr`` (model-server series, labelled ``model``) kept to the GateConfig's models."""
    return f"({expr} {OF_GATECONFIG})"


def by_role_of_serving_version(metric_selector: str, *, extra_by: str = "") -> str:
    """``rate(metric[…])`` of series labelled with the serving ``gate_version`` (relabelled
    ``version``), summed per version, labelled with its ``role`` and summed by role."""
    by = f"role, {extra_by}" if extra_by else "role"
    inner_by = f"namespace, version, {extra_by}" if extra_by else "namespace, version"
    return (f"sum by ({by}) (\n"
            f"  sum by ({inner_by}) (\n"
            f'    label_replace({of_gateconfig(f"rate({metric_selector}[{RATE}])")}, "version", "$1", "gate_version", "(.+)")\n'
            f"  )\n"
            f"  {ROLE_OF_VERSION}\n"
            f")")


REQUESTS = by_role_of_serving_version(f"sparsegate_requests_total{{{MODEL}}}")
ERRORS = by_role_of_serving_version(f'sparsegate_requests_total{{{MODEL}, code=~"5.."}}')
LATENCY_BUCKETS = by_role_of_serving_version(f"sparsegate_request_duration_seconds_bucket{{{MODEL}}}",
                                             extra_by="le")
ASSIGNMENTS = by_role_of_serving_version(f"sparsegate_expert_assignments_total{{{MODEL}}}")
# Tokens (per serving version) × layers of the pod that routed them: layers = distinct `layer`
# labels of the pod's per-expert counter.
TOKEN_LAYERS = (
    "sum by (role) (\n"
    "  sum by (namespace, version) (\n"
    "    label_replace(\n"
    f"      sum by (namespace, pod, gate_version) {of_gateconfig(f'rate(sparsegate_tokens_total{{{MODEL}}}[{RATE}])')}\n"
    "      * on (namespace, pod) group_left count by (namespace, pod) (\n"
    f"        count by (namespace, pod, layer) (sparsegate_expert_tokens_total{{{MODEL}}})\n"
    "      ),\n"
    '      "version", "$1", "gate_version", "(.+)")\n'
    "  )\n"
    f"  {ROLE_OF_VERSION}\n"
    ")")


# Quality series carry the gate version that served them as `gate_version` (per request, not per
# pod): relabelled `version`, they join the role directly.
def by_role_of_gate_version(expr: str, *, agg: str = "sum") -> str:
    return (f"{agg} by (role) (\n"
            f"  {agg} by (namespace, version) (\n"
            f'    label_replace({of_gateconfig(expr)}, "version", "$1", "gate_version", "(.+)")\n'
            f"  )\n"
            f"  {ROLE_OF_VERSION}\n"
            f")")


QUALITY_NLL = by_role_of_gate_version(f"rate(sparsegate_quality_nll_total{{{MODEL}}}[{RATE}])")
QUALITY_TOKENS = by_role_of_gate_version(f"rate(sparsegate_quality_tokens_total{{{MODEL}}}[{RATE}])")
PROBE_PERPLEXITY = by_role_of_gate_version(f"sparsegate_probe_perplexity{{{MODEL}}}", agg="avg")

def target(expr: str, legend: str, ref: str = "A", **extra: Any) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, **extra}


def panel(title: str, kind: str, targets: list[dict[str, Any]], *, unit: str = "short", description: str,
          w: int = 12, h: int = 8, **extra: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"type": kind, "title": title, "description": description, "datasource": DS,
                         "gridPos": {"w": w, "h": h},
                         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                         "targets": targets}
    if kind == "timeseries":
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}
    p.update(extra)
    return p


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def quantile_by_model(q: float, histogram: str) -> str:
    """The ``q`` quantile of a model-server histogram (``histogram``: its name without ``_bucket``) per
    SparseModel (``model``), over the GateConfig's models."""
    rate = f"rate({histogram}_bucket{{{MODEL}}}[{RATE}])"
    return f"histogram_quantile({q}, sum by (model, le) (\n  {of_gateconfig(rate)}\n))"


def rollout_panels() -> list[dict[str, Any]]:
    phase = panel(
        "Rollout phase", "state-timeline",
        [target(f"max by (phase) (sparsegate_rollout_phase{{{GC}}})", "{{phase}}")],
        description="status.rollout.phase of the GateConfig over time (1 = the phase it was in).",
        w=24, h=7,
        options={"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                 "legend": {"showLegend": False}},
    )
    phase["fieldConfig"]["defaults"].update({
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "transparent", "value": None},
                                                     {"color": "blue", "value": 1}]},
        "mappings": [{"type": "value", "options": {"0": {"text": "-"}, "1": {"text": "current"}}}],
    })
    share = panel(
        "Canary weight and share", "timeseries",
        [target(f"sparsegate_rollout_canary_percent{{{GC}}}", "step target %", "A"),
         target(f'100 * sparsegate_rollout_pods{{{GC}, role="canary"}}\n'
                f"  / ignoring (role) sum without (role) (sparsegate_rollout_pods{{{GC}}})",
                "pods reporting the canary %", "B"),
         target(f"100 * {REQUESTS}\n  / ignoring (role) group_left () sum ({REQUESTS})",
                "requests served by {{role}} %", "C")],
        unit="percent", w=12,
        description="The current step's target (status.rollout.canaryPercent), the share of pods that "
                    "reported the canary version at the operator's last check, and the share of "
                    "requests served by each version's pods.",
    )
    steps = panel(
        "Step and instances", "timeseries",
        [target(f"sparsegate_rollout_step{{{GC}}}", "step", "A"),
         target(f"sparsegate_rollout_steps{{{GC}}}", "steps", "B"),
         target(f"sparsegate_rollout_canary_instances{{{GC}}}", "canary instances", "C"),
         target(f"sparsegate_rollout_instances{{{GC}}}", "instances", "D")],
        w=12, description="Current step (0: no canary in flight), the number of steps, and instances "
                          "assigned the canary out of all instances (status.rollout.canaryInstances).",
    )
    pods = panel(
        "Pods by reported version", "timeseries",
        [target(f"sum by (role) (sparsegate_rollout_pods{{{GC}}})", "{{role}}")],
        w=12, description="Pods whose reported gate version is the stable one, the canary, or neither "
                          "(status.rollout.podVersions at the operator's last check).",
        fieldConfig={"defaults": {"unit": "short", "custom": {"stacking": {"mode": "normal"}, "fillOpacity": 30}},
                     "overrides": []},
    )
    versions = panel(
        "Gate versions", "table",
        [target(f"max by (role, version) (sparsegate_rollout_version_info{{{GC}}})", "", format="table",
                instant=True)],
        w=12, description="The stable gate version and, while a rollout is in flight, the canary version.",
        transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}],
    )
    return [phase, share, steps, pods, versions]


def canary_panels() -> list[dict[str, Any]]:
    errors = panel(
        "Error rate by role", "timeseries",
        [target(f"(\n{ERRORS}\nor\n0 * {REQUESTS}\n)\n/\n{REQUESTS}", "{{role}}")],
        unit="percentunit",
        description="Share of inference requests answered with 5xx, canary vs stable version "
                    "(sparsegate_requests_total by code; 0 where a role had no errors).",
    )
    p99 = panel(
        "p99 latency by role", "timeseries",
        [target(f"histogram_quantile(0.99,\n{LATENCY_BUCKETS}\n)", "{{role}}")],
        unit="s", description="p99 of sparsegate_request_duration_seconds, canary vs stable version.",
    )
    experts = panel(
        "Active experts per token by role", "timeseries",
        [target(f"{ASSIGNMENTS}\n/\n{TOKEN_LAYERS}", "{{role}}")],
        description="Kept (token, expert) assignments per token per layer, canary vs stable: "
                    "sparsegate_expert_assignments_total / (sparsegate_tokens_total x layers), the "
                    "measure the rollout analysis compares for drift.",
    )
    quality = panel(
        "Quality: prompt NLL per token by role", "timeseries",
        [target(f"{QUALITY_NLL}\n/\n{QUALITY_TOKENS}", "live prompts, {{role}}", "A")],
        description="How well each version's model predicts the prompts it serves: mean negative "
                    "log-likelihood per scored prompt token, in nats (sparsegate_quality_nll_total / "
                    "sparsegate_quality_tokens_total by the gate version that served them); lower is better.",
    )
    probe = panel(
        "Quality: probe-set perplexity by role", "timeseries",
        [target(PROBE_PERPLEXITY, "{{role}}")],
        description="Perplexity of the fixed probe set each pod scores when a gate version is installed "
                    "(sparsegate_probe_perplexity), averaged over the pods of each role; the same tokens "
                    "for canary and stable, so a difference is the gate's doing. The rollout's "
                    "qualityDrop check compares these.",
    )
    qps = panel(
        "Requests by role", "timeseries",
        [target(REQUESTS, "{{role}}")], unit="reqps",
        description="Inference requests per second served by the canary and the stable version.",
    )
    return [errors, p99, experts, qps, quality, probe]


def token_latency_panels() -> list[dict[str, Any]]:
    def quantiles(histogram: str) -> list[dict[str, Any]]:
        return [target(quantile_by_model(0.5, histogram), "p50 {{model}}", "A"),
                target(quantile_by_model(0.99, histogram), "p99 {{model}}", "B")]

    return [
        panel("Time to first token", "timeseries", quantiles("vllm:time_to_first_token_seconds"),
              unit="s", w=8,
              description="p50 and p99 of vllm:time_to_first_token_seconds per SparseModel: OpenAI API "
                          "requests, from arrival (queueing included) to the first generated token."),
        panel("Inter-token latency", "timeseries", quantiles("vllm:inter_token_latency_seconds"),
              unit="s", w=8,
              description="p50 and p99 of vllm:inter_token_latency_seconds per SparseModel: the time "
                          "between two consecutive generated tokens of an OpenAI API request. The series "
                          "carry no gate version, so canary and stable pods are not told apart here."),
        panel("Time per output token (per request)", "timeseries",
              quantiles("vllm:request_time_per_output_token_seconds"), unit="s", w=8,
              description="p50 and p99 of vllm:request_time_per_output_token_seconds per SparseModel: "
                          "per finished generation, first to last token over its tokens after the first."),
    ]


def agent_panels() -> list[dict[str, Any]]:
    # Packet types of ebpf/sparsegate_ebpf/maps.py Counter that say how the flow policy treated a
    # packet (ebpf/README.md: scoped, stateful policy).
    verdict_types = ("policy_allow|policy_deny|audit_deny|allowed_source|dns|ct_reply|tcp_untracked|"
                     "unpoliced|no_policy|overlay")
    verdict = panel(
        "XDP policy: allowed vs dropped packets", "timeseries",
        [target(f'sum by (type) (rate(sparsegate_xdp_packets_total{{type=~"{verdict_types}"}}[{RATE}]))',
                "{{type}}")],
        unit="pps", description="How the node agents' XDP program treated packets: passed by an allow entry "
                                "(policy_allow), dropped (policy_deny), denied but passed in audit mode "
                                "(audit_deny), passed before the allow-list (allowed_source, dns, ct_reply "
                                "for replies of tracked flows, tcp_untracked), to destinations no policy "
                                "names (unpoliced), with no policy loaded (no_policy), or overlay "
                                "(VXLAN/Geneve) UDP passed with its inner packet not policed (overlay).",
    )
    rules = panel(
        "XDP verdicts by rule", "timeseries",
        [target(f"sum by (rule, action) (rate(sparsegate_xdp_policy_verdicts_total[{RATE}]))", "{{action}} {{rule}}")],
        unit="pps", description="Packets judged per flow-policy rule (RoutingPolicy entry or the default) and action.",
    )
    # Cumulative per-flow counters, not rates: a flow entry lives in an LRU table and short flows
    # (a new source port per connection) never get the second sample a rate needs.
    flows = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
             "orientation": "horizontal", "displayMode": "basic", "showUnfilled": True}
    dropped = panel(
        "Top dropped flows", "bargauge",
        [target("topk(10, sum by (src, dst, dport, proto) (sparsegate_xdp_flow_dropped_packets_total) > 0)",
                "{{src}} → {{dst}}:{{dport}}/{{proto}}", instant=True)],
        description="The 10 flows (IPv4 or IPv6) in the agents' flow tables with the most packets dropped by "
                    "policy, since each flow entered the table.", options=flows,
    )
    allowed = panel(
        "Top allowed flows", "bargauge",
        [target("topk(10, sum by (src, dst, dport, proto) (\n"
                "  sparsegate_xdp_flow_packets_total - sparsegate_xdp_flow_dropped_packets_total\n) > 0)",
                "{{src}} → {{dst}}:{{dport}}/{{proto}}", instant=True)],
        description="The 10 flows (IPv4 or IPv6) in the agents' flow tables with the most packets passed, since "
                    "each flow entered the table.", options=flows,
    )
    state = panel(
        "Agents: XDP attached, flows tracked, policy", "timeseries",
        [target("sum(sparsegate_xdp_attached)", "interfaces with XDP attached", "A"),
         target("sum(sparsegate_agent_bpf_available)", "agents with the program loaded", "B"),
         target("sum(sparsegate_xdp_flows_tracked)", "flows tracked", "C"),
         target("max(sparsegate_xdp_policy_generation)", "policy generation (max)", "D"),
         target(f"sum(increase(sparsegate_agent_policy_errors_total[{RATE}]))", "rejected policy documents", "E"),
         target("sum by (mode) (sparsegate_xdp_enforcement)", "agents in {{mode}} mode", "F"),
         target("sum(sparsegate_xdp_flows_idle_expired)", "flows idle past --flow-idle-timeout (not exported)",
                "G")],
        w=12, description="Attachment, flow table, policy and enforcement mode (off, audit, enforce) "
                          "of the node agents, and the flows still in the table but idle past the "
                          "agent's --flow-idle-timeout (no longer exported per flow).",
    )
    pressure = panel(
        "XDP map pressure", "timeseries",
        [target("max by (map) (sparsegate_xdp_map_pressure)", "{{map}} (fullest node)")],
        unit="percentunit", w=12,
        description="Fill of the agents' LRU maps (flows, flows6, handshakes, conntrack): entries / "
                    "max_entries on the fullest node (sparsegate_xdp_map_pressure, as Cilium's "
                    "cilium_bpf_map_pressure). Near 1 the kernel evicts the least recently used entries: "
                    "flows then lose their counts and conntrack its replies (the kernel's LRU starts "
                    "evicting before 1.0: its free lists are per CPU).",
        fieldConfig={"defaults": {"unit": "percentunit", "min": 0, "max": 1,
                                  "custom": {"thresholdsStyle": {"mode": "line"}},
                                  "thresholds": {"mode": "absolute",
                                                 "steps": [{"color": "green", "value": None},
                                                           {"color": "red", "value": 0.9}]}},
                     "overrides": []},
    )
    return [verdict, rules, dropped, allowed, state, pressure]


def operator_panels() -> list[dict[str, Any]]:
    return [
        panel("Reconciles by kind and outcome", "timeseries",
              [target(f"sum by (kind, outcome) (rate(sparsegate_operator_reconciles_total[{RATE}]))",
                      "{{kind}} {{outcome}}")],
              unit="ops", w=8, description="Reconciles per second by resource kind and outcome."),
        panel("Reconcile errors", "timeseries",
              [target(f"sum by (kind) (rate(sparsegate_operator_reconcile_errors_total[{RATE}]))", "{{kind}}")],
              unit="ops", w=8, description="Reconciles that raised, per second, by kind."),
        panel("Reconcile p99", "timeseries",
              [target("histogram_quantile(0.99, sum by (kind, le) (\n"
                      f"  rate(sparsegate_operator_reconcile_duration_seconds_bucket[{RATE}])\n))", "{{kind}}")],
              unit="s", w=8, description="p99 reconcile wall time by kind."),
        panel("Rollout tick p99", "timeseries",
              [target("histogram_quantile(0.99, sum by (le) (\n"
                      f"  rate(sparsegate_rollout_tick_duration_seconds_bucket[{RATE}])\n))", "p99")],
              unit="s", w=8, description="p99 wall time of one GateConfig rollout tick."),
        panel("Gate pushes by result", "timeseries",
              [target(f"sum by (result) (rate(sparsegate_rollout_gate_pushes_total[{RATE}]))", "{{result}}")],
              unit="ops", w=8, description="PUT /admin/gate calls to model pods per second, by result."),
        panel("Finished rollouts by outcome", "stat",
              [target("sum by (outcome) (increase(sparsegate_rollouts_total[$__range]))", "{{outcome}}")],
              w=8, description="Rollouts that ended in the time range, by outcome (succeeded, failed, "
                               "reverted, superseded, ...).",
              options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                       "textMode": "value_and_name", "colorMode": "none", "graphMode": "none"}),
        panel("Median step duration by step percent", "bargauge",
              [target("histogram_quantile(0.5, sum by (percent, le) (\n"
                      "  increase(sparsegate_rollout_step_duration_seconds_bucket[$__range])\n))", "{{percent}} %")],
              unit="s", w=24, h=6,
              description="Median time from a step's start to its promotion over the time range, by the step's percent.",
              options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                       "orientation": "horizontal", "displayMode": "basic"}),
    ]


def variables() -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str, *, multi: bool = False) -> dict[str, Any]:
        v: dict[str, Any] = {"type": "query", "name": name, "label": label, "datasource": DS,
                             # A plain label_values() string: every Grafana version reads it.
                             "query": query,
                             "definition": query, "refresh": 2, "sort": 1, "multi": multi, "includeAll": multi,
                             "current": {}, "options": [], "hide": 0, "regex": ""}
        if multi:
            v["allValue"] = ".*"
        return v

    return [
        {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
         "current": {}, "options": [], "hide": 0, "refresh": 1, "regex": ""},
        query_var("namespace", "Namespace", "label_values(sparsegate_rollout_phase, namespace)"),
        query_var("gateconfig", "GateConfig", 'label_values(sparsegate_rollout_phase{namespace="$namespace"}, gateconfig)'),
        query_var("model", "SparseModel",
                  'label_values(sparsegate_gateconfig_model_info{namespace="$namespace", gateconfig="$gateconfig"}, model)',
                  multi=True),
    ]


def layout(sections: list[tuple[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Rows and panels left to right, wrapping at Grafana's 24 columns; ids in order."""
    out: list[dict[str, Any]] = []
    y = 0
    for title, panels in sections:
        r = row(title)
        r["gridPos"].update({"x": 0, "y": y})
        out.append(r)
        y += 1
        x = line_h = 0
        for p in panels:
            w, h = p["gridPos"]["w"], p["gridPos"]["h"]
            if x + w > 24:
                x, y, line_h = 0, y + line_h, 0
            p["gridPos"].update({"x": x, "y": y})
            x += w
            line_h = max(line_h, h)
            out.append(p)
        y += line_h
    for i, p in enumerate(out, start=1):
        p["id"] = i
    return out


def dashboard() -> dict[str, Any]:
    return {
        "title": "sparsegate: rollouts, canary vs stable, XDP, operator",
        "uid": "sparsegate-overview",
        "description": "Gate rollouts per GateConfig, canary vs stable model-server metrics, node-agent "
                       "XDP flow policy and operator reconciles. Generated by dev/grafana_dashboard.py.",
        "tags": ["sparsegate"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": variables()},
        "panels": layout([
            ("Rollout of $gateconfig", rollout_panels()),
            ("Canary vs stable (model servers)", canary_panels()),
            ("Token latency (model servers)", token_latency_panels()),
            ("Node agent: XDP flow policy", agent_panels()),
            ("Operator", operator_panels()),
        ]),
    }


# ------------------------------------------------------------------ reading the dashboard (tests)


def panel_queries(dash: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query target in ``dash``, rows included."""
    out = []
    for p in dash["panels"]:
        for inner in [p, *p.get("panels", [])]:
            for t in inner.get("targets", []):
                out.append((inner["title"], t["refId"], t["expr"]))
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variable interpolation for ``$name`` and ``${name}`` (longest names first, so
    ``$__rate_interval`` is not read as ``$__rate``)."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    return expr


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed JSON is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python dev/grafana_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
