"""Fast grouped dispatch equals a naive per-token reference; gradients reach gate and experts."""

import pytest
import torch

from sparsegate_workload.experts import HAS_GROUPED_MM, naive_moe_reference
from sparsegate_workload.moe import DenseFFN, DynamicMoE, TopKMoE, dense_equivalent_width

BACKENDS = ["loop", "grouped"] if HAS_GROUPED_MM else ["loop"]


def _per_token_reference(x, layer, *, threshold, min_k, max_k):
    """Definition straight from the spec, one token at a time (no shared routing code)."""
    probs = torch.softmax(x @ layer.gate.weight.T, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p, e = probs[t].sort(descending=True)
        k = 0
        while k < max_k and (k < min_k or p[:k].sum() < threshold):
            k += 1
        w = p[:k] / p[:k].sum()
        for j in range(k):
            wgu, wd = layer.experts.w_gate_up[e[j]], layer.experts.w_down[e[j]]
            gate, up = (x[t] @ wgu).chunk(2)
            out[t] += w[j] * ((torch.nn.functional.silu(gate) * up) @ wd)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_dispatch_matches_per_token_reference(backend):
    g = torch.Generator().manual_seed(0)
    layer = DynamicMoE(16, 32, 6, backend=backend)
    layer.reset_parameters(g)
    with torch.no_grad():
        layer.gate.weight.mul_(3)
        x = torch.randn(3, 7, 16, generator=g)
        y, stats = layer(x, confidence_threshold=0.7, min_experts=1, max_experts=3)
        ref = _per_token_reference(x.reshape(-1, 16), layer, threshold=0.7, min_k=1, max_k=3)
    assert torch.allclose(y.reshape(-1, 16), ref, atol=1e-5)
    assert stats.dropped == 0 and 1.0 <= stats.mean_active <= 3.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fast_dispatch_matches_naive_loop_with_capacity_drops(backend):
    g = torch.Generator().manual_seed(3)
    layer = DynamicMoE(16, 32, 4, backend=backend)
    layer.reset_parameters(g)
    x = torch.randn(40, 16, generator=g)
    with torch.no_grad():
        routing = layer.gate(x, confidence_threshold=0.9, min_experts=1, max_experts=4,
                             capacity_factor=0.5)
        y = layer.experts(x, routing)
        ref = naive_moe_reference(x, layer.experts, routing)
    assert routing.dropped > 0
    assert torch.allclose(y, ref, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_flow_through_gate_and_experts(backend):
    g = torch.Generator().manual_seed(1)
    layer = DynamicMoE(16, 32, 4, backend=backend)
    layer.reset_parameters(g)
    x = torch.randn(24, 16, generator=g, requires_grad=True)
    y, stats = layer(x, confidence_threshold=0.8, capacity_factor=None, entropy_beta=0.1)
    (y.square().mean() + 0.01 * stats.aux_loss + stats.entropy_loss).backward()
    for p in (layer.gate.weight, layer.experts.w_gate_up, layer.experts.w_down, x):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    # Grad through the combine weights alone reaches the gate (not only via the aux losses).
    layer.zero_grad()
    y, _ = layer(x.detach(), confidence_threshold=0.8)
    y.square().mean().backward()
    assert layer.gate.weight.grad.abs().sum() > 0


def test_autograd_path_equals_inference_path():
    g = torch.Generator().manual_seed(2)
    layer = DynamicMoE(16, 32, 4)
    layer.reset_parameters(g)
    x = torch.randn(30, 16, generator=g)
    y_train, _ = layer(x, capacity_factor=1.0)
    with torch.no_grad():
        y_inf, _ = layer(x, capacity_factor=1.0)
    assert torch.allclose(y_train, y_inf, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_topk_layer_matches_naive_reference(k):
    g = torch.Generator().manual_seed(4)
    layer = TopKMoE(16, 32, 4, k=k)
    layer.reset_parameters(g)
    x = torch.randn(20, 16, generator=g)
    with torch.no_grad():
        routing = layer.gate(x, capacity_factor=None)
        assert torch.allclose(layer.experts(x, routing),
                              naive_moe_reference(x, layer.experts, routing), atol=1e-5)


def test_dense_baseline_and_equivalent_width():
    assert dense_equivalent_width(d_ff=1024, mean_k=1.41) == 1472
    assert dense_equivalent_width(d_ff=1024, mean_k=2.0) == 2048
    assert dense_equivalent_width(d_ff=64, mean_k=0.1) == 64
    g = torch.Generator().manual_seed(5)
    dense = DenseFFN(16, 64)
    dense.reset_parameters(g)
    x = torch.randn(5, 16, generator=g)
    gate, up = (x @ dense.ffn.w_gate_up).chunk(2, dim=-1)
    y, stats = dense(x)
    assert torch.allclose(y, (torch.nn.functional.silu(gate) * up) @ dense.ffn.w_down, atol=1e-6)
    assert stats.mean_active == 1.0
