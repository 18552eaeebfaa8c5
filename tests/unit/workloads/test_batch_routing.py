"""The decode-sized fixed-k routing path of the checkpoint MoE block (`_assign_fixed_k`) gives
exactly `gating.assign`'s Routing: same assignments, order, weights, slots and stats, with and
without renormalisation and capacity caps (a cap that drops something falls back to assign)."""

import pytest
import torch

from sparsegate_workload.gating import assign
from sparsegate_workload.hf.gated_block import _assign_fixed_k

FIELDS = ("token_idx", "weights", "slots", "per_token", "selected", "probs", "aux_loss", "entropy")


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 1.25, 8.0])
@pytest.mark.parametrize("normalize", [True, False])
def test_fixed_k_fast_path_equals_assign(capacity_factor, normalize):
    g = torch.Generator().manual_seed(hash((capacity_factor, normalize)) % 2**31)
    for i in range(60):
        # One token in three: the single-sequence decode branch of `_assign_fixed_k`.
        tokens = 1 if i % 3 == 0 else int(torch.randint(1, 65, (1,), generator=g))
        experts = int(torch.randint(2, 17, (1,), generator=g))
        k = int(torch.randint(1, experts + 1, (1,), generator=g))
        probs = torch.softmax(torch.randn(tokens, experts, generator=g) * 3, dim=-1)
        top_p, top_e = probs.topk(k, dim=-1)
        want = assign(probs, top_p, top_e, torch.ones_like(top_p, dtype=torch.bool),
                      capacity_factor=capacity_factor, normalize=normalize)
        got = _assign_fixed_k(probs, top_p, top_e, capacity_factor=capacity_factor,
                              normalize=normalize)
        for field in FIELDS:
            a, b = getattr(want, field), getattr(got, field)
            assert a.dtype == b.dtype and torch.equal(a, b), (field, tokens, experts, k)
        assert (got.counts, got.dropped, got.capacity) == (want.counts, want.dropped,
                                                          want.capacity)
