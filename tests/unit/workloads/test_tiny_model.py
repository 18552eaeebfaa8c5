"""The tiny MoE LM: seeded determinism, tool gate threshold, per-token variable routing."""

import dataclasses

import pytest
import torch

from sparsegate_workload.gateparams import GateParams
from sparsegate_workload.inference import run_batch
from sparsegate_workload.model import ModelConfig, TinyMoELM, build_model

FP32 = ("fp32", "fp32")


@pytest.fixture(scope="module")
def model():
    return build_model()


def test_init_is_deterministic_per_seed():
    a, b = TinyMoELM(ModelConfig(seed=7)), TinyMoELM(ModelConfig(seed=7))
    c = TinyMoELM(ModelConfig(seed=8))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.moe.gate.weight"], sc["blocks.0.moe.gate.weight"])


def test_tool_gate_fires_exactly_above_its_threshold(model):
    tokens = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prob = model(tokens, gate=GateParams(), precisions=FP32).tool_prob
    assert prob.min() < prob.median() < prob.max()
    for threshold in (0.0, prob.median().item(), 0.85, 1.0):
        gate = dataclasses.replace(GateParams(), tool_gate_threshold=threshold)
        r = run_batch(model, tokens.tolist(), gate=gate, precisions=FP32)
        expected = [row.nonzero().squeeze(1).tolist() for row in prob > threshold]
        assert r.tool_calls == expected
        assert r.tool_gate_fire_rate == (prob > threshold).float().mean().item()
    assert run_batch(model, tokens.tolist(), gate=dataclasses.replace(
        GateParams(), tool_gate_threshold=1.0), precisions=FP32).tool_calls == [[]] * 4


def test_confidence_threshold_changes_how_many_experts_tokens_use(model):
    tokens = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1)).tolist()
    means = []
    for threshold in (0.3, 0.6, 0.9):
        gate = dataclasses.replace(GateParams(), confidence_threshold=threshold,
                                   capacity_factor=8.0)
        r = run_batch(model, tokens, gate=gate, precisions=FP32)
        assert r.dropped_assignments == 0
        assert 1.0 <= r.active_experts_per_token <= 4.0
        means.append(r.active_experts_per_token)
    assert means[0] < means[1] < means[2]


def test_capacity_drops_are_reported(model):
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(2)).tolist()
    tight = dataclasses.replace(GateParams(), capacity_factor=0.5)
    r = run_batch(model, tokens, gate=tight, precisions=FP32)
    assert r.dropped_assignments > 0
    assert r.active_experts_per_token < r.selected_experts_per_token
