"""Routing: top-p mass threshold, min/max bounds, capacity, baselines, losses."""

import math

import pytest
import torch

from sparsegate_workload.gating import DynamicGate, TopKGate, assign, top_p_mask


def _probs(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_top_p_picks_smallest_prefix_reaching_the_threshold():
    probs = _probs([[0.7, 0.2, 0.05, 0.05],    # 0.7 >= 0.6 -> 1 expert
                    [0.4, 0.3, 0.2, 0.1],      # 0.4 < 0.6, 0.7 >= 0.6 -> 2
                    [0.25, 0.25, 0.25, 0.25],  # 0.5 < 0.6, 0.75 -> 3
                    [0.1, 0.2, 0.3, 0.4]])     # sorted 0.4, 0.7 -> 2 (experts 3, 2)
    _, sorted_e, mask = top_p_mask(probs, threshold=0.6, min_k=1, max_k=4)
    assert mask.sum(-1).tolist() == [1, 2, 3, 2]
    assert sorted_e[3, :2].tolist() == [3, 2]
    # An exact hit counts as reaching the threshold.
    _, _, mask = top_p_mask(_probs([[0.6, 0.4, 0.0, 0.0]]), threshold=0.6, min_k=1, max_k=4)
    assert mask.sum().item() == 1


def test_min_and_max_bounds_clamp_the_expert_count():
    probs = _probs([[0.97, 0.01, 0.01, 0.01], [0.25, 0.25, 0.25, 0.25]])
    _, _, mask = top_p_mask(probs, threshold=0.9, min_k=2, max_k=3)
    assert mask.sum(-1).tolist() == [2, 3]


def test_assign_normalises_weights_over_the_chosen_set_and_groups_by_expert():
    probs = _probs([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    sp, se, mask = top_p_mask(probs, threshold=0.6, min_k=1, max_k=4)
    r = assign(probs, sp, se, mask, capacity_factor=None, normalize=True)
    assert r.counts == [1, 1, 1, 1]
    experts = [e for e, n in enumerate(r.counts) for _ in range(n)]
    pairs = sorted(zip(r.token_idx.tolist(), experts, r.weights.tolist()))
    expected = [(0, 0, 0.4 / 0.7), (0, 1, 0.3 / 0.7), (1, 2, 0.3 / 0.7), (1, 3, 0.4 / 0.7)]
    for got, want in zip(pairs, expected):
        assert got[:2] == want[:2] and got[2] == pytest.approx(want[2])
    assert r.dropped == 0 and r.capacity is None
    assert r.per_token.tolist() == [2, 2]


def test_capacity_caps_each_expert_and_drops_least_confident_assignments_first():
    # 4 tokens all prefer expert 0 as first choice; token 3 has it only as second choice.
    probs = _probs([[0.9, 0.1, 0.0, 0.0], [0.9, 0.1, 0.0, 0.0], [0.5, 0.4, 0.1, 0.0],
                    [0.45, 0.5, 0.05, 0.0]])
    sp, se, mask = top_p_mask(probs, threshold=0.8, min_k=1, max_k=4)
    assert mask.sum(-1).tolist() == [1, 1, 2, 2]
    # 6 assignments, 4 experts, factor 1.0 -> capacity ceil(6/4) = 2 per expert.
    r = assign(probs, sp, se, mask, capacity_factor=1.0, normalize=True)
    assert r.capacity == 2
    assert r.counts == [2, 2, 0, 0]
    assert r.dropped == 2
    # Expert 0 keeps the two rank-0 choices that come first (tokens 0 and 1); token 2's rank-0
    # choice and token 3's rank-1 choice of expert 0 are dropped.
    assert sorted(r.token_idx[:2].tolist()) == [0, 1]
    assert sorted(r.token_idx[2:].tolist()) == [2, 3]
    assert r.per_token.tolist() == [1, 1, 1, 1]


def test_dynamic_gate_is_vectorised_over_many_tokens_and_respects_bounds():
    g = torch.Generator().manual_seed(0)
    gate = DynamicGate(16, 8)
    gate.reset_parameters(g)
    x = torch.randn(2048, 16, generator=g) * 3
    r = gate(x, confidence_threshold=0.6, min_experts=1, max_experts=3, capacity_factor=None)
    k = r.selected
    assert k.min() >= 1 and k.max() <= 3 and len(set(k.tolist())) > 1  # really variable
    # Mass criterion, checked per token against the definition.
    top = r.probs.sort(-1, descending=True).values.cumsum(-1)
    for t in range(0, 2048, 97):
        kt = int(k[t])
        if kt < 3:
            assert top[t, kt - 1] >= 0.6 - 1e-6
        if kt > 1:
            assert top[t, kt - 2] < 0.6
    assert sum(r.counts) == int(k.sum())
    sums = torch.zeros(2048).index_add_(0, r.token_idx, r.weights)
    assert torch.allclose(sums, torch.ones(2048), atol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_topk_baseline_selects_exactly_k(k):
    g = torch.Generator().manual_seed(1)
    gate = TopKGate(16, 8, k=k)
    gate.reset_parameters(g)
    x = torch.randn(64, 16, generator=g)
    r = gate(x, capacity_factor=None)
    assert r.selected.tolist() == [k] * 64 and sum(r.counts) == 64 * k
    top = r.probs.topk(k, dim=-1)
    expert_of = torch.tensor([e for e, n in enumerate(r.counts) for _ in range(n)])
    for t in range(64):
        assert sorted(expert_of[r.token_idx == t].tolist()) == sorted(top.indices[t].tolist())
    if k == 1:  # Switch: weight is the raw gate probability
        w = torch.zeros(64).index_add_(0, r.token_idx, r.weights)
        assert torch.allclose(w, top.values[:, 0])


def test_balance_loss_is_one_when_uniform_and_entropy_is_shannon():
    probs = torch.full((8, 4), 0.25)
    sp, se = probs.sort(-1, descending=True)
    mask = torch.zeros(8, 4, dtype=torch.bool)
    mask[:, 0] = True
    se = torch.arange(8).remainder(4).unsqueeze(1).expand(8, 4).contiguous()
    r = assign(probs, sp, se, mask, capacity_factor=None, normalize=True)
    assert r.counts == [2, 2, 2, 2]
    assert r.aux_loss.item() == pytest.approx(1.0)
    assert r.entropy.item() == pytest.approx(math.log(4))


def test_recorded_entropy_is_computed_when_read_and_leaves_the_loss_differentiable():
    """A layer's stats compute the gate entropy when first read (~7 tensor ops a layer that a
    batched decode step never reads: it splits the routing per sequence itself), with the same
    value as the routing's own; a read under no_grad before the training loss still leaves
    the loss's entropy term differentiable."""
    from sparsegate_workload.moe import DynamicMoE, routing_stats

    g = torch.Generator().manual_seed(4)
    layer = DynamicMoE(16, 32, 6)
    layer.reset_parameters(g)
    x = torch.randn(20, 16, generator=g)
    with torch.inference_mode():
        _, stats = layer(x, confidence_threshold=0.7, min_experts=1, max_experts=3)
        assert "entropy" not in stats.routing.__dict__  # nothing computed yet
        want = -(stats.routing.probs * stats.routing.probs.clamp_min(1e-12).log()
                 ).sum(dim=-1).mean()
    assert stats.entropy == float(want) and isinstance(stats.entropy, float)
    _, stats = layer(x, confidence_threshold=0.7, min_experts=1, max_experts=3,
                     entropy_beta=0.5)
    with torch.no_grad():
        logged = stats.entropy
    loss = stats.entropy_loss
    assert loss.requires_grad and float(loss.detach()) == pytest.approx(0.5 * logged)
    loss.backward()
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0
    cached = routing_stats(stats.routing, entropy_beta=0.0)
    assert cached.entropy == float(stats.routing.entropy.detach())  # the loss's, reused


@pytest.mark.parametrize("threshold", [0.85, 0.6, 0.3, 0.9])
def test_tool_gate_fires_strictly_above_its_threshold_as_the_tool_calls_do(threshold):
    from sparsegate_workload.gating import tool_fires

    f32 = torch.tensor(threshold, dtype=torch.float32)
    below, above = torch.nextafter(f32, torch.tensor(0.0)), torch.nextafter(f32, torch.tensor(1.0))
    prob = torch.stack([below, f32, above])
    fired = tool_fires(prob, threshold=threshold).tolist()
    # tools.call_fired and batch_decode decide on the Python floats: the report must agree.
    assert fired == [p > threshold for p in prob.tolist()]
    assert fired[0] is False and fired[2] is True
    # default 0.85: float32(0.85) is 0.8500000238..., above 0.85, so it fires (it did not).
    assert tool_fires(torch.tensor([0.85]), threshold=0.85).tolist() == [True]
