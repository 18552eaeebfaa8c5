"""The real kube-apiserver enforces the CRD schemas and CEL rules, naming the offending field.

Given the chart installed by helm on the dev stack (its crds/ are the only CRD source), when an
invalid object is applied, then it is rejected and the error names the field; valid examples are
accepted.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from operator_e2e_support import EXAMPLES

GATE = yaml.safe_load((EXAMPLES / "gateconfig.yaml").read_text())
MODEL = yaml.safe_load((EXAMPLES / "sparsemodel.yaml").read_text())
PROBE = yaml.safe_load((EXAMPLES / "telemetryprobe.yaml").read_text())
ROUTE = yaml.safe_load((EXAMPLES / "routingpolicy.yaml").read_text())


def variant(base: dict, path: str, value) -> dict:
    obj = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = obj
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return obj


INVALID = [
    # (object, expected field in the message, a word of the message)
    (variant(MODEL, "spec.replicas", -1), "spec.replicas", "greater than or equal to 0"),
    (variant(MODEL, "spec.model.minExpertsPerToken", 5), "spec.model.minExpertsPerToken", "must not exceed"),
    (variant(MODEL, "spec.model.maxExpertsPerToken", 9), "spec.model.maxExpertsPerToken", "spec.model.experts"),
    (variant(MODEL, "spec.servingPort", 70000), "spec.servingPort", "65535"),
    (variant(GATE, "spec.params.toolGateThreshold", 1.0), "spec.params.toolGateThreshold", "less than 1"),
    (variant(GATE, "spec.params.toolGateThreshold", 0), "spec.params.toolGateThreshold", "greater than 0"),
    (variant(GATE, "spec.params.confidenceThreshold", 1.5), "spec.params.confidenceThreshold", "less than 1"),
    (variant(GATE, "spec.params.minExpertsPerToken", 6), "spec.params.minExpertsPerToken", "must not exceed"),
    (variant(GATE, "spec.params.precisionPolicy", "fp16"), "spec.params.precisionPolicy", "Unsupported value"),
    (variant(GATE, "spec.rollout.steps", [20, 5, 100]), "spec.rollout.steps", "strictly increasing"),
    (variant(GATE, "spec.rollout.steps", [5, 5, 100]), "spec.rollout.steps", "strictly increasing"),
    (variant(GATE, "spec.rollout.steps", [5, 20, 90]), "spec.rollout.steps", "must end at 100"),
    (variant(GATE, "spec.rollout.steps", [0, 100]), "spec.rollout.steps[0]", "greater than or equal to 1"),
    (variant(GATE, "spec.rollout.steps", [5, 101]), "spec.rollout.steps[1]", "less than or equal to 100"),
    (variant(GATE, "spec.rollout.slaP99LatencyMs", 0), "spec.rollout.slaP99LatencyMs", "greater than 0"),
    (variant(GATE, "spec.calibration.qpsThreshold.decay", 1), "spec.calibration.qpsThreshold.decay", "less than 1"),
    (variant(GATE, "spec.rollout.analysisInterval", "soon"), "spec.rollout.analysisInterval", "should match"),
    (variant(PROBE, "spec.xdpMode", "turbo"), "spec.xdpMode", "Unsupported value"),
    # What the schema accepts, the operator accepts: the rest is refused here, naming the field.
    (variant(GATE, "spec.rollout.analysisInterval", "0s"), "spec.rollout.analysisInterval", "positive duration"),
    (variant(GATE, "spec.calibration.qpsThreshold.window", "0ms"), "spec.calibration.qpsThreshold.window",
     "positive duration"),
    (variant(MODEL, "metadata.name", "1st-model"), "metadata.name", "DNS-1035"),
    (variant(MODEL, "metadata.name", "moe.small"), "metadata.name", "DNS-1035"),
    (variant(MODEL, "spec.model.dModel", 100_000), "spec.model.dModel", "less than or equal to 16384"),
    (variant(ROUTE, "spec.sources", [{"spiffeID": "spiffe://cluster.local/ns/web/../sa/admin"}]),
     "spec.sources[0].spiffeID", "may not be '.' or '..'"),
    # Routes and SPIFFE IDs are compared exactly: one that can never match is refused, naming the field.
    (variant(ROUTE, "spec.targets", [{"sparseModel": "moe-small", "routes": ["/v1/infer/"]}]),
     "spec.targets[0].routes[0]", "should match"),
    (variant(ROUTE, "spec.targets", [{"sparseModel": "moe-small", "routes": ["/v1/*"]}]),
     "spec.targets[0].routes[0]", "should match"),
    (variant(ROUTE, "spec.targets", [{"sparseModel": "moe-small", "routes": ["/v1/./infer"]}]),
     "spec.targets[0].routes[0]", "may not have '.' or '..' segments"),
    (variant(ROUTE, "spec.sources", [{"spiffeID": "spiffe://cluster.local/ns/web/sa/front%65nd"}]),
     "spec.sources[0].spiffeID", "should match"),
]


@pytest.mark.parametrize("obj,field,words", INVALID,
                         ids=[f"{o['kind']}:{f}" for o, f, _ in INVALID])
def test_invalid_objects_are_rejected_naming_the_field(stack, stack_namespace, obj, field, words):
    proc = stack.kubectl("apply", "-n", stack_namespace, "-f", "-", input=json.dumps(obj), check=False)
    assert proc.returncode != 0, f"accepted an invalid {obj['kind']}: {proc.stdout}"
    assert field in proc.stderr and words in proc.stderr, proc.stderr


def test_examples_are_valid_and_defaults_are_filled(stack, stack_namespace):
    examples = sorted(EXAMPLES.glob("*.yaml"))
    assert len(examples) >= 5, examples
    for path in examples:
        stack.kubectl("apply", "--dry-run=server", "-n", stack_namespace, "-f", str(path))
    minimal = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig",
               "metadata": {"name": "minimal"}, "spec": {}}
    out = stack.kubectl("create", "--dry-run=server", "-o", "json", "-n", stack_namespace, "-f", "-",
                          input=json.dumps(minimal)).stdout
    spec = json.loads(out)["spec"]
    assert spec["params"] == {"toolGateThreshold": 0.85, "entropyBeta": 0.1, "confidenceThreshold": 0.6,
                              "capacityFactor": 1.25, "minExpertsPerToken": 1, "precisionPolicy": "auto"}
    assert spec["rollout"]["steps"] == [5, 20, 100] and spec["rollout"]["autoRollback"] is True
    assert spec["calibration"]["errorRateCap"] == {"initial": 0.02, "decay": 0.95, "window": "60s"}
    # Compound durations are one grammar for the API server and the operator's parser.
    compound = variant(GATE, "spec.rollout.analysisInterval", "1m30s")
    stack.kubectl("apply", "--dry-run=server", "-n", stack_namespace, "-f", "-", input=json.dumps(compound))


def test_category_and_short_names(stack, stack_namespace):
    stack.kubectl("apply", "-n", stack_namespace, "-f", str(EXAMPLES / "telemetryprobe.yaml"))
    assert "gpu-nodes" in stack.kubectl("get", "sparsegate", "-n", stack_namespace).stdout
    for short in ("sm", "gc", "tp"):
        stack.kubectl("get", short, "-n", stack_namespace)
