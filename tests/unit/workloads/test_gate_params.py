"""Gate documents: validation, content-addressed version and checksum (CONTRACTS.md)."""

import hashlib
import json

import pytest

from sparsegate_workload.gateparams import (DEFAULT_DOCUMENT, DEFAULT_PARAMS, GateParamsError,
                                            canonical_json, make_document, parse_document,
                                            validate_params)


def test_checksum_and_version_follow_the_contract():
    params = {"toolGateThreshold": 0.85, "entropyBeta": 0.1, "confidenceThreshold": 0.6}
    text = '{"confidenceThreshold":0.6,"entropyBeta":0.1,"toolGateThreshold":0.85}'
    assert canonical_json(params) == text
    digest = hashlib.sha256(text.encode()).hexdigest()
    doc = make_document(params)
    assert doc.checksum == "sha256:" + digest
    assert doc.version == "g-" + digest[:12]
    assert parse_document(doc.to_json()) == doc


def test_defaults_fill_missing_params_and_match_the_contract():
    p = validate_params({})
    assert (p.tool_gate_threshold, p.entropy_beta, p.confidence_threshold, p.capacity_factor,
            p.min_experts_per_token, p.max_experts_per_token, p.precision_policy) == (
        0.85, 0.1, 0.6, 1.25, 1, 4, "auto")
    assert p.fault_injection.error_rate == 0.0
    assert DEFAULT_DOCUMENT.raw_params == DEFAULT_PARAMS


def test_an_unset_max_is_4_or_every_expert_of_a_smaller_model():
    assert validate_params({}).max_experts_per_token == 4
    assert [validate_params({}, num_experts=n).max_experts_per_token for n in (1, 2, 3, 4, 8)] == [1, 2, 3, 4, 4]
    # The document is the same for every model: only the value a model reads from it differs.
    doc = make_document({"toolGateThreshold": 0.9}).to_json()
    assert parse_document(doc, num_experts=2).params.max_experts_per_token == 2
    # min is still checked against it, and a written-out max is never lowered.
    with pytest.raises(GateParamsError, match=r"minExpertsPerToken must be in \[1, 2\], got 3"):
        validate_params({"minExpertsPerToken": 3}, num_experts=2)
    with pytest.raises(GateParamsError, match=r"maxExpertsPerToken must be in \[1, 2\], got 4"):
        validate_params({"maxExpertsPerToken": 4}, num_experts=2)


@pytest.mark.parametrize("params, message", [
    ({"confidenceThreshold": 0}, "confidenceThreshold"),
    ({"confidenceThreshold": 1.5}, "confidenceThreshold"),
    ({"toolGateThreshold": "high"}, "toolGateThreshold"),
    ({"minExpertsPerToken": 3, "maxExpertsPerToken": 2}, "must not exceed"),
    ({"maxExpertsPerToken": 9}, "maxExpertsPerToken"),
    ({"minExpertsPerToken": 1.5}, "integer"),
    ({"minExpertsPerToken": True}, "integer"),
    ({"precisionPolicy": "fp8"}, "precisionPolicy"),
    ({"capacityFactor": -1}, "capacityFactor"),
    ({"entropyBeta": float("nan")}, "finite"),
    ({"confidenceThreshold": 10**400}, r"finite number, got 10000000000000000000\.\.\.\(401 characters\)"),
    ({"bogus": 1}, "unknown gate params: bogus"),
    ({"faultInjection": {"errorRate": 2}}, "errorRate"),
    ({"faultInjection": {"addedLatencyMs": -5}}, "addedLatencyMs"),
    ({"faultInjection": {"oops": 1}}, "unknown faultInjection"),
])
def test_invalid_params_are_rejected_with_a_clear_message(params, message):
    with pytest.raises(GateParamsError, match=message):
        validate_params(params, num_experts=8)


def test_document_checksum_and_version_are_verified():
    good = make_document({"entropyBeta": 0.2}).to_json()
    with pytest.raises(GateParamsError, match="checksum mismatch"):
        parse_document({**good, "checksum": "sha256:" + "0" * 64})
    with pytest.raises(GateParamsError, match="content address"):
        parse_document({**good, "version": "v2"})
    tampered = json.loads(json.dumps(good))
    tampered["params"]["entropyBeta"] = 0.3
    with pytest.raises(GateParamsError, match="checksum mismatch"):
        parse_document(tampered)
    with pytest.raises(GateParamsError, match="missing"):
        parse_document({"params": {}})
    with pytest.raises(GateParamsError, match="JSON object"):
        parse_document([good])
