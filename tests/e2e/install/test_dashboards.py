"""Every query of the chart's Grafana dashboard returns series from a real Prometheus scraping the
real components.

Given the dev stack (the chart's operator in-cluster from its image), a GateConfig and a SparseModel
of two model-server pods under load in the test's namespace (a tiny random Mixtral checkpoint with its
tokenizer baked into an image made FROM the stack's model-server image, so the pods also answer the
OpenAI API and export vLLM's token latency histograms), a node agent process with XDP on a
veth of the test's own (host end; the other end in a network namespace that sends allowed and
denied UDP through it), and a real ``prometheus`` that scrapes:

* the operator and the model-server pods through the chart's own PodMonitors (rendered with
  ``helm template`` from the same values as the installed release, then translated into
  kubernetes_sd scrape jobs modelled on the Prometheus Operator's: the selectors, port names,
  relabelings and honorLabels are the chart's; pods are discovered through the API server), and
* the agent process at its metrics address (a host process here, not the chart's DaemonSet:
  the dashboard reads its metrics, not how it was deployed);

when one rollout runs to completion and a second is held at its first step (50 %: one canary pod,
one stable), then every panel query of the ConfigMap the chart renders — with the dashboard
variables set to the test's namespace, GateConfig and model — returns at least one series, and
the canary-vs-stable panels return both roles.

The same Prometheus loads the chart's PrometheusRule (``monitoring.prometheusRule``, its
``spec.groups`` as a rules file): every rule evaluates with health ``ok`` on these real series and
every alert's expression is a query Prometheus answers (most return nothing: alerts are quiet when
healthy); two alerts whose thresholds this test sets to 0 (p99 time to first token, XDP map
pressure) fire for the test's SparseModel and for the agent's ``flows`` map.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grafana_dashboard
import pytest
import yaml
from devstack import CHART, RELEASE, RELEASE_NS, Stack, image_values
from imagebuild.checkpoint import bake_checkpoint
from loadgen import BackgroundLoad
from localcluster.health import wait_for
from localcluster.ports import free_port
from localcluster.prometheus import Prometheus

from dashboard_e2e_support import PY, podmonitor_scrape_configs, stop
from host_veth import HostVeth
from sparsegate_contracts import gate as gatedoc

pytestmark = [pytest.mark.e2e, pytest.mark.bpf, pytest.mark.slow]

BIN = Path.home() / ".cache" / "sparsegate" / "bin"
GATE, MODEL = "dash-gate", "dash-m"
SCRAPE = "1s"
PARAMS = {"toolGateThreshold": 0.85, "entropyBeta": 0.1, "confidenceThreshold": 0.6, "capacityFactor": 1.25,
          "minExpertsPerToken": 1, "maxExpertsPerToken": 4, "precisionPolicy": "auto"}
ALLOWED_PORT, DENIED_PORT = 9000, 9001
CHECKPOINT_DIR = "/models/tiny-mixtral"
TOKEN_LATENCY_PANELS = ("Time to first token", "Inter-token latency", "Time per output token (per request)")


def log(msg: str) -> None:
    sys.stderr.write(f"\n[e2e] dashboards: {msg}\n")


# ---------------------------------------------------------------- the pieces


def rendered(stack: Stack, *values: str) -> list[dict]:
    """The chart as installed on the stack (same images and values) plus ``values``."""
    out = stack.helm("template", RELEASE, str(CHART), "-n", RELEASE_NS, *image_values(stack.images),
                     *stack.extra_values, *values).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def dashboard_from_chart(stack: Stack) -> dict:
    (cm,) = [d for d in rendered(stack, "--set", "monitoring.dashboards.enabled=true")
             if d["kind"] == "ConfigMap" and (d["metadata"].get("labels") or {}).get("grafana_dashboard") == "1"]
    return json.loads(cm["data"]["sparsegate.json"])


# Test-only thresholds: conditions the test causes (tokens are generated; the agent tracks flows).
FORCED_ALERTS = {"SparsegateModelServerTimeToFirstTokenHigh": "modelServerTimeToFirstTokenHigh",
                 "SparsegateXdpMapPressureHigh": "xdpMapPressure"}


def prometheus_rule(stack: Stack) -> dict:
    """The chart's PrometheusRule, with the FORCED_ALERTS at threshold 0 and `for` 0s."""
    sets = ["--set", "monitoring.prometheusRule.enabled=true"]
    for key in FORCED_ALERTS.values():
        sets += ["--set", f"monitoring.prometheusRule.alerts.{key}.threshold=0",
                 "--set", f"monitoring.prometheusRule.alerts.{key}.for=0s"]
    (rule,) = [d for d in rendered(stack, *sets) if d["kind"] == "PrometheusRule"]
    return rule


def pod_monitors(stack: Stack) -> dict[str, dict]:
    docs = rendered(stack, "--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.podMonitor.operator=true",
                    "--set", "monitoring.podMonitor.models=true", "--set", f"monitoring.interval={SCRAPE}")
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[HostVeth, str]]:
    """The node agent process, XDP on the host end of a fresh veth, enforcing a policy file that
    allows one UDP port from the peer and denies the rest; yields (veth, metrics address)."""
    with HostVeth.create(prefix="sgd", net=202, dst_mac="02:53:47:00:00:03") as veth:
        policy = tmp_path / "flow-policy.json"
        policy.write_text(json.dumps({"version": "dash-v1", "defaultAction": "deny", "entries": [
            {"srcIP": veth.src_ip, "dstIP": veth.dst_ip, "dstPort": ALLOWED_PORT, "protocol": "udp",
             "action": "allow", "rule": f"dash/allow#{ALLOWED_PORT}"}]}))
        port, log_path = free_port(), tmp_path / "agent.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                [PY, "-m", "sparsegate_ebpf.agent", "--interfaces", veth.host_if, "--metrics-port", str(port),
                 "--metrics-addr", "127.0.0.1", "--policy-file", str(policy), "--poll-interval", "0.2",
                 "--policy-liveness", "off", "--on-exit", "detach"], stdout=out, stderr=subprocess.STDOUT)
        address = f"127.0.0.1:{port}"

        def enforcing() -> bool:
            assert proc.poll() is None, f"agent exited {proc.returncode}: {log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as resp:
                    return 'sparsegate_xdp_policy_info{version="dash-v1"}' in resp.read().decode()
            except OSError:
                return False

        try:
            wait_for(enforcing, what="the agent enforcing the policy file", timeout_s=120, interval_s=0.3)
            yield veth, address
        finally:
            rc = stop(proc)
            assert rc == 0, f"agent exited {rc}: {log_path.read_text()[-3000:]}"


def checkpoint_image(base: str, ctx: Path) -> str:
    """The stack's model-server image with a tiny random Mixtral checkpoint (and tokenizer) in it."""
    from sparsegate_workload.hf import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(ctx / "tiny-mixtral", family="mixtral", experts=4, top_k=2)
    return bake_checkpoint(base, checkpoint, ctx=ctx / "image", target=CHECKPOINT_DIR,
                           tag="localhost/sparsegate-test-checkpoint:dashboards")


class CompletionLoad:
    """OpenAI completions (several tokens each) round-robin over the model pods, one at a time, so
    the servers observe time to first token and inter-token latency."""

    def __init__(self, targets) -> None:
        self._targets, self._stop, self.answered = targets, threading.Event(), 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = json.dumps({"model": MODEL, "prompt": "the gate routes", "max_tokens": 8, "temperature": 0}).encode()
        while not self._stop.is_set():
            for target in self._targets():
                req = urllib.request.Request(f"http://{target}/v1/completions", method="POST", data=body,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=30) as resp:
                        resp.read()
                        self.answered += 1
                except OSError:
                    pass
            self._stop.wait(0.2)

    def start(self) -> CompletionLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


# ---------------------------------------------------------------- the cluster side


def kubectl_json(stack: Stack, ns: str, *args: str) -> dict:
    return json.loads(stack.kubectl("get", *args, "-n", ns, "-o", "json").stdout)


def rollout(stack: Stack, ns: str) -> dict:
    return (kubectl_json(stack, ns, "gateconfig", GATE).get("status") or {}).get("rollout") or {}


def model_pods(stack: Stack, ns: str) -> list[dict]:
    items = kubectl_json(stack, ns, "pods", "-l", f"sparsegate.dev/model={MODEL}")["items"]
    return [p for p in items if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")]


def serving(stack: Stack, ns: str, replicas: int) -> bool:
    pods = model_pods(stack, ns)
    if len(pods) != replicas or not all(any(c["type"] == "Ready" and c["status"] == "True"
                                            for c in p["status"].get("conditions") or []) for p in pods):
        return False
    for p in pods:
        try:
            with urllib.request.urlopen(f"http://{p['status']['podIP']}:8080/healthz", timeout=3) as resp:
                if not json.loads(resp.read()).get("gateVersion"):
                    return False
        except OSError:
            return False
    return True


def set_spec(stack: Stack, ns: str, *, params: dict, rollout_fields: dict) -> str:
    stack.kubectl("patch", "gateconfig", GATE, "-n", ns, "--type=merge", "-p",
                  json.dumps({"spec": {"params": params, "rollout": rollout_fields}}))
    # The CRD's defaults fill in omitted fields: the version is that of the params as stored.
    return gatedoc.version_of(kubectl_json(stack, ns, "gateconfig", GATE)["spec"]["params"])


def wait_rollout(stack: Stack, ns: str, what: str, done, timeout_s: float = 150) -> dict:
    try:
        return wait_for(lambda: (ro := rollout(stack, ns)) and done(ro) and ro, what=what,  # type: ignore[return-value]
                        timeout_s=timeout_s, interval_s=0.5)
    except AssertionError as exc:
        pytest.fail(f"{exc}; last status.rollout: {json.dumps(rollout(stack, ns))[:1500]}")


# ---------------------------------------------------------------- the alert rules


def check_alert_rules(prom: Prometheus, chart_rules: list[dict], ns: str) -> list[dict]:
    """Every chart rule loaded and evaluated with health ok; every alert's expression answered; the
    forced alerts firing for the test's objects. Returns the active alerts."""
    forced: dict[str, list[dict]] = {}

    def evaluated_and_forced_firing() -> bool:
        rules = prom.rules()
        assert len(rules) == len(chart_rules), [r["name"] for r in rules]
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] == "err"]
        assert bad == [], f"rules that failed to evaluate: {bad}"
        forced.clear()
        for a in prom.alerts():
            if a["labels"]["alertname"] in FORCED_ALERTS and a["state"] == "firing":
                forced.setdefault(a["labels"]["alertname"], []).append(a)
        return all(r["health"] == "ok" for r in rules) and set(forced) == set(FORCED_ALERTS)

    try:
        wait_for(evaluated_and_forced_firing, what="every chart rule evaluated ok and the forced alerts firing",
                 timeout_s=60, interval_s=1.0)
    except AssertionError as exc:
        pytest.fail(f"{exc}; firing: {sorted(forced)}; rules: "
                    f"{[(r['name'], r['health'], r.get('lastError')) for r in prom.rules()]}")
    assert {r["name"] for r in prom.rules()} == {r.get("alert") or r.get("record") for r in chart_rules}
    for r in chart_rules:
        prom.query(r["expr"])  # asserts Prometheus answers it (an empty answer is fine)
    ttft = forced["SparsegateModelServerTimeToFirstTokenHigh"]
    assert {(a["labels"]["namespace"], a["labels"]["model"]) for a in ttft} == {(ns, MODEL)}, ttft
    assert any(a["annotations"]["summary"] == f"SparseModel {ns}/{MODEL}: p99 time to first token high" for a in ttft)
    pressure = {a["labels"]["map"]: a for a in forced["SparsegateXdpMapPressureHigh"] if a["labels"].get("node") == "local"}
    assert "flows" in pressure, forced["SparsegateXdpMapPressureHigh"]
    assert pressure["flows"]["annotations"]["summary"] == "sparsegate node agent on local: XDP map flows nearly full"
    active = prom.alerts()
    log(f"{len(chart_rules)} chart rules evaluated ok; active alerts: "
        f"{sorted({(a['labels']['alertname'], a['state']) for a in active})}")
    return active


# ---------------------------------------------------------------- the test


def test_every_dashboard_query_returns_series(stack: Stack, stack_namespace: str, agent: tuple[HostVeth, str],
                                              tmp_path: Path) -> None:
    ns = stack_namespace
    veth, agent_address = agent
    t0 = time.monotonic()

    # Given: the dashboard and the monitors exactly as the chart renders them.
    dash = dashboard_from_chart(stack)
    queries = grafana_dashboard.panel_queries(dash)
    monitors = pod_monitors(stack)
    assert set(monitors) == {f"{RELEASE}-operator", f"{RELEASE}-models"}, set(monitors)
    alert_rule = prometheus_rule(stack)
    rules_file = tmp_path / "sparsegate.rules.yml"
    rules_file.write_text(json.dumps({"groups": alert_rule["spec"]["groups"]}))  # JSON is YAML
    chart_rules = [r for g in alert_rule["spec"]["groups"] for r in g["rules"]]

    # Given: a GateConfig and a two-pod SparseModel, both pods serving. Analysis bounds are wide: the
    # built-in model has random weights, so a gate change moves its perplexity a lot (this test is
    # about what the dashboard shows, not about analysis).
    gateconfig = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig", "metadata": {"name": GATE},
                  "spec": {"params": PARAMS,
                           # Pod-level steps: the held step is asserted as one canary pod of two.
                           "rollout": {"strategy": "instances", "steps": [50, 100], "analysisInterval": "3s",
                                       "minRequests": 5,
                                       "slaP99LatencyMs": 10000, "maxDrift": 10, "maxQualityDrop": 10,
                                       "autoRollback": True}}}
    image = checkpoint_image(stack.images["model-server"], tmp_path / "checkpoint-image")
    model = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "metadata": {"name": MODEL},
             "spec": {"replicas": 2, "gateConfigRef": {"name": GATE}, "image": image,
                      "model": {"dModel": 64, "experts": 4, "maxExpertsPerToken": 2, "source": CHECKPOINT_DIR}}}
    stack.kubectl("apply", "-n", ns, "-f", "-",
                  input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [gateconfig, model]}))
    wait_for(lambda: serving(stack, ns, 2), what="2 model-server pods Ready and answering /healthz",
             timeout_s=300, interval_s=1.0)
    wait_rollout(stack, ns, "the GateConfig initialised", lambda ro: ro.get("phase") == "Succeeded", timeout_s=60)
    log(f"model pods serving {time.monotonic() - t0:.1f}s after the test began")

    # Given: Prometheus scraping through the chart's PodMonitors, and the agent's address.
    kubeconfig = stack.cluster.kubeconfig
    config = {"global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": SCRAPE},
              "rule_files": [str(rules_file)],  # a rule Prometheus cannot parse fails its start
              "scrape_configs": [job for pm in monitors.values()
                                 for job in podmonitor_scrape_configs(pm, kubeconfig=kubeconfig)]
                                + [{"job_name": "agent", "static_configs": [{"targets": [agent_address],
                                                                             "labels": {"node": "local"}}]}]}
    prom = Prometheus(binary=BIN / "prometheus", work=tmp_path, config=config, port=free_port())
    targets = lambda: [f"{p['status']['podIP']}:8080" for p in model_pods(stack, ns)]  # noqa: E731
    load = BackgroundLoad(targets, qps=20).start()
    completions = CompletionLoad(targets).start()
    try:
        # When: a rollout runs to completion, and a second one is held at its first step.
        v1 = set_spec(stack, ns, params={**PARAMS, "confidenceThreshold": 0.62},
                      rollout_fields={"analysisInterval": "3s"})
        wait_rollout(stack, ns, f"{v1} promoted", lambda ro: ro.get("phase") == "Succeeded"
                     and kubectl_json(stack, ns, "gateconfig", GATE)["status"]["stable"]["version"] == v1)
        v2 = set_spec(stack, ns, params={**PARAMS, "confidenceThreshold": 0.64},
                      rollout_fields={"analysisInterval": "10m"})
        wait_rollout(stack, ns, f"{v2} on one of two pods", lambda ro: ro.get("canaryVersion") == v2
                     and ro.get("phase") == "Analysing" and list((ro.get("podVersions") or {}).values()).count(v2) == 1)
        stack.kubectl("patch", "gateconfig", GATE, "-n", ns, "--type=merge", "-p",
                      json.dumps({"spec": {"rollout": {"paused": True}}}))
        wait_rollout(stack, ns, "the rollout paused at step 1", lambda ro: ro.get("phase") == "Paused")
        log(f"rollouts done {time.monotonic() - t0:.1f}s after the test began; load {load.stats}")

        # When: allowed and denied packets cross the agent's XDP program while Prometheus scrapes.
        variables = {"datasource": "prometheus", "namespace": ns, "gateconfig": GATE, "model": MODEL,
                     "__rate_interval": "30s", "__range": "10m"}
        concrete = [(title, ref, grafana_dashboard.substitute(expr, variables)) for title, ref, expr in queries]
        results: dict[tuple[str, str], list[dict]] = {}

        def every_query_has_series() -> bool:
            assert veth.send_udp(ALLOWED_PORT, 50) == 50 and veth.send_udp(DENIED_PORT, 20) == 20
            for title, ref, expr in concrete:
                results[(title, ref)] = prom.query(expr)
            # The verdict panel's rate needs two scrapes of each series: the deny series can show up
            # a scrape after the allow one (seen once in CI), so wait for both, as asserted below.
            actions = {r["metric"].get("action") for r in results.get(("XDP verdicts by rule", "A"), [])}
            # The token latency quantiles are NaN (no line drawn) until a window holds observations.
            latencies = [float(r["value"][1]) for (title, _), rs in results.items() if title in TOKEN_LATENCY_PANELS
                         for r in rs]
            return all(results.values()) and {"allow", "deny"} <= actions and all(map(math.isfinite, latencies))

        try:
            wait_for(every_query_has_series, what="every dashboard query to return series", timeout_s=90,
                     interval_s=1.0)
        except AssertionError:
            empty = [f"{t}/{r}" for (t, r), v in results.items() if not v]
            down = [(t["labels"].get("job"), t["scrapeUrl"], t["lastError"]) for t in prom.targets()
                    if t["health"] != "up"]
            pytest.fail(f"queries with no series: {empty}\ntargets not up: {down}\n"
                        f"prometheus log: {prom.log.read_text()[-2000:]}")

        # Then: the chart's alert rules, on the same series.
        check_alert_rules(prom, chart_rules, ns)
    finally:
        load.stop()
        completions.stop()
        prom.stop()
    log(f"{len(concrete)} queries of {len({t for t, _, _ in concrete})} panels returned series "
        f"{time.monotonic() - t0:.1f}s after the test began; load {load.stats}")

    # Then: every query returned series (above); the canary-vs-stable panels show both roles, with
    # requests on each, and the phase panel shows the rollout paused.
    def by_label(title: str, label: str, ref: str = "A") -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in results[(title, ref)]}

    for title in ("Requests by role", "Error rate by role", "p99 latency by role", "Active experts per token by role",
                  "Quality: prompt NLL per token by role", "Quality: probe-set perplexity by role"):
        assert set(by_label(title, "role")) == {"stable", "canary"}, (title, results[(title, "A")])
    assert all(v > 0 for v in by_label("Requests by role", "role").values())
    experts = by_label("Active experts per token by role", "role")
    assert all(math.isfinite(v) and 1.0 <= v <= 4.0 for v in experts.values()), experts
    assert by_label("Rollout phase", "phase").get("Paused") == 1
    # One series per operator replica that leads (standbys run no handlers, so export none).
    assert {float(r["value"][1]) for r in results[("Canary weight and share", "A")]} == {50.0}
    assert by_label("Finished rollouts by outcome", "outcome").keys() >= {"succeeded"}
    # vLLM's token latency histograms, per SparseModel: p50 <= p99, both positive.
    for title in TOKEN_LATENCY_PANELS:
        p50, p99 = by_label(title, "model", "A"), by_label(title, "model", "B")
        assert set(p50) == set(p99) == {MODEL} and 0 < p50[MODEL] <= p99[MODEL], (title, p50, p99)
    # Every LRU map of the agent, each between empty and full; and the idle-expired gauge.
    pressure = by_label("XDP map pressure", "map")
    assert set(pressure) == {"flows", "flows6", "handshakes", "conntrack"} and all(0 <= v <= 1 for v in pressure.values())
    assert pressure["flows"] > 0, pressure
    verdicts = {(r["metric"]["rule"], r["metric"]["action"]) for r in results[("XDP verdicts by rule", "A")]}
    assert (f"dash/allow#{ALLOWED_PORT}", "allow") in verdicts and any(a == "deny" for _, a in verdicts), verdicts
