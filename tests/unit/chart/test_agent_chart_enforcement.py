"""The agent DaemonSet's enforcement values: telemetry only by default, no toleration of tainted
(control-plane) nodes by default, and arguments the agent's own parser accepts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from sparsegate_ebpf import agent

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))


def helm_template(*values: str) -> subprocess.CompletedProcess[str]:
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    return subprocess.run([str(exe), "template", "rel", str(CHART), "--namespace", "sg-system",
                           "--set", "agent.enabled=true", *values], capture_output=True, text=True, timeout=60)


def daemonset(*values: str) -> dict:
    proc = helm_template(*values)
    assert proc.returncode == 0, proc.stderr
    (ds,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "DaemonSet"]
    return ds


def agent_args(ds: dict) -> list[str]:
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: "10.0.0.7" for e in container["env"]}  # what the kubelet expands $(NAME) to
    args = container["command"][3:]
    for name, value in env.items():
        args = [a.replace(f"$({name})", value) for a in args]
    return args


def test_defaults_are_telemetry_only_and_tolerate_no_taints() -> None:
    ds = daemonset()
    parsed = agent.parse_args(agent_args(ds))
    assert parsed.enforcement == "off" and parsed.telemetry_only
    assert parsed.allow_sources == ["10.0.0.7"] and parsed.node_addresses == "auto"  # the node IP
    spec = ds["spec"]["template"]["spec"]
    assert not spec.get("tolerations")  # control-plane taints are not tolerated
    (container,) = spec["containers"]
    assert {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}} in container["env"]


@pytest.mark.parametrize("mode", ["audit", "enforce"])
def test_enforcement_is_an_explicit_value(mode: str) -> None:
    parsed = agent.parse_args(agent_args(daemonset("--set", f"agent.enforcement={mode}",
                                                   "--set", "agent.allowSources={10.9.0.1,10.9.0.2}")))
    assert parsed.enforcement == mode
    assert parsed.allow_sources == ["10.0.0.7", "10.9.0.1", "10.9.0.2"]


def test_one_policy_map_size_reaches_the_agents_and_the_operator(tmp_path) -> None:
    """agent.policyMapRecords becomes the agents' --policy-map-records and the operator's capacity,
    so the operator never publishes an allow-list the agents cannot load."""
    from sparsegate.domain.policy_capacity import Capacity
    from sparsegate_contracts import flowpolicy

    for value, records in ((None, flowpolicy.MAP_MAX_ENTRIES), ("262144", 262144), ("file:1048576", 1048576)):
        if value and value.startswith("file:"):
            # A values file: YAML numbers reach the templates as float64 (1048576 once rendered as
            # 1.048576e+06, which neither the agent nor the operator parses); --set gives int64.
            values = tmp_path / "records.yaml"
            values.write_text(f"agent:\n  policyMapRecords: {value[5:]}\n")
            proc = helm_template("-f", str(values))
        else:
            proc = helm_template(*(("--set", f"agent.policyMapRecords={value}") if value else ()))
        assert proc.returncode == 0, proc.stderr
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
        assert agent.parse_args(agent_args(ds)).policy_map_records == records
        (deploy,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("operator")]
        env = {e["name"]: e.get("value") for c in deploy["spec"]["template"]["spec"]["containers"]
               for e in c.get("env") or ()}
        assert Capacity.from_env(env).max_records == records - flowpolicy.AGENT_RESERVED_RECORDS


def test_flow_idle_timeout_reaches_the_agent(tmp_path) -> None:
    """agent.flowIdleTimeout becomes the agents' --flow-idle-timeout (default 300 s, 0: never), from
    --set and from a values file (YAML numbers reach the templates as float64)."""
    from sparsegate_ebpf.metrics import FLOW_IDLE_TIMEOUT

    assert agent.parse_args(agent_args(daemonset())).flow_idle_timeout == FLOW_IDLE_TIMEOUT == 300
    for values, seconds in ((("--set", "agent.flowIdleTimeout=0"), 0), (("--set", "agent.flowIdleTimeout=90"), 90),
                            (("--set", "agent.flowIdleTimeout=2.5"), 2.5)):
        assert agent.parse_args(agent_args(daemonset(*values))).flow_idle_timeout == seconds, values
    for text, seconds in (("0", 0), ("1048576", 1048576), ("0.25", 0.25)):
        file = tmp_path / "idle.yaml"
        file.write_text(f"agent:\n  flowIdleTimeout: {text}\n")
        assert agent.parse_args(agent_args(daemonset("-f", str(file)))).flow_idle_timeout == seconds, text


def test_one_flow_policy_configmap_name_reaches_the_agents_the_operator_and_their_rbac(monkeypatch) -> None:
    """agent.policyConfigMap is where the operator publishes the allow-list and where the agents
    read it: a renamed ConfigMap that only one side knew would leave enforcement on nothing."""
    from sparsegate.handlers.routingpolicy import Settings
    from sparsegate_contracts import flowpolicy

    for value, name in ((None, flowpolicy.CONFIGMAP_NAME), ("team-a-flows", "team-a-flows")):
        proc = helm_template(*(("--set", f"agent.policyConfigMap={value}") if value else ()))
        assert proc.returncode == 0, proc.stderr
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
        (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
        assert agent.parse_args(agent_args(ds)).policy_configmap == f"sg-system/{name}"
        (deploy,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("operator")]
        env = {e["name"]: e.get("value") for c in deploy["spec"]["template"]["spec"]["containers"]
               for e in c.get("env") or () if "value" in e}
        for key, val in env.items():
            monkeypatch.setenv(key, val)
        assert Settings.from_env().flow_policy_configmap == name
        # Both sides may read (the operator also write) that ConfigMap and its shards, none other.
        granted = {n for d in docs if d["kind"] == "Role" for r in d["rules"] if "configmaps" in r["resources"]
                   for n in r.get("resourceNames") or ()}
        assert name in granted and f"{name}-0" in granted
        if value:
            assert flowpolicy.CONFIGMAP_NAME not in granted


@pytest.mark.parametrize(("values", "field"), [
    (("--set", "agent.enforcement=on"), "/agent/enforcement"),
    (("--set", "agent.policyMapRecords=100"), "/agent/policyMapRecords"),
    (("--set", "agent.policyConfigMap=Flows_A"), "/agent/policyConfigMap"),
    (("--set", "agent.flowIdleTimeout=-1"), "/agent/flowIdleTimeout"),
    (("--set-string", "agent.flowIdleTimeout=5m"), "/agent/flowIdleTimeout"),
    (("--set", "agent.allowSources={not-an-ip}"), "/agent/allowSources/0"),
])
def test_bad_values_are_refused_naming_the_field(values: tuple[str, ...], field: str) -> None:
    proc = helm_template(*values)
    assert proc.returncode != 0 and field in proc.stderr, proc.stderr
