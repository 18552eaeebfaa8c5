"""Per-layer storage precision of MoE weights: the router (gate) weight and the expert weights.

Rule (design article, "混合精度门控权重部署"): ``assign_precision(grad_var, threshold=0.001)``
keeps FP16 where a weight's gradient variance is above the threshold and stores INT8 otherwise.
Here the high-variance side is bf16 (this project's 16-bit type; the article keeps a 16-bit
type, not fp32), and the rule is applied per layer to each weight group apart (the router
weight, the expert weights) from variances measured on calibration batches of the loaded
model. The policies fp32 / bf16 / int8 force one precision for every layer; ``auto`` applies
the rule. A layer never measured is not guessed at: ``auto`` keeps it fp32.

Storage is real: a `StoredWeight` holds a bf16 tensor, or an int8 tensor plus one fp32 scale
per output channel (symmetric, weight-only), and a module stored that way keeps no fp32 copy.
Compute dequantises per use into the activation dtype; routing logits and their softmax stay
fp32. Training (parameters that require grad) keeps fp32 parameters and applies the same
rounding as fake quantisation with a straight-through estimator, so gradients still flow.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Literal

import torch

Precision = Literal["fp32", "bf16", "int8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "int8")
SENSITIVITY_THRESHOLD = 1e-3
# Lower rank = fewer bits; converting towards a higher rank needs the weights' source.
_RANK = {"int8": 0, "bf16": 1, "fp32": 2}


def choose_precision(*, policy: str, sensitivity: float | None,
                     threshold: float = SENSITIVITY_THRESHOLD) -> Precision:
    """Forced policies win; ``auto``: variance above `threshold` -> bf16, otherwise int8 (the
    article's ``>``); an unmeasured weight (None) stays fp32, and so does a failed measurement
    (NaN, e.g. from inf/NaN gradients)."""
    if policy in PRECISIONS:
        return policy  # type: ignore[return-value]
    if policy != "auto":
        raise ValueError(f"unknown precision policy {policy!r}")
    # NaN compares False with ">", which would pick int8, the fewest bits, for a layer whose
    # gradients blew up: not measured is not guessed at.
    if sensitivity is None or math.isnan(sensitivity):
        return "fp32"
    return "bf16" if sensitivity > threshold else "int8"


def is_lower(a: Precision, b: Precision) -> bool:
    """True when `a` keeps fewer bits than `b` (so `b` storage can be converted to `a`)."""
    return _RANK[a] < _RANK[b]


def gradient_variance(grads: Iterable[torch.Tensor]) -> float:
    """Mean over elements of the across-batch variance of a weight's gradient."""
    acc = RunningVariance()
    for g in grads:
        acc.add(g)
    return acc.variance()


class RunningVariance:
    """Element-wise sample variance over a stream of same-shaped tensors (Welford), so a
    calibration holds two float64 tensors per weight instead of every batch's gradient.

    float64, not fp32: a squared deviation of gradients beyond ~1.8e19 (a large loss scale,
    an exploding layer) overflowed fp32 to inf, and the variance with it; in float64 any
    finite fp32/bf16/fp16 gradient's variance stays finite. Inf/NaN gradients give NaN."""

    def __init__(self) -> None:
        self.count = 0
        self._mean: torch.Tensor | None = None
        self._m2: torch.Tensor | None = None

    def add(self, sample: torch.Tensor) -> None:
        x = sample.detach().double()
        self.count += 1
        if self._mean is None or self._m2 is None:
            self._mean, self._m2 = x.clone(), torch.zeros_like(x)
            return
        delta = x - self._mean
        self._mean += delta / self.count
        self._m2 += delta * (x - self._mean)

    def variance(self) -> float:
        """Mean over elements of the unbiased variance; needs at least two samples. NaN when
        it is not finite (inf/NaN gradients): `choose_precision` then keeps the layer fp32."""
        if self.count < 2 or self._m2 is None:
            raise ValueError("gradient variance needs at least two gradient samples")
        v = float((self._m2 / (self.count - 1)).mean())
        return v if math.isfinite(v) else math.nan


def quantize_int8(weight: torch.Tensor, *, in_dim: int = -1, bf16_scale: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per output channel: the max |w| over `in_dim` (the
    reduced, input dimension) maps to 127. Returns (int8 values, scale with `in_dim` kept as 1).

    ``bf16_scale`` (for a weight that bf16 activations will use): the scale is rounded to the
    nearest bf16 value first (still an fp32 tensor) and the values against it, so bf16 compute
    casts it exactly instead of rounding it (up to 0.39 % per column) on top of the product's
    own rounding. The error stays within half a step of the scale used, a step at most 0.39 %
    coarser than the exact one, which fp32 compute keeps."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=in_dim, keepdim=True).clamp_min(1e-12) / 127.0
    if bf16_scale:
        scale = scale.to(torch.bfloat16).float()
    q = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype == torch.float16:
        # fp16's smallest normal is 6.1e-5: a small column's scale cast to fp16 went subnormal
        # or to 0 (a zeroed column); the product in fp32 math, rounded once, fits.
        return q.to(dtype).mul_(scale)
    return q.to(dtype) * scale.to(dtype)  # bf16: exact for a bf16_scale (quantize_int8)


@dataclasses.dataclass(frozen=True)
class StoredWeight:
    """A weight as stored: ``data`` in its storage dtype (int8 with ``scale``, bf16, or the
    full-precision tensor itself for "fp32"). Immutable, so a module swaps it by reference and a
    forward that read it once keeps a consistent weight.

    For Hugging Face checkpoints "fp32" means the dtype the checkpoint was loaded in (a bf16
    load stays bf16); `precision` records what was asked, not the dtype."""

    precision: Precision
    data: torch.Tensor
    scale: torch.Tensor | None = None   # int8 only: fp32, `in_dim` of data kept as size 1

    @classmethod
    def store(cls, weight: torch.Tensor, precision: Precision, *, in_dim: int = -1,
              bf16_scale: bool = False) -> "StoredWeight":
        """Store `weight` (detached) in `precision`; "fp32" keeps the tensor itself, no copy.
        ``bf16_scale``: int8 scales exact in bf16 (`quantize_int8`), for bf16 compute."""
        w = weight.detach()
        if precision == "fp32":
            return cls("fp32", w)
        if precision == "bf16":
            return cls("bf16", w.to(torch.bfloat16).contiguous())
        if precision == "int8":
            q, scale = quantize_int8(w, in_dim=in_dim, bf16_scale=bf16_scale)
            return cls("int8", q.contiguous(), scale.contiguous())
        raise ValueError(f"unknown precision {precision!r}")

    def materialize(self, dtype: torch.dtype = torch.float32, index: int | None = None
                    ) -> torch.Tensor:
        """The weight (or expert `index` of a stacked one) in `dtype`; a fresh tensor unless
        the storage already is `dtype` (then a view of it)."""
        data = self.data if index is None else self.data[index]
        if self.scale is None:
            return data if data.dtype == dtype else data.to(dtype)
        scale = self.scale if index is None else self.scale[index]
        return dequantize_int8(data, scale, dtype)

    @property
    def numel(self) -> int:
        return self.data.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors actually held (data and scales), read from the tensors."""
        total = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            total += self.scale.numel() * self.scale.element_size()
        return total


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """One MoE layer's gate and expert weight bytes as stored now, and as fp32 would hold
    them (numel x 4), with the precision of each group."""

    layer: int
    gate_precision: Precision
    expert_precision: Precision
    gate_bytes: int
    gate_fp32_bytes: int
    expert_bytes: int
    expert_fp32_bytes: int

    def to_json(self) -> dict[str, object]:
        return {"layer": self.layer, "gatePrecision": self.gate_precision,
                "expertPrecision": self.expert_precision, "gateBytes": self.gate_bytes,
                "gateFp32Bytes": self.gate_fp32_bytes, "expertBytes": self.expert_bytes,
                "expertFp32Bytes": self.expert_fp32_bytes}


def layer_bytes(layer: int, gate: StoredWeight, experts: Iterable[StoredWeight]) -> LayerBytes:
    experts = list(experts)
    precisions = {w.precision for w in experts}
    if len(precisions) != 1:
        raise ValueError(f"expert weights of layer {layer} mix precisions {sorted(precisions)}")
    return LayerBytes(layer=layer, gate_precision=gate.precision,
                      expert_precision=precisions.pop(), gate_bytes=gate.nbytes,
                      gate_fp32_bytes=4 * gate.numel,
                      expert_bytes=sum(w.nbytes for w in experts),
                      expert_fp32_bytes=4 * sum(w.numel for w in experts))


def stored_weight(weight: torch.Tensor, precision: Precision, *, in_dim: int = -1
                  ) -> torch.Tensor:
    """What the weight becomes after storage in `precision`, back in fp32 (no autograd)."""
    return StoredWeight.store(weight.detach().float(), precision, in_dim=in_dim).materialize(
        torch.float32).clone()


def fake_quantize(weight: torch.Tensor, precision: Precision, *, in_dim: int = -1
                  ) -> torch.Tensor:
    """Rounded forward, identity backward (straight-through estimator)."""
    if precision == "fp32":
        return weight
    return weight + (stored_weight(weight, precision, in_dim=in_dim) - weight).detach()
