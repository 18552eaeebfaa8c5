"""The chart through the real helm binary: lint, render every scenario, least-privilege RBAC.

Fails (never skips) when helm is missing: build it with dev/setup/binaries.sh helm.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from sparsegate import cli

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))
SCENARIOS = [None, *sorted(p.name for p in (CHART / "ci").glob("*.yaml"))]


def helm(*args: str) -> str:
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def render(values: str | None = None, *extra: str) -> list[dict]:
    args = ["template", "rel", str(CHART), "--namespace", "sg-system", *extra]
    if values:
        args += ["-f", str(CHART / "ci" / values)]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


@pytest.mark.parametrize("values", SCENARIOS)
def test_lint(values):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(CHART / "ci" / values)] if values else [])
    assert "0 chart(s) failed" in helm(*args)


@pytest.mark.parametrize("values", SCENARIOS)
def test_operator_args_are_accepted_by_the_cli(values):
    (dep,) = [d for d in render(values) if d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["sparsegate"]
    args = cli._parser().parse_args(container["args"])  # the chart and the CLI agree
    assert args.command == "run" and args.standalone
    assert args.liveness.endswith(f":{container['ports'][0]['containerPort']}/healthz")
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_agent_is_off_by_default_and_follows_the_contract_when_on():
    assert not [d for d in render() if d["kind"] == "DaemonSet"]
    (ds,) = [d for d in render("agent-values.yaml") if d["kind"] == "DaemonSet"]
    cmd = ds["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:3] == ["python", "-m", "sparsegate_ebpf.agent"]
    assert "--interfaces=eth0,eth1" in cmd and "--metrics-port=9102" in cmd
    assert "--policy-configmap=sg-system/sparsegate-flow-policy" in cmd


def test_rbac_is_least_privilege():
    docs = render()
    roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"])
            if "secrets" in rule["resources"]:
                assert not {"list", "watch", "patch", "update"} & set(rule["verbs"])  # never enumerated
    (cr,) = [d for d in docs if d["kind"] == "ClusterRole"]
    resources = {r for rule in cr["rules"] for r in rule["resources"]}
    assert "customresourcedefinitions" not in resources and "namespaces" not in resources


def test_namespaced_mode_binds_per_namespace():
    docs = render("namespaced-values.yaml")
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "staging"]
    assert not [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # no Lease: never two at once


def test_schema_rejects_bad_values():
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}"
    bad = subprocess.run([str(exe), "template", "rel", str(CHART), "--set", "operator.replicas=-1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "replicas" in bad.stderr


def test_every_value_is_documented():
    """argo-helm style: a `# --` comment documents every value in values.yaml.

    A documented key is one value even if it is a map (e.g. resources); an undocumented map
    is only a grouping, and then each of its children needs its own comment.
    """
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented, inside_value = [], None
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w-]*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        if inside_value is not None and indent > inside_value:
            continue  # part of a documented map value
        inside_value = None
        documented = i > 0 and lines[i - 1].strip().startswith("#") and any(
            lines[j].strip().startswith("# --")
            for j in range(i - 1, -1, -1)
            if lines[j].strip().startswith("#") and all(lines[k].strip().startswith("#")
                                                       for k in range(j, i)))
        if documented:
            inside_value = indent
            continue
        nxt = next((x for x in lines[i + 1:] if x.strip() and not x.strip().startswith("#")), "")
        if not rest and len(nxt) - len(nxt.lstrip()) > indent:
            continue  # a grouping: its children are checked one by one
        undocumented.append(key)
    assert undocumented == []
