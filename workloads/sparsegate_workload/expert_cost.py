"""Per-expert hardware cost for hardware-aware routing (gate param ``hardwareCostLambda``).

Each MoE layer keeps one `ExpertCost`: an EWMA of the measured wall time per routed row of each
expert's FFN (timed in the block's inference dispatch loop), times a placement factor per expert
(e.g. 2.0 for an expert held in a slower precision or on a slower device; 1.0 by default; for a
checkpoint with ``--expert-placement-json`` measured at load by `hf.placement`) and
``1 + queue_weight * queue_depth`` (0: nothing reports queue depths, the server has no
per-expert queue). `vector()` divides by
the largest, so costs lie in [0, 1] and the gate's lambda has the same scale on any machine.

On CPU the timing is the expert's real compute time. On an accelerator a host timer would see
kernel launch time only (no synchronisation is added to the hot loop): about the same per
expert whatever its rows, so per row it would make the least-loaded experts look the costliest.
The dispatch therefore records no time there (`experts.dispatch_sorted`), every expert keeps
the same measured part, and the placement factor alone differentiates experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Weight of the newest sample: ~10 dispatches of memory, so a slow expert is seen within a
# few batches and one noisy sample moves the cost by a fifth at most.
DEFAULT_ALPHA = 0.2


class ExpertCost:
    """Normalised per-expert cost of one MoE layer, from measured time and placement."""

    def __init__(self, num_experts: int, *, alpha: float = DEFAULT_ALPHA,
                 queue_weight: float = 0.0) -> None:
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.num_experts = num_experts
        self.alpha = alpha
        self.queue_weight = queue_weight
        self.seconds_per_row: list[float | None] = [None] * num_experts
        self.placement: list[float] = [1.0] * num_experts
        self.queue_depth: list[float] = [0.0] * num_experts
        self._vector: torch.Tensor | None = None
        self._copies: dict[torch.device, torch.Tensor] = {}  # of _vector, per other device

    def record(self, expert: int, seconds: float, rows: int) -> None:
        """One timed call of `expert` over `rows` routed rows."""
        if rows <= 0:
            return
        sample = seconds / rows
        old = self.seconds_per_row[expert]
        self.seconds_per_row[expert] = sample if old is None else (
            old + self.alpha * (sample - old))
        self._vector = None

    def set_placement(self, factors: Sequence[float]) -> None:
        """Per-expert placement multipliers (> 0): precision/device slowdown relative to 1.0."""
        if len(factors) != self.num_experts or any(not f > 0 for f in factors):
            raise ValueError(f"placement needs {self.num_experts} factors > 0, got {factors!r}")
        self.placement = [float(f) for f in factors]
        self._vector = None

    def set_queue_depth(self, depths: Sequence[float]) -> None:
        if len(depths) != self.num_experts or any(d < 0 for d in depths):
            raise ValueError(f"queue depth needs {self.num_experts} values >= 0, got {depths!r}")
        self.queue_depth = [float(d) for d in depths]
        self._vector = None

    def raw(self) -> list[float]:
        """Unnormalised cost per expert; an expert never timed takes the mean of those timed
        (1.0 when none was), so it is neither favoured nor avoided before its first call."""
        timed = [s for s in self.seconds_per_row if s is not None]
        fill = sum(timed) / len(timed) if timed else 1.0
        return [(fill if s is None else s) * p * (1.0 + self.queue_weight * q)
                for s, p, q in zip(self.seconds_per_row, self.placement, self.queue_depth)]

    def vector(self, device: torch.device | None = None) -> torch.Tensor:
        """[E] fp32 costs in [0, 1] (divided by the largest), on ``device`` (default CPU);
        cached until the next update, per device: a routing on CUDA copies it to the GPU once,
        not every layer call (a blocking host-to-device copy synchronises the stream)."""
        if self._vector is None:
            raw = self.raw()
            top = max(raw)
            self._vector = torch.tensor([r / top if top > 0 else 0.0 for r in raw],
                                        dtype=torch.float32)
            self._copies = {}
        if device is None or torch.device(device) == self._vector.device:
            return self._vector
        device = torch.device(device)
        copy = self._copies.get(device)
        if copy is None:
            copy = self._copies[device] = self._vector.to(device)
        return copy


def biased_selection_probs(logits: torch.Tensor, cost: torch.Tensor | None,
                           cost_lambda: float) -> torch.Tensor | None:
    """softmax(logits - lambda * cost) for the expert selection, or None when lambda is 0 or
    there is no cost (the caller then selects on the unbiased probabilities, bit-identical)."""
    if cost_lambda <= 0.0 or cost is None:
        return None
    return torch.softmax(logits - cost_lambda * cost.to(logits.device, logits.dtype), dim=-1)
