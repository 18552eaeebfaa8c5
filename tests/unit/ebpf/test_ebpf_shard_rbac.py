"""The chart grants exactly the flow-policy shard names the contract can produce: the agent gets them
(by name, never the namespace's other ConfigMaps), the operator writes them (empties, never deletes)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from sparsegate_contracts import flowpolicy, flowpolicy_shards

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))


def roles(*values: str) -> dict[str, dict]:
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    proc = subprocess.run([str(exe), "template", "rel", str(CHART), "--namespace", "sg-system",
                           "--set", "agent.enabled=true", *values], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Role"}


def verbs_by_name(role: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for rule in role["rules"]:
        if rule.get("resources") == ["configmaps"]:
            for name in rule.get("resourceNames") or ():
                out.setdefault(name, set()).update(rule["verbs"])
    return out


def test_agent_gets_and_operator_writes_every_shard_name() -> None:
    rendered = roles()
    agent = verbs_by_name(rendered["rel-sparsegate-agent"])
    operator = verbs_by_name(rendered["rel-sparsegate-operator-release"])
    names = flowpolicy_shards.shard_names(flowpolicy.CONFIGMAP_NAME)
    assert len(names) == flowpolicy_shards.MAX_SHARDS
    for name in names:
        assert agent[name] == {"get"}
        assert operator[name] == {"get", "update"}
    assert f"{flowpolicy.CONFIGMAP_NAME}-{flowpolicy_shards.MAX_SHARDS}" not in agent
    # Agent: no unnamed ConfigMap access (resourceNames on every ConfigMap rule).
    assert all(r.get("resourceNames") for r in rendered["rel-sparsegate-agent"]["rules"]
               if r.get("resources") == ["configmaps"])


def test_shard_names_follow_the_configured_head_name() -> None:
    agent = verbs_by_name(roles("--set", "agent.policyConfigMap=other-policy")["rel-sparsegate-agent"])
    assert agent["other-policy-0"] == {"get"} and agent["other-policy-15"] == {"get"}


def test_agent_may_follow_its_own_daemonset_and_no_other() -> None:
    # DaemonSetWatch lists and watches with fieldSelector metadata.name=<its DaemonSet>: without
    # list/watch every read is a 403, the agent never knows it is being uninstalled and keeps XDP.
    rules = [r for r in roles()["rel-sparsegate-agent"]["rules"] if r.get("resources") == ["daemonsets"]]
    assert rules == [{"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["rel-sparsegate-agent"],
                      "verbs": ["get", "list", "watch"]}], rules
