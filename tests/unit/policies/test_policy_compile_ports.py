"""A RoutingPolicy without ports reaches the ports the model's pods declare (CRD spec.ports), on the
published allow-list, whatever ports other policies name: RoutingPolicies → OPA data → the real
`opa eval` of `flow_decisions` → the flow document."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from localcluster.binaries import find_binary

from sparsegate.domain.policy import PolicySource, Port, build_opa_data
from sparsegate.domain.policy_compile import FlowTable, PodInfo, flow_document, flow_question
from sparsegate_contracts.rego import routing_policy

TD = "cluster.local"
MODEL = PodInfo("ml", "m1-0", "10.0.0.1", "srv", (("sparsegate.dev/model", "m1"),), (Port(8080),))
WEB = PodInfo("web", "w-0", "10.0.1.1", "fe", ())  # a namespace-wide Allow alone: OPA's `one` answer
TOOLS = PodInfo("tools", "t-0", "10.0.2.1", "agent", (("a", "b"),))  # a label condition: `many`
BATCH = PodInfo("batch", "b-0", "10.0.3.1", "job", ())
PODS = [MODEL, WEB, TOOLS, BATCH]


def _allow_list(tmp: Path, specs: list[dict[str, Any]]) -> FlowTable:
    rego = routing_policy()
    data, _ = build_opa_data(sources=[PolicySource("ml", f"p{i}", 1, s) for i, s in enumerate(specs)],
                             trust_domain=TD, rego=rego)
    question = flow_question(targets=data["targets"], pods=PODS, trust_domain=TD)
    (tmp / "routing.rego").write_text(rego)
    (tmp / "data.json").write_text(json.dumps({"sparsegate": {"policies": data}}))
    (tmp / "input.json").write_text(json.dumps(question.input))
    run = subprocess.run([str(find_binary("opa")), "eval", "-f", "json", "-d", str(tmp / "routing.rego"),
                          "-d", str(tmp / "data.json"), "-i", str(tmp / "input.json"),
                          "data.sparsegate.routing.flow_decisions"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    answer = json.loads(run.stdout)["result"][0]["expressions"][0]["value"]
    return FlowTable.from_document(flow_document(decisions=question.decisions(answer), pods=PODS,
                                                 policed_models=question.models))


@pytest.mark.opa
def test_a_portless_allow_does_not_reach_a_port_only_another_policy_names(tmp_path: Path) -> None:
    table = _allow_list(tmp_path, [
        {"action": "Allow", "sources": [{"namespace": "web"}], "targets": [{"sparseModel": "m1"}]},
        {"action": "Allow", "sources": [{"namespace": "tools", "matchLabels": {"a": "b"}}],
         "targets": [{"sparseModel": "m1"}]},
        # 5000 is declared by no pod of m1: only batch's rule names it.
        {"action": "Allow", "sources": [{"namespace": "batch"}], "targets": [{"sparseModel": "m1"}],
         "ports": [{"port": 5000}]},
    ])
    for caller in (WEB, TOOLS):
        assert table.allows(src_ip=caller.ip, dst_ip=MODEL.ip, port=8080), caller.namespace
        assert not table.allows(src_ip=caller.ip, dst_ip=MODEL.ip, port=5000), caller.namespace
    assert table.allows(src_ip=BATCH.ip, dst_ip=MODEL.ip, port=5000)  # named: allowed, declared or not
    assert not table.allows(src_ip=BATCH.ip, dst_ip=MODEL.ip, port=8080)


@pytest.mark.opa
def test_a_portless_deny_still_covers_a_port_another_rule_names(tmp_path: Path) -> None:
    table = _allow_list(tmp_path, [
        {"action": "Deny", "sources": [{"namespace": "batch"}], "targets": [{"sparseModel": "m1"}]},
        {"action": "Allow", "sources": [{"namespace": "batch"}], "targets": [{"sparseModel": "*"}],
         "ports": [{"port": 5000}]},
    ])
    assert not table.allows(src_ip=BATCH.ip, dst_ip=MODEL.ip, port=5000)  # Deny wins on every port
