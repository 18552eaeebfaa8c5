"""The chart wires TelemetryProbes: the agent knows its node, follows and reports through the
ConfigMaps the contract names, with RBAC on exactly those names (rendered by the real helm)."""
from __future__ import annotations

from test_helm_chart import containers, render

from sparsegate_contracts import probes
from sparsegate_ebpf import agent

NS = "sg-system"


def agent_docs(*values: str) -> list[dict]:
    return render(None, "--set", "agent.enabled=true", *values)


def test_agent_gets_its_node_name_and_the_contract_configmaps() -> None:
    docs = agent_docs()
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    cmd = c["command"]
    assert "--node-name=$(NODE_NAME)" in cmd
    assert f"--probe-configmap={NS}/{probes.CONFIG_CONFIGMAP_NAME}" in cmd
    assert f"--probe-report-configmap={NS}/{probes.REPORT_CONFIGMAP_NAME}" in cmd
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in c["env"]
    args = agent.parse_args([a.replace("$(NODE_NAME)", "n1").replace("$(POD_IP)", "10.0.0.1")
                             .replace("$(NODE_IP)", "10.0.0.1") for a in cmd[3:]])
    assert args.probes and args.node_name == "n1" and args.interfaces == ["eth0"]
    assert containers(docs, "DaemonSet")["agent"] == c


def test_empty_interfaces_render_and_parse_as_probes_only() -> None:
    docs = agent_docs("--set-json", "agent.interfaces=[]")
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    cmd = ds["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--interfaces=" in cmd
    args = agent.parse_args([a.replace("$(NODE_NAME)", "n1").replace("$(POD_IP)", "10.0.0.1")
                             .replace("$(NODE_IP)", "10.0.0.1") for a in cmd[3:]])
    assert args.interfaces == []


def test_rbac_on_the_probe_configmaps_is_by_name_and_minimal() -> None:
    roles = {d["metadata"]["name"]: d for d in agent_docs() if d["kind"] == "Role"}
    agent_rules = roles["rel-sparsegate-agent"]["rules"]
    by_name = {}
    for rule in agent_rules:
        if rule["resources"] == ["configmaps"]:
            for name in rule["resourceNames"]:
                by_name[name] = sorted(rule["verbs"])
    assert by_name[probes.CONFIG_CONFIGMAP_NAME] == ["get", "list", "watch"]
    assert by_name[probes.REPORT_CONFIGMAP_NAME] == ["patch"]  # its own key only, by merge patch
    operator_rules = roles["rel-sparsegate-operator-release"]["rules"]
    (rule,) = [r for r in operator_rules if probes.CONFIG_CONFIGMAP_NAME in (r.get("resourceNames") or ())]
    assert sorted(rule["resourceNames"]) == sorted([probes.CONFIG_CONFIGMAP_NAME, probes.REPORT_CONFIGMAP_NAME])
    assert sorted(rule["verbs"]) == ["get", "update"]
