"""The fixed-k routing path of the checkpoint MoE block (`_assign_fixed_k`) gives exactly
`gating.assign`'s Routing: same assignments, order, weights, slots and stats, with and without
renormalisation and capacity caps (a cap that drops something falls back to assign). The block
takes it at every token count in inference, and a one-token decode step stays within its tensor
op budget."""

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sparsegate_workload.gating import assign  # noqa: E402
from sparsegate_workload.hf import (  # noqa: E402
    build_tiny_checkpoint, gated_block, load_moe_checkpoint)
from sparsegate_workload.hf.gated_block import _assign_fixed_k  # noqa: E402

FIELDS = ("token_idx", "weights", "slots", "per_token", "selected", "probs", "aux_loss", "entropy")


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 1.25, 8.0])
@pytest.mark.parametrize("normalize", [True, False])
def test_fixed_k_fast_path_equals_assign(capacity_factor, normalize):
    g = torch.Generator().manual_seed(hash((capacity_factor, normalize)) % 2**31)
    for i in range(60):
        # One token in three: the single-sequence decode branch of `_assign_fixed_k`.
        # Past decode sizes too: the block takes this path at every token count.
        tokens = 1 if i % 3 == 0 else int(torch.randint(1, 65 if i % 3 == 1 else 600, (1,),
                                                        generator=g))
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


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("mixtral"), family="mixtral", seed=1,
                                 layers=1)


def test_fixed_k_block_takes_the_fast_path_at_prefill_sizes_too(mixtral, monkeypatch):
    """Measured here (1 thread, 8 experts, top-2) `_assign_fixed_k` takes about half the time of
    `assign` from 8 to 16,384 tokens; the block took it only up to 64 tokens, so a prefill paid
    `assign`'s ~40 tensor ops (bench_hf_moe at 256 tokens: route 0.93 ms)."""
    lm = load_moe_checkpoint(mixtral)  # the family's top-2, dropless
    blk = lm.blocks[0]
    flat = torch.randn(256, blk.gate.weight.shape[1], generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        probs = torch.softmax(blk.gate.logits(flat), dim=-1)
        top_p, top_e = probs.topk(blk.top_k, dim=-1)
        want = assign(probs, top_p, top_e, torch.ones_like(top_p, dtype=torch.bool),
                      capacity_factor=None, normalize=blk.renormalize)

        def refuse(*args, **kwargs):
            raise AssertionError("fixed k at 256 tokens went through assign")

        monkeypatch.setattr(gated_block, "assign", refuse)
        got = blk.route(flat, lm.gate)
    for field in FIELDS:
        a, b = getattr(want, field), getattr(got, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    assert got.counts == want.counts and sum(got.counts) == 512


def test_one_token_decode_step_stays_within_its_tensor_op_budget(mixtral):
    """A one-token block call (decode, the family's top-2) and the read of its recorded stats
    (counts and entropy, what the server reads) in at most 45 dispatched tensor ops: 63 before
    (a token's row gathered twice, the router's weight and the expert weights re-viewed every
    call, the combine weights converted to their own dtype, an order tensor built on every step,
    gathers to combine one row). At d_model 64 each op is a few microseconds, about the whole
    cost of a decode step's MoE layer: bench_decode (N = 1) 1.00 -> 1.08 x HF generate."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    lm = load_moe_checkpoint(mixtral)
    blk = lm.blocks[0]
    g = torch.Generator().manual_seed(2)
    for step in range(4):  # both orders of the two picks (with and without a permutation)
        x = torch.randn(1, 1, blk.gate.weight.shape[1], generator=g)
        with torch.inference_mode():
            with lm.pinned_gate():
                want = blk(x)  # warm: one-off caches
            with CountOps() as counted, lm.pinned_gate() as call:
                out = blk(x)
                stats = call.layers[0]
                read = (list(stats.counts), stats.entropy)
        assert torch.equal(out, want)
        assert sum(read[0]) == 2 and read[1] > 0.0
        assert len(counted.ops) <= 45, (step, len(counted.ops), counted.ops)


@pytest.mark.parametrize("group", [(3,), (1, 6), (0, 2, 5)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_masked_fixed_k_reads_allowed_with_the_counts_and_falls_back_below_k(mixtral, monkeypatch,
                                                                              group, tokens):
    """Under an expert group the fast path checks that every pick is allowed in its one host read;
    a group below k routes through the masked assign: either way the general path's routing."""
    lm = load_moe_checkpoint(mixtral)
    blk = lm.blocks[0]
    flat = torch.randn(tokens, blk.gate.weight.shape[1], generator=torch.Generator().manual_seed(7))
    allowed = torch.zeros(blk.num_experts, dtype=torch.bool)
    allowed[list(group)] = True
    with torch.inference_mode():
        fast = blk.route(flat, lm.gate, allowed)
        monkeypatch.setattr(gated_block, "FIXED_K_FAST_TOKENS", 0)  # the general `assign` only
        general = blk.route(flat, lm.gate, allowed)
    assert fast.counts == general.counts
    assert set(e for e, n in enumerate(fast.counts) if n) <= set(group)
    for field in ("token_idx", "weights", "slots", "per_token", "selected"):
        assert torch.equal(getattr(fast, field), getattr(general, field)), field
