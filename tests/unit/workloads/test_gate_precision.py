"""Mixed precision: the article's per-layer rule, real int8/bf16 storage, straight-through
gradients, and the built-in model served from bf16/int8 weights."""

import pytest
import torch

from sparsegate_workload.experts import expert_mm
from sparsegate_workload.gateparams import GateParams
from sparsegate_workload.gating import DynamicGate
from sparsegate_workload.model import ModelConfig, build_model
from sparsegate_workload.precision import (SENSITIVITY_THRESHOLD, StoredWeight,
                                           choose_precision, dequantize_int8, fake_quantize,
                                           gradient_variance, quantize_int8, stored_weight)

TOKENS = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(9))


def test_rule_is_the_articles_bf16_above_the_threshold_int8_otherwise():
    assert SENSITIVITY_THRESHOLD == 1e-3
    assert choose_precision(policy="auto", sensitivity=0.0011) == "bf16"
    # the article's `grad_var > threshold`: exactly at the threshold is not sensitive
    assert choose_precision(policy="auto", sensitivity=1e-3) == "int8"
    assert choose_precision(policy="auto", sensitivity=0.0009) == "int8"
    assert choose_precision(policy="auto", sensitivity=None) == "fp32"  # never measured
    for forced in ("fp32", "bf16", "int8"):
        assert choose_precision(policy=forced, sensitivity=1.0) == forced
        assert choose_precision(policy=forced, sensitivity=0.0) == forced
    with pytest.raises(ValueError):
        choose_precision(policy="fp8", sensitivity=1.0)


def test_a_nan_variance_keeps_fp32_instead_of_reading_as_insensitive():
    # inf/NaN gradients (e.g. fp16 overflow in calibration) give a NaN variance; NaN > 1e-3 is
    # False, which picked int8, the fewest bits, for the layer whose gradients blew up.
    blown = gradient_variance([torch.tensor([1.0, float("inf")]), torch.tensor([2.0, 1.0])])
    assert blown != blown  # NaN
    assert choose_precision(policy="auto", sensitivity=blown) == "fp32"
    assert choose_precision(policy="auto", sensitivity=float("inf")) == "bf16"
    assert choose_precision(policy="int8", sensitivity=blown) == "int8"  # forced still wins


def test_gradient_variance_is_the_mean_elementwise_sample_variance():
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([3.0, 0.0])]
    assert gradient_variance(grads) == pytest.approx((2.0 + 0.0) / 2)
    many = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(1))
    assert gradient_variance(many) == pytest.approx(float(many.var(dim=0).mean()), rel=1e-5)
    with pytest.raises(ValueError):
        gradient_variance(grads[:1])


def test_gradient_variance_of_huge_gradients_stays_finite():
    # Gradients ~1e19-4e19 (a scaled loss): the squared deviation (~1e38+) overflowed the fp32
    # accumulator to inf, and the precision file could not be written (JSON has no inf).
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(64, 32, generator=g) * 2e19 for _ in range(4)]
    expected = float(torch.stack(grads).double().var(dim=0).mean())
    assert 1e38 < gradient_variance(grads) == pytest.approx(expected, rel=1e-6)
    assert choose_precision(policy="auto", sensitivity=gradient_variance(grads)) == "bf16"
    # inf gradients are a failed measurement, never an infinite (bf16) one: NaN, auto keeps fp32
    blown = gradient_variance([torch.full((3,), float("inf")), torch.ones(3)])
    assert blown != blown


def test_int8_scales_are_exact_in_bf16_for_bf16_compute():
    # A bf16 model computes in bf16: the per-column scale cast to bf16 rounded it (up to 0.39 %)
    # on top of the product's own rounding; stored for bf16 compute (bf16_scale, what a bf16
    # checkpoint's experts use), the scale lies on the bf16 grid, so bf16 dequantisation and
    # the expert matmul round once. Otherwise the scale stays exact (fp32 compute uses it).
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(4, 256, 96, generator=g) * torch.logspace(-3, 0, 96)).to(torch.bfloat16)
    stored = StoredWeight.store(w, "int8", in_dim=1, bf16_scale=True)
    assert stored.scale.dtype == torch.float32
    exact_scale = StoredWeight.store(w, "int8", in_dim=1).scale
    assert exact_scale.to(torch.bfloat16).float().ne(exact_scale).any()
    assert torch.equal(stored.scale.to(torch.bfloat16).float(), stored.scale)
    exact = stored.materialize(torch.float32)
    assert torch.equal(stored.materialize(torch.bfloat16), exact.to(torch.bfloat16))
    x = torch.randn(8, 256, generator=g).to(torch.bfloat16)
    y = expert_mm(x, stored, 2)
    assert torch.equal(y, (x @ stored.data[2].to(torch.bfloat16)).float().mul(
        stored.scale[2]).to(torch.bfloat16))
    # still half a step of the scale used, and every column uses its full range
    assert ((exact - w.float()).abs() <= stored.scale / 2 + 1e-12).all()
    assert (stored.data.abs().amax(dim=1) == 127).all()


def test_int8_columns_with_tiny_scales_survive_fp16_dequantisation():
    # fp16 (min normal 6.1e-5): a column of max |w| ~1e-6 has scale ~8e-9, which cast to fp16
    # was 0, a zeroed column (the grouped expert backend dequantises whole weights so); the
    # product itself is representable.
    g = torch.Generator().manual_seed(6)
    tiny = StoredWeight.store(torch.randn(1, 64, 8, generator=g) * 1e-6, "int8", in_dim=1)
    half = tiny.materialize(torch.float16)
    ref = tiny.materialize(torch.float32)
    assert (half.float().abs().amax(dim=1) > 0).all()
    assert float((half.float() - ref).abs().max() / ref.abs().max()) < 0.05


def test_int8_round_trip_is_bounded_per_output_channel():
    g = torch.Generator().manual_seed(0)
    # Rows of very different magnitude: a per-tensor scale would crush the small ones.
    w = torch.randn(8, 64, generator=g) * torch.logspace(-3, 1, 8).unsqueeze(1)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (8, 1)
    assert (q.abs().amax(dim=1) == 127).all()  # every channel uses its full range
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale / 2 + 1e-7).all()
    # relative to each channel's own max: at most half a step of 1/127
    assert ((err.amax(dim=1) / w.abs().amax(dim=1)) <= 0.5 / 127 + 1e-6).all()
    # stacked expert weights [E, in, out]: one scale per (expert, out column)
    stacked = torch.randn(4, 16, 32, generator=g)
    q3, s3 = quantize_int8(stacked, in_dim=1)
    assert s3.shape == (4, 1, 32)
    assert ((dequantize_int8(q3, s3) - stacked).abs() <= s3 / 2 + 1e-7).all()
    bf = stored_weight(w, "bf16")
    assert torch.equal(bf, w.to(torch.bfloat16).float()) and not torch.equal(bf, w)


def test_int8_expert_matmul_in_fp16_does_not_overflow():
    # x @ q is 1/scale (here ~2,000x) larger than x @ w: with fp16 activations (--model-dtype
    # float16) it went to inf although the true output (~40) fits fp16 easily.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 256, 32, generator=g) * 0.02       # [E, in, out]
    x = torch.randn(4, 256, generator=g)
    x[:, 7] = 1000.0                                       # one large activation channel
    stored = StoredWeight.store(w, "int8", in_dim=1)
    ref = x @ stored.materialize(torch.float32, 0)         # the dequantised weight, fp32
    assert float(ref.abs().max()) < 100
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        out = torch.empty(4, 32, dtype=dtype)
        y = expert_mm(x.to(dtype), stored, 0, out=out)
        assert y.data_ptr() == out.data_ptr()
        assert torch.isfinite(y).all(), dtype
        assert float((y.float() - ref).abs().max() / ref.abs().max()) <= tol, dtype


def test_stored_weight_holds_the_bytes_of_its_dtype():
    w = torch.randn(8, 64)
    fp32, bf16, int8 = (StoredWeight.store(w, p) for p in ("fp32", "bf16", "int8"))
    assert fp32.data.data_ptr() == w.data_ptr()  # fp32 storage is the tensor itself
    assert (bf16.data.dtype, int8.data.dtype, int8.scale.dtype) == (
        torch.bfloat16, torch.int8, torch.float32)
    assert bf16.data.untyped_storage().nbytes() == 8 * 64 * 2
    assert int8.data.untyped_storage().nbytes() + int8.scale.untyped_storage().nbytes() \
        == 8 * 64 + 8 * 4 == int8.nbytes


def test_fake_quantisation_passes_gradients_straight_through():
    w = torch.randn(4, 8, requires_grad=True)
    fake_quantize(w, "int8").sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_frozen_router_stores_int8_without_an_fp32_copy():
    g = torch.Generator().manual_seed(0)
    gate = DynamicGate(32, 8)
    gate.reset_parameters(g)
    gate.requires_grad_(False)
    x = torch.randn(10, 32, generator=g)
    bf16 = stored_weight(gate.weight, "bf16")
    # a router on its own converts from what it stores: int8 after bf16 quantises bf16 values
    expected = {"fp32": x @ gate.weight.T, "bf16": x @ bf16.T,
                "int8": x @ stored_weight(bf16, "int8").T}
    for precision in ("fp32", "bf16", "int8"):
        logits = gate.logits(x, precision)
        assert logits.dtype == torch.float32 and gate.storage.precision == precision
        assert torch.allclose(logits, expected[precision], atol=1e-6)
    assert gate.weight is None and list(gate.parameters()) == []
    with pytest.raises(ValueError, match="load_fp32"):
        gate.logits(x, "fp32")  # the fp32 values are gone; only the model's source has them


def test_training_router_keeps_fp32_and_follows_in_place_updates():
    gate = DynamicGate(8, 4)
    gate.reset_parameters(torch.Generator().manual_seed(0))
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = gate.logits(x, "int8")
        gate.weight.mul_(2)  # e.g. an optimizer step
        after = gate.logits(x, "int8")
    assert torch.allclose(after, 2 * before, atol=1e-4)
    assert gate.weight is not None and gate.weight.dtype == torch.float32


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(seed=0))


def _logits(model, policy: str) -> torch.Tensor:
    with torch.inference_mode():
        return model(TOKENS, gate=GateParams(precision_policy=policy),
                     precisions=model.resolve_precisions(policy)).logits


def test_auto_measures_both_sides_of_the_threshold_and_stores_accordingly(model):
    # The seeded model's routers vary above 1e-3, its experts below: both cases of the rule.
    assert all(s > SENSITIVITY_THRESHOLD for s in model.gate_sensitivity)
    assert all(0 < s < SENSITIVITY_THRESHOLD for s in model.expert_sensitivity)
    assert model.resolve_precisions("auto") == ("bf16", "bf16")
    assert model.resolve_expert_precisions("auto") == ("int8", "int8")
    _logits(model, "auto")
    assert [(b.gate_precision, b.expert_precision) for b in model.weight_bytes()] == [
        ("bf16", "int8")] * 2
    assert build_model(ModelConfig(seed=0)).gate_sensitivity == model.gate_sensitivity


def _held_bytes(model) -> int:
    """Bytes of every MoE weight tensor the layers hold, read from the tensors themselves."""
    total = 0
    for blk in model.blocks:
        for w in (blk.moe.gate.storage, *blk.moe.experts.storage):
            total += w.data.untyped_storage().nbytes()
            if w.scale is not None:
                total += w.scale.untyped_storage().nbytes()
    return total


def test_memory_really_drops_and_outputs_stay_close(model):
    ref = _logits(model, "fp32")
    fp32_bytes = _held_bytes(model)
    fp32_params = sum(p.numel() * p.element_size() for p in model.parameters())
    for policy, max_ratio, tol in (("bf16", 0.51, 0.01), ("int8", 0.30, 0.03)):
        out = _logits(model, policy)
        held = _held_bytes(model)
        assert held <= max_ratio * fp32_bytes
        report = model.weight_bytes()
        assert sum(b.gate_bytes + b.expert_bytes for b in report) == held
        assert sum(b.gate_fp32_bytes + b.expert_fp32_bytes for b in report) == fp32_bytes
        # the fp32 parameters are gone from the module, not kept beside the stored copy
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert fp32_params - params == fp32_bytes
        # stated tolerance: mean |logit difference| within 1% (bf16) / 3% (int8) of mean |logit|
        rel = float((out - ref).abs().mean() / ref.abs().mean())
        assert rel <= tol, (policy, rel)
        agree = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
        assert agree >= 0.9, (policy, agree)


def test_switching_back_re_derives_from_the_seed_whatever_the_order(model):
    fresh_int8 = _logits(build_model(ModelConfig(seed=0), gate=GateParams(
        precision_policy="int8")), "int8")
    ref = _logits(build_model(ModelConfig(seed=0), gate=GateParams(precision_policy="fp32")),
                  "fp32")
    for policy in ("bf16", "fp32", "int8", "bf16", "int8"):
        _logits(model, policy)
    assert torch.equal(_logits(model, "int8"), fresh_int8)
    assert torch.equal(_logits(model, "fp32"), ref)
