"""Per-layer precision of gate (router) weights.

Rule (from the design article): a layer whose gate-weight gradient variance is at or above
SENSITIVITY_THRESHOLD (0.001) is *sensitive* and keeps fp32; a less sensitive layer stores its
gate weight as int8 (weight-only, symmetric, one fp32 scale per expert row). The policies
fp32 / bf16 / int8 force one precision for every layer; ``auto`` applies the rule. bf16 is never
chosen by ``auto`` (the rule has a single threshold); it is available as an explicit policy.

Weight-only means the weight is *stored* in that precision and dequantized to fp32 for the
matmul, so routing logits and the softmax always run in fp32. In training the same rounding is
applied as fake quantization with a straight-through estimator, so gradients still flow.
"""

from __future__ import annotations

from typing import Iterable, Literal

import torch

Precision = Literal["fp32", "bf16", "int8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "int8")
SENSITIVITY_THRESHOLD = 1e-3


def choose_precision(*, policy: str, sensitivity: float,
                     threshold: float = SENSITIVITY_THRESHOLD) -> Precision:
    if policy in PRECISIONS:
        return policy  # type: ignore[return-value]
    if policy != "auto":
        raise ValueError(f"unknown precision policy {policy!r}")
    return "fp32" if sensitivity >= threshold else "int8"


def gradient_variance(grads: Iterable[torch.Tensor]) -> float:
    """Mean over elements of the across-batch variance of a weight's gradient."""
    stacked = torch.stack([g.detach().float() for g in grads])
    if stacked.shape[0] < 2:
        raise ValueError("gradient variance needs at least two gradient samples")
    return float(stacked.var(dim=0, unbiased=True).mean())


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: returns (int8 values, fp32 scale per row)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
    q = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def stored_weight(weight: torch.Tensor, precision: Precision) -> torch.Tensor:
    """What the weight becomes after storage in `precision`, back in fp32 (no autograd)."""
    w = weight.detach().float()
    if precision == "fp32":
        return w.clone()
    if precision == "bf16":
        return w.to(torch.bfloat16).float()
    if precision == "int8":
        return dequantize_int8(*quantize_int8(w))
    raise ValueError(f"unknown precision {precision!r}")


def fake_quantize(weight: torch.Tensor, precision: Precision) -> torch.Tensor:
    """Rounded forward, identity backward (straight-through estimator)."""
    if precision == "fp32":
        return weight
    return weight + (stored_weight(weight, precision) - weight).detach()
