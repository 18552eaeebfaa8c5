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


def test_one_token_dispatch_and_combine_equal_the_gathered_rows_exactly():
    """A one-token call (a decode step) runs each expert on the token's row itself and sums the
    output rows by slices instead of gathering them (fewer tensor ops per layer): bit-identical
    to gathering the row per assignment and the outputs per slot, for every expert count, and
    gradients still reach the gate and the experts."""
    from sparsegate_workload.experts import combine, swiglu

    g = torch.Generator().manual_seed(6)
    layer = DynamicMoE(16, 32, 6)
    layer.reset_parameters(g)
    for i in range(24):
        x = torch.randn(1, 16, generator=g)
        lo = 1 + i % 6
        hi = lo + (i // 6) % (7 - lo)
        with torch.no_grad():
            routing = layer.gate(x, confidence_threshold=0.3 + 0.1 * (i % 7), min_experts=lo,
                                 max_experts=hi, capacity_factor=None if i % 2 else 1.0)
            y = layer.experts(x, routing)
            xs = x.index_select(0, routing.token_idx)  # the general path, spelled out
            rows, start = [], 0
            for e, n in enumerate(routing.counts):
                if n:
                    h = swiglu(torch.mm(xs[start:start + n], layer.experts.w_gate_up[e]))
                    rows.append(torch.mm(h, layer.experts.w_down[e]))
                    start += n
            ys = torch.cat(rows + [x.new_zeros(1, 16)])
            ys[:-1].mul_(routing.weights.unsqueeze(-1))
            want = ys.index_select(0, routing.slots[:, 0])
            for r in range(1, routing.slots.shape[1]):
                want.add_(ys.index_select(0, routing.slots[:, r]))
        assert routing.slots.tolist() == [list(range(sum(routing.counts)))]
        assert torch.equal(y, want), (i, routing.counts)
    # No expert kept (the padding row alone): the zero row.
    ys = torch.cat([torch.zeros(1, 4)])
    assert torch.equal(combine(ys, torch.zeros(1, 1, dtype=torch.long)), torch.zeros(1, 4))
    x = torch.randn(1, 16, generator=g)
    y, stats = layer(x, min_experts=3, max_experts=3)
    y.sum().backward()
    assert layer.gate.weight.grad is not None and layer.experts.w_gate_up.grad.abs().sum() > 0


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


def test_row_buckets_bound_padding_and_shapes():
    from sparsegate_workload.experts import row_bucket

    assert [row_bucket(n) for n in (0, 1, 2, 16, 17, 255, 256, 257, 1000)] == \
        [0, 1, 16, 16, 32, 256, 256, 272, 1024]
    sizes = [row_bucket(n) for n in range(1, 1 << 14)]
    assert all(b >= n for n, b in zip(range(1, 1 << 14), sizes))
    assert sizes == sorted(sizes)
    assert max((row_bucket(n) - n) / n for n in range(256, 1 << 14)) <= 1 / 16
    assert len(set(sizes[:4096])) == 81  # the kernels oneDNN builds for 1..4,096 rows


def _bf16_layer(seed: int, num_experts: int = 6):
    g = torch.Generator().manual_seed(seed)
    layer = DynamicMoE(32, 48, num_experts, backend="loop")
    layer.reset_parameters(g)
    layer.requires_grad_(False)
    layer.experts.store("bf16")
    return layer, g


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_bucketed_bf16_dispatch_equals_each_expert_on_its_own_rows(precision):
    """Counts like [17, 3, 0, 40, 1, ...]: a padded expert runs over the next experts' rows (and
    over the zero tail for the last one); every output is still its own expert's."""
    from sparsegate_workload.experts import (swiglu, combine, dispatch_sorted, expert_mm,
                                             uses_row_buckets)

    layer, g = _bf16_layer(5)
    if precision == "int8":
        layer.experts.store("int8")
    x = torch.randn(61, 32, generator=g).to(torch.bfloat16)
    assert uses_row_buckets(x) and not uses_row_buckets(x.float())
    with torch.no_grad():
        layer.gate.weight.mul_(4)
        routing = layer.gate(x.float(), confidence_threshold=0.8, min_experts=1, max_experts=3,
                             capacity_factor=None)
        gate_up, down = layer.experts.storage
        ys = dispatch_sorted(x, routing, gate_up, down)
        # Reference: each expert on exactly its rows, one at a time.
        xs = x.index_select(0, routing.token_idx)
        ref, start = [], 0
        for e, n in enumerate(routing.counts):
            if n:
                ref.append(expert_mm(swiglu(expert_mm(xs[start:start + n], gate_up, e)), down, e))
                start += n
        ref = torch.cat(ref) * routing.weights.unsqueeze(-1).to(x.dtype)
    n_assign = routing.token_idx.numel()
    assert any(1 < n < 16 for n in routing.counts) or any(n % 16 for n in routing.counts)
    assert torch.equal(ys[n_assign], torch.zeros(32, dtype=torch.bfloat16))
    torch.testing.assert_close(ys[:n_assign], ref, rtol=1e-2, atol=1e-2)
    out = combine(ys, routing.slots)
    assert torch.equal(out, layer.experts(x, routing))


def test_bucketed_dispatch_builds_few_matmul_shapes(monkeypatch):
    """Over 200 routings of 1..300 tokens the expert matmuls see bucketed row counts only: the
    shapes oneDNN compiles a kernel for stay few (a row count per expert and call otherwise)."""
    import sparsegate_workload.experts as experts

    layer, g = _bf16_layer(7, num_experts=8)
    seen: set[int] = set()
    real = experts.expert_mm

    def counting(xr, weight, e, *, out=None):
        seen.add(xr.shape[0])
        return real(xr, weight, e, out=out)

    monkeypatch.setattr(experts, "expert_mm", counting)
    raw: set[int] = set()
    with torch.no_grad():
        for t in torch.randint(1, 301, (200,), generator=g).tolist():
            x = torch.randn(t, 32, generator=g).to(torch.bfloat16)
            routing = layer.gate(x.float(), confidence_threshold=0.9, min_experts=1, max_experts=4,
                                 capacity_factor=None)
            raw.update(n for n in routing.counts if n)
            layer.experts(x, routing)
    assert seen <= {experts.row_bucket(n) for n in raw}
    assert len(seen) <= 20 < len(raw)
