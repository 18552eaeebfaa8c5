"""Proportional-integral control of the top-p threshold, to hold a target mean experts per token.

With a fixed ``confidenceThreshold`` the compute a dynamic gate spends follows the traffic:
inputs the router is unsure about (flatter gate distributions) take more experts. DTop-p MoE
(2025) instead fixes the *sparsity* and lets the threshold move: a PI controller compares the
mean experts per token measured on recent batches with a target and adjusts the threshold.

For fixed inputs the mean experts per token never decreases as the threshold rises (the top-p
prefix only grows), so the loop uses a positive gain: too few experts -> raise the threshold.

    error      e_t = target - measured_t
    integral   I_t = I_{t-1} + e_t        (not kept when the output would pass a bound and
                                           e_t pushes it further: anti-windup)
    threshold  p_t = clamp(p_0 + kp * e_t + ki * I_t, min_threshold, max_threshold)

Feed it the gate's *selected* experts per token (before any capacity cap: the cap is not what
the threshold controls), e.g. `hf.gated_block.GateCall.mean_selected_experts`. Pure Python,
no torch: the model server or a test calls `update` once per batch and routes the next batch
with `threshold`.
"""

from __future__ import annotations

import dataclasses
import math

from sparsegate_contracts.gate import GateParams


class ThresholdControlError(ValueError):
    """Invalid controller settings; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ThresholdControl:
    """Controller settings. Gains are in threshold units per expert of error (per batch)."""

    target_experts: float
    kp: float = 0.05
    ki: float = 0.05
    min_threshold: float = 0.05
    max_threshold: float = 0.99

    def __post_init__(self) -> None:
        def finite(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ThresholdControlError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        if finite("target_experts") < 1.0:
            raise ThresholdControlError(
                f"target_experts must be >= 1 (a token takes at least one expert), "
                f"got {self.target_experts}")
        for name in ("kp", "ki"):
            if finite(name) < 0:
                raise ThresholdControlError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kp == 0 and self.ki == 0:
            raise ThresholdControlError("kp and ki must not both be 0 (nothing would move)")
        lo, hi = finite("min_threshold"), finite("max_threshold")
        if not 0.0 < lo <= hi <= 1.0:
            raise ThresholdControlError(
                f"min_threshold ({lo}) and max_threshold ({hi}) must satisfy "
                f"0 < min_threshold <= max_threshold <= 1")


class ThresholdController:
    """Stateful PI loop around one gate's threshold (one instance per served gate)."""

    def __init__(self, control: ThresholdControl, *, initial_threshold: float) -> None:
        if not control.min_threshold <= initial_threshold <= control.max_threshold:
            raise ThresholdControlError(
                f"initial_threshold must be in [{control.min_threshold}, "
                f"{control.max_threshold}], got {initial_threshold}")
        self.control = control
        self.base = float(initial_threshold)
        self.integral = 0.0
        self.threshold = float(initial_threshold)
        self.saturated = False       # the last output was clamped to a bound
        self.updates = 0

    def update(self, measured_experts: float) -> float:
        """Take the mean selected experts per token of the batch just routed with `threshold`;
        return the threshold for the next batch."""
        if not math.isfinite(measured_experts) or measured_experts < 0:
            raise ThresholdControlError(
                f"measured_experts must be a finite number >= 0, got {measured_experts}")
        c = self.control
        error = c.target_experts - measured_experts
        candidate = self.integral + error
        raw = self.base + c.kp * error + c.ki * candidate
        # Conditional integration: keep the new integral unless the output saturates and the
        # error pushes it further into the bound (then the integral would only wind up).
        if not ((raw > c.max_threshold and error > 0) or (raw < c.min_threshold and error < 0)):
            self.integral = candidate
        self.threshold = min(max(raw, c.min_threshold), c.max_threshold)
        self.saturated = self.threshold != raw
        self.updates += 1
        return self.threshold

    def params(self, params: GateParams) -> GateParams:
        """`params` with the controlled threshold in place of its ``confidenceThreshold``."""
        return dataclasses.replace(params, confidence_threshold=self.threshold)
