"""MoE feed-forward layers: dynamic top-p (the product), fixed top-1/top-2 and dense baselines.

All take x [..., d] and return (y [..., d], MoEStats). The dense layer reports k = 1 so a
benchmark can treat every layer alike.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .expert_cost import ExpertCost
from .experts import DenseSwiGLU, SwiGLUExperts
from .gating import DynamicGate, Routing, TopKGate
from .precision import LayerBytes, Precision, layer_bytes


@dataclasses.dataclass
class MoEStats:
    counts: list[int]               # kept tokens per expert
    num_tokens: int
    mean_selected: float            # experts chosen per token by the gate (before capacity)
    mean_active: float              # experts that actually processed each token
    dropped: int                    # assignments removed by the capacity cap
    entropy: float | None           # mean gate entropy (nats); see `_entropy_property`
    routing: Routing | None = None  # the layer's routing (None: a dense layer, no regularisers)
    entropy_beta: float = 0.0

    @property
    def aux_loss(self) -> torch.Tensor:
        """Load-balance loss (differentiable); computed when read, i.e. in training."""
        return self.routing.aux_loss if self.routing is not None else torch.zeros(())

    @property
    def entropy_loss(self) -> torch.Tensor:
        """beta * entropy (differentiable); minimised -> sharper gate."""
        if self.routing is None:
            return torch.zeros(())
        return self.entropy_beta * self.routing.entropy

    @property
    def drop_rate(self) -> float:
        total = sum(self.counts) + self.dropped
        return self.dropped / total if total else 0.0


def _entropy_property() -> property:
    """`MoEStats.entropy` may be given as a 0-d tensor and is read as a float: converted on
    first read, so a block recording its stats does not wait for the device (on CUDA a float()
    there was a second host sync per layer, after the dispatch, beside the counts'). None (a
    routed layer's, `routing_stats`): computed from the routing when first read, so a forward
    whose per-layer entropy nobody reads (a batched decode step splits the routing per sequence
    instead) runs none of its ~7 tensor ops per layer."""

    def get(self: MoEStats) -> float:
        value = self._entropy
        if value is None:
            routing = self.routing
            # Routing.entropy when already computed (a training loss read it), else the same
            # formula without caching a no-grad tensor where the loss may still want a graph.
            value = routing.__dict__.get("entropy")
            if value is None:
                with torch.no_grad():
                    value = type(routing).entropy.func(routing)
            if value.requires_grad:
                value = value.detach()
        if isinstance(value, torch.Tensor):
            value = self._entropy = float(value)
        return value

    def set_(self: MoEStats, value: float | torch.Tensor) -> None:
        self._entropy = value

    return property(get, set_)


MoEStats.entropy = _entropy_property()  # type: ignore[assignment]  # after @dataclass: a field


def routing_stats(routing: Routing, *, entropy_beta: float) -> MoEStats:
    """A routed layer's stats from its routing (both the built-in and the checkpoint blocks)."""
    n = routing.num_tokens
    kept = routing.num_assignments
    return MoEStats(counts=routing.counts, num_tokens=n,
                    mean_selected=(kept + routing.dropped) / max(n, 1),
                    mean_active=kept / max(n, 1), dropped=routing.dropped,
                    entropy=None, routing=routing,
                    entropy_beta=entropy_beta)


class _StoredMoE(nn.Module):
    """Storage of a routed MoE layer's weights (router + experts), see precision.py."""

    gate: DynamicGate | TopKGate
    experts: SwiGLUExperts

    def store(self, *, gate: Precision, experts: Precision) -> None:
        """Hold the router weight in `gate` and the expert weights in `experts` precision."""
        self.gate.store(gate)
        self.experts.store(experts)

    def load_fp32(self, *, gate: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor) -> None:
        """Re-materialise every weight in full precision (from the model's source)."""
        self.gate.load_fp32(gate)
        self.experts.load_fp32(w_gate_up, w_down)

    @property
    def precisions(self) -> tuple[Precision, Precision]:
        """(router, experts) storage precision now."""
        return self.gate.storage.precision, self.experts.storage_precision

    def weight_bytes(self, layer: int = 0) -> LayerBytes:
        return layer_bytes(layer, self.gate.storage, self.experts.storage)


class DynamicMoE(_StoredMoE):
    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, backend: str = "auto"
                 ) -> None:
        super().__init__()
        self.gate = DynamicGate(d_model, num_experts)
        self.experts = SwiGLUExperts(d_model, d_ff, num_experts, backend=backend)
        # Measured per-expert cost (timed in the experts' inference loop), used when the gate's
        # hardwareCostLambda is above 0 (hardware-aware routing, expert_cost.py).
        self.cost = ExpertCost(num_experts)

    def reset_parameters(self, generator: torch.Generator) -> None:
        self.gate.reset_parameters(generator)
        self.experts.reset_parameters(generator)

    def forward(self, x: torch.Tensor, *, confidence_threshold: float = 0.6,
                min_experts: int = 1, max_experts: int = 4,
                capacity_factor: float | None = None, entropy_beta: float = 0.1,
                precision: Precision = "fp32", hardware_cost_lambda: float = 0.0,
                allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        flat = x.reshape(-1, x.shape[-1])
        # lambda 0 (the default): no cost vector, routing bit-identical to plain top-p.
        routing = self.gate(flat, confidence_threshold=confidence_threshold,
                            min_experts=min_experts, max_experts=max_experts,
                            capacity_factor=capacity_factor, precision=precision,
                            cost=self.cost.vector() if hardware_cost_lambda > 0 else None,
                            cost_lambda=hardware_cost_lambda, allowed=allowed)
        y = self.experts(flat, routing, cost=self.cost)
        return y.reshape(x.shape), routing_stats(routing, entropy_beta=entropy_beta)


class TopKMoE(_StoredMoE):
    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, k: int,
                 backend: str = "auto") -> None:
        super().__init__()
        self.gate = TopKGate(d_model, num_experts, k=k)
        self.experts = SwiGLUExperts(d_model, d_ff, num_experts, backend=backend)

    def reset_parameters(self, generator: torch.Generator) -> None:
        self.gate.reset_parameters(generator)
        self.experts.reset_parameters(generator)

    def forward(self, x: torch.Tensor, *, capacity_factor: float | None = None,
                entropy_beta: float = 0.0, precision: Precision = "fp32"
                ) -> tuple[torch.Tensor, MoEStats]:
        flat = x.reshape(-1, x.shape[-1])
        routing = self.gate(flat, capacity_factor=capacity_factor, precision=precision)
        y = self.experts(flat, routing)
        return y.reshape(x.shape), routing_stats(routing, entropy_beta=entropy_beta)


class DenseFFN(nn.Module):
    """Dense SwiGLU baseline with the MoE layers' call signature."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.ffn = DenseSwiGLU(d_model, d_ff)

    def reset_parameters(self, generator: torch.Generator) -> None:
        self.ffn.reset_parameters(generator)

    def forward(self, x: torch.Tensor, **_: object) -> tuple[torch.Tensor, MoEStats]:
        n = x.numel() // x.shape[-1]
        stats = MoEStats(counts=[n], num_tokens=n, mean_selected=1.0, mean_active=1.0,
                         dropped=0, entropy=0.0)
        return self.ffn(x), stats


def dense_equivalent_width(*, d_ff: int, mean_k: float, multiple: int = 64) -> int:
    """Dense FFN width with the same active expert FLOPs per token, rounded to `multiple`."""
    return max(multiple, int(round(d_ff * mean_k / multiple)) * multiple)
