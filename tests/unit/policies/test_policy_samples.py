"""Sample RoutingPolicies (samples/), through the operator's data builder and `opa eval`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from localcluster.binaries import find_binary
import yaml

from sparsegate.domain.policy import PolicySource, build_opa_data

ROUTING = Path(__file__).resolve().parents[3] / "policies" / "routing"
SAMPLES = Path(__file__).resolve().parent / "samples"


def _opa() -> str:
    return str(find_binary("opa"))  # a missing binary errors with the command that builds it


@pytest.mark.opa
def test_sample_inputs_decide_as_documented(tmp_path: Path) -> None:
    docs = list(yaml.safe_load_all((SAMPLES / "routingpolicies.yaml").read_text()))
    sources = [PolicySource(namespace=d["metadata"]["namespace"], name=d["metadata"]["name"], generation=1,
                            spec=d["spec"]) for d in docs]
    rego = (ROUTING / "src.rego").read_text()
    data, _ = build_opa_data(sources=sources, trust_domain="cluster.local", rego=rego)
    (tmp_path / "data.json").write_text(json.dumps({"sparsegate": {"policies": data}}))
    cases = json.loads((SAMPLES / "inputs.json").read_text())
    for case in cases:
        (tmp_path / "input.json").write_text(json.dumps(case["input"]))
        run = subprocess.run([_opa(), "eval", "--format", "json", "-d", str(ROUTING / "src.rego"), "-d",
                              str(tmp_path / "data.json"), "-i", str(tmp_path / "input.json"),
                              "data.sparsegate.routing.decision"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        decision = json.loads(run.stdout)["result"][0]["expressions"][0]["value"]
        assert {"allow": decision["allow"], "rule": decision["rule"]} == case["expect"], case["input"]
