"""Per-layer gate precision rule, quantisation and straight-through gradients."""

import pytest
import torch

from sparsegate_workload.gateparams import GateParams
from sparsegate_workload.gating import DynamicGate
from sparsegate_workload.model import ModelConfig, build_model
from sparsegate_workload.precision import (SENSITIVITY_THRESHOLD, choose_precision,
                                           dequantize_int8, fake_quantize, gradient_variance,
                                           quantize_int8, stored_weight)


def test_rule_keeps_sensitive_layers_fp32_and_quantises_the_rest():
    assert SENSITIVITY_THRESHOLD == 1e-3
    assert choose_precision(policy="auto", sensitivity=0.0011) == "fp32"
    assert choose_precision(policy="auto", sensitivity=1e-3) == "fp32"
    assert choose_precision(policy="auto", sensitivity=0.0009) == "int8"
    for forced in ("fp32", "bf16", "int8"):
        assert choose_precision(policy=forced, sensitivity=1.0) == forced
        assert choose_precision(policy=forced, sensitivity=0.0) == forced
    with pytest.raises(ValueError):
        choose_precision(policy="fp8", sensitivity=1.0)


def test_gradient_variance_is_the_mean_elementwise_sample_variance():
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([3.0, 0.0])]
    assert gradient_variance(grads) == pytest.approx((2.0 + 0.0) / 2)
    with pytest.raises(ValueError):
        gradient_variance(grads[:1])


def test_int8_is_per_row_symmetric_and_close():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (8, 1)
    assert q.abs().max() == 127
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale / 2 + 1e-7).all()
    bf = stored_weight(w, "bf16")
    assert torch.equal(bf, w.to(torch.bfloat16).float()) and not torch.equal(bf, w)


def test_fake_quantisation_passes_gradients_straight_through():
    w = torch.randn(4, 8, requires_grad=True)
    fake_quantize(w, "int8").sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_router_serves_stored_variants_without_autograd():
    g = torch.Generator().manual_seed(0)
    gate = DynamicGate(32, 8)
    gate.reset_parameters(g)
    gate.requires_grad_(False)
    x = torch.randn(10, 32, generator=g)
    for precision in ("fp32", "bf16", "int8"):
        logits = gate.logits(x, precision)
        assert logits.dtype == torch.float32
        assert torch.allclose(logits, x @ stored_weight(gate.weight, precision).T)


def test_model_applies_policy_per_layer_from_measured_sensitivity():
    model = build_model(ModelConfig(seed=0))
    sens = model.gate_sensitivity
    assert len(sens) == model.cfg.n_layers and all(s > 0 for s in sens)
    assert model.resolve_precisions("auto") == tuple(
        "fp32" if s >= 1e-3 else "int8" for s in sens)
    assert model.resolve_precisions("int8") == ("int8",) * model.cfg.n_layers
    # Deterministic: a second build measures the same sensitivities.
    assert build_model(ModelConfig(seed=0)).gate_sensitivity == sens
    # Precision changes the stored gate weight, so logits can differ slightly but stay close.
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        a = model(tokens, gate=GateParams(), precisions=("fp32", "fp32")).logits
        b = model(tokens, gate=GateParams(), precisions=("int8", "int8")).logits
    assert torch.isfinite(b).all() and (a - b).abs().mean() < 0.1 * a.abs().mean()


def test_stored_variants_follow_in_place_weight_updates():
    gate = DynamicGate(8, 4)
    gate.reset_parameters(torch.Generator().manual_seed(0))
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = gate.logits(x, "int8")
        gate.weight.mul_(2)  # e.g. an optimizer step
        after = gate.logits(x, "int8")
    assert torch.allclose(after, 2 * before, atol=1e-4)
