"""Mixed precision on a Hugging Face checkpoint (tiny Mixtral, built here): real bf16/int8
storage of router and expert weights, logits close to the loaded fp32 model, the checkpoint as
the source when a block goes back up, and the article's rule on measured variances."""

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sparsegate_contracts.gate import GateParams  # noqa: E402
from sparsegate_workload.hf import build_tiny_checkpoint, load_moe_checkpoint  # noqa: E402

import transformers  # noqa: F401 - a dependency: missing, this module fails to import (never skips)

IDS = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(3))


def _gate(policy: str) -> GateParams:
    # the family's own top-2, so every precision routes the same way unless logits move
    return GateParams(min_experts_per_token=2, max_experts_per_token=2,
                      confidence_threshold=1.0, precision_policy=policy)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("mixtral"), family="mixtral", seed=1)


def _held_bytes(lm) -> int:
    total = 0
    for blk in lm.blocks:
        for w in (blk.gate.storage, *blk.expert_storage):
            total += w.data.untyped_storage().nbytes()
            if w.scale is not None:
                total += w.scale.untyped_storage().nbytes()
    return total


def test_bf16_and_int8_storage_shrink_memory_and_keep_logits_close(mixtral):
    lm = load_moe_checkpoint(mixtral, gate=_gate("fp32"), dropless=True)
    ref = lm.forward(IDS).logits
    fp32_bytes = _held_bytes(lm)
    names_fp32 = {n for n, _ in lm.model.named_parameters()}
    for policy, max_ratio, tol in (("bf16", 0.51, 0.005), ("int8", 0.30, 0.01)):
        lm.set_gate(_gate(policy), dropless=True)
        assert [blk.precisions for blk in lm.blocks] == [(policy, policy)] * 2
        held = _held_bytes(lm)
        assert held <= max_ratio * fp32_bytes
        assert sum(b.gate_bytes + b.expert_bytes for b in lm.weight_bytes()) == held
        # the loaded router and expert parameters are gone from the model
        gone = names_fp32 - {n for n, _ in lm.model.named_parameters()}
        assert len(gone) == 3 * 2 and all(n.endswith(("gate.weight", "gate_up_proj",
                                                      "down_proj")) for n in gone)
        out = lm.forward(IDS).logits
        # stated tolerance: mean |logit difference| within 0.5% (bf16) / 1% (int8) of mean |logit|
        assert float((out - ref).abs().mean() / ref.abs().mean()) <= tol
        assert float((out.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95
    # back to fp32: re-read from the checkpoint, so exactly the loaded model again
    lm.set_gate(_gate("fp32"), dropless=True)
    assert _held_bytes(lm) == fp32_bytes
    assert torch.equal(lm.forward(IDS).logits, ref)


def test_calibration_on_tokenized_text_and_the_rule_per_weight_group(mixtral):
    lm = load_moe_checkpoint(mixtral)
    lm.set_gate(_gate("int8"), dropless=True)  # calibration restores fp32 first
    lm.calibrate_gate_precision()
    assert lm.calibration_data.startswith("CALIBRATION_TEXT through its tokenizer")
    assert len(lm.gate_sensitivity) == len(lm.expert_sensitivity) == 2
    assert all(s > 0 for s in lm.gate_sensitivity + lm.expert_sensitivity)
    # calibration re-installed the int8 gate; its parameters do not train any more
    assert lm.gate.precisions == ("int8", "int8")
    assert not any(p.requires_grad for p in lm.model.parameters())
    # Constructed both sides of 1e-3: a sensitive router keeps bf16, the rest goes int8.
    lm.gate_sensitivity = [2e-3, 1e-3]
    lm.expert_sensitivity = [5e-4, 3e-3]
    lm.set_gate(_gate("auto"), dropless=True)
    assert lm.gate.precisions == ("bf16", "int8")
    assert lm.gate.expert_precisions == ("int8", "bf16")
    assert [(b.gate_precision, b.expert_precision) for b in lm.weight_bytes()] == [
        ("bf16", "int8"), ("int8", "bf16")]
    assert torch.isfinite(lm.forward(IDS).logits).all()


def test_int8_experts_under_a_float16_load_stay_finite(mixtral):
    # --model-dtype float16 with int8 experts: the matmul against the raw int8 values is
    # 1/scale times larger than against the weight and overflowed fp16 to inf (every output
    # here), while the fp16 model itself computes this block at |y| ~ 300.
    lm = load_moe_checkpoint(mixtral, gate=_gate("fp32"), dropless=True, dtype=torch.float16)
    block = lm.blocks[0]
    x = torch.randn(1, 8, block.gate.weight.shape[1],
                    generator=torch.Generator().manual_seed(0)).half()
    x[..., 3] = 1500.0  # one large activation channel
    with torch.inference_mode():
        ref = block(x).float()
        lm.set_gate(_gate("int8"), dropless=True)
        out = block(x).float()
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert float((out - ref).abs().max() / ref.abs().max()) <= 0.02


def test_int8_experts_under_a_bfloat16_load_round_their_scale_once(mixtral):
    # --model-dtype bfloat16 with int8 experts: each matmul output was scaled by the fp32
    # per-column scale rounded to bf16 (up to 0.39 % off per column, the same columns every
    # token), on top of the output's own rounding. Stored for bf16 compute, the scales lie on
    # the bf16 grid: the expert matmul equals its exact-scale product rounded once. An fp32
    # load keeps exact fp32 scales.
    from sparsegate_workload.experts import expert_mm

    for dtype, on_grid in ((torch.bfloat16, True), (torch.float32, False)):
        lm = load_moe_checkpoint(mixtral, gate=_gate("int8"), dropless=True, dtype=dtype)
        gate_up, down = lm.blocks[0].expert_storage
        for w in (gate_up, down):
            assert w.precision == "int8" and w.scale.dtype == torch.float32
            assert torch.equal(w.scale.to(torch.bfloat16).float(), w.scale) == on_grid, dtype
    x = torch.randn(6, gate_up.data.shape[1], generator=torch.Generator().manual_seed(1))
    lm = load_moe_checkpoint(mixtral, gate=_gate("int8"), dropless=True, dtype=torch.bfloat16)
    gate_up = lm.blocks[0].expert_storage[0]
    xb = x.to(torch.bfloat16)
    once = (xb @ gate_up.data[1].to(torch.bfloat16)).float().mul(gate_up.scale[1])
    assert torch.equal(expert_mm(xb, gate_up, 1), once.to(torch.bfloat16))


def test_fp32_expert_storage_is_built_once_and_follows_the_loaded_tensors(mixtral):
    """Every block call reads `expert_storage`: its fp32 views are built once per pair of loaded
    tensors (4 tensor ops a call before), rebuilt when the tensors change (a new parameter,
    a ``.data`` swap), and not kept once a lower precision drops the fp32 weights."""
    import gc
    import weakref

    lm = load_moe_checkpoint(mixtral)
    blk = lm.blocks[0]
    first = blk.expert_storage
    assert blk.expert_storage is first  # no new views per call
    gate_up = blk.experts.gate_up_proj
    assert first[0].data.data_ptr() == gate_up.data_ptr()
    # A .data swap (what Module.to does in place) is seen.
    swapped = torch.randn_like(gate_up.detach().transpose(1, 2)).contiguous().transpose(1, 2)
    gate_up.data = swapped
    assert torch.equal(blk.expert_storage[0].data, swapped.transpose(1, 2))
    # load_fp32's new parameters are seen.
    checkpoint_up = torch.randn_like(swapped)
    blk.load_fp32(gate=blk.gate.weight.detach().clone(), gate_up_proj=checkpoint_up,
                  down_proj=blk.experts.down_proj.detach().clone())
    assert torch.equal(blk.expert_storage[0].data, checkpoint_up.transpose(1, 2))
    # A lower precision drops the fp32 tensors: nothing here keeps them alive.
    dropped = weakref.ref(blk.experts.gate_up_proj)
    blk.store(gate="fp32", experts="bf16")
    del first
    gc.collect()
    assert dropped() is None
    assert blk.expert_storage[0].precision == "bf16"
