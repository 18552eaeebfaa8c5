"""Routers: dynamic top-p gate (variable experts per token) and fixed top-k baselines.

Every router returns a `Routing`: the kept (token, expert) assignments already sorted by expert,
their combine weights and the per-expert counts as one Python list (the layer's single explicit
host read; on CUDA the variable-size ``nonzero`` of `assign` and a capacity cap's boolean
indexing wait for the device too). Selection and capacity are vectorised: no Python loop over
tokens or experts.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from .expert_cost import biased_selection_probs
from .precision import Precision, StoredWeight, fake_quantize, is_lower


@dataclasses.dataclass
class Routing:
    token_idx: torch.Tensor     # [A] kept assignments' token rows, grouped by expert
    weights: torch.Tensor       # [A] combine weights (differentiable wrt the gate)
    counts: list[int]           # [E] kept assignments per expert (sum = A)
    slots: torch.Tensor         # [T, max kept per token] positions in the A order; A = none
    per_token: torch.Tensor     # [T] experts that actually process each token (after drops)
    selected: torch.Tensor      # [T] experts chosen per token before the capacity cap
    probs: torch.Tensor         # [T, E] fp32 gate distribution
    dropped: int                # assignments removed by the capacity cap
    capacity: int | None        # per-expert cap, None = dropless
    load: torch.Tensor | list[int]  # [E] assignments the gate chose per expert, before the cap

    # The regularisers are computed when read: serving reads the entropy (a metric) and never
    # the balance loss, which is ~8 tensor ops a layer, measurable in one-token decode steps.
    @functools.cached_property
    def aux_loss(self) -> torch.Tensor:
        """Switch-style balance loss generalised to variable k: E * sum_e f_e * P_e, f_e the
        share of chosen assignments (1.0 = perfectly uniform); differentiable wrt probs."""
        load = torch.as_tensor(self.load, device=self.probs.device).float()
        frac = load / load.sum().clamp_min(1)
        return self.probs.shape[1] * (frac * self.probs.mean(dim=0)).sum()

    @functools.cached_property
    def entropy(self) -> torch.Tensor:
        """Mean per-token Shannon entropy of probs (nats)."""
        return -(self.probs * self.probs.clamp_min(1e-12).log()).sum(dim=-1).mean()

    @property
    def num_tokens(self) -> int:
        return self.probs.shape[0]

    @property
    def num_assignments(self) -> int:
        return sum(self.counts)


def top_p_mask(probs: torch.Tensor, *, threshold: float, min_k: int, max_k: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smallest prefix of experts (by probability) whose mass reaches `threshold`, clamped.

    Returns (sorted probs, sorted expert ids, mask over sorted positions), all [T, E].
    """
    sorted_p, sorted_e = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    # Position j is needed while the mass of positions < j is still below the threshold.
    k = (mass_before < threshold).sum(dim=-1).clamp(min=min_k, max=max_k)
    positions = torch.arange(probs.shape[-1], device=probs.device)
    return sorted_p, sorted_e, positions < k.unsqueeze(-1)


def cost_biased_top_p(probs: torch.Tensor, logits: torch.Tensor, *, cost: torch.Tensor | None,
                      cost_lambda: float, threshold: float, min_k: int, max_k: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_p_mask` over softmax(logits - cost_lambda * cost) (hardware-aware routing), with the
    kept experts' combine weights taken from the unbiased `probs`. lambda 0 or no cost: exactly
    `top_p_mask(probs)`."""
    selection = biased_selection_probs(logits, cost, cost_lambda)
    if selection is None:
        return top_p_mask(probs, threshold=threshold, min_k=min_k, max_k=max_k)
    _, sorted_e, mask = top_p_mask(selection, threshold=threshold, min_k=min_k, max_k=max_k)
    return probs.gather(-1, sorted_e), sorted_e, mask


def capacity_of(capacity_factor: float, n_assign: int, num_experts: int,
                available: int | None = None) -> int:
    """Per-expert cap: capacityFactor times the even share of the assignments over the experts
    they may go to (``available``: those an expert-group mask leaves; None: all ``num_experts``),
    so a request scoped to a few experts is not capped as if its tokens spread over all."""
    share_over = num_experts if available is None else max(1, min(available, num_experts))
    return max(1, math.ceil(capacity_factor * n_assign / share_over))


def available_experts(allowed: torch.Tensor | None, num_experts: int) -> int | None:
    """Experts an ``allowed`` mask ([E], or [T, E] per token) leaves to at least one token."""
    if allowed is None:
        return None
    return int(allowed.reshape(-1, num_experts).any(dim=0).sum())


def assign(probs: torch.Tensor, sorted_p: torch.Tensor, sorted_e: torch.Tensor,
           mask: torch.Tensor, *, capacity_factor: float | None, normalize: bool,
           available: int | None = None) -> Routing:
    """Turn a [T, E] selection mask (sorted by rank) into expert-grouped kept assignments.
    ``available``: the experts the tokens may be routed to (`available_experts`; None: all),
    the even share the capacity cap is a multiple of."""
    num_tokens, num_experts = probs.shape
    weights_ranked = sorted_p * mask
    if normalize:
        weights_ranked = weights_ranked / weights_ranked.sum(dim=-1, keepdim=True)
    width = mask.shape[-1]  # E for top-p, k for top-k
    flat = mask.reshape(-1).nonzero().squeeze(1)
    rank = flat % width
    token = torch.div(flat, width, rounding_mode="floor")
    expert = sorted_e.reshape(-1)[flat]
    weight = weights_ranked.reshape(-1)[flat]
    n_assign = flat.numel()
    # Group by expert; inside an expert, lower rank (more confident choice) first, then token order,
    # so the capacity cap drops each token's least important assignments first.
    key = (expert * width + rank) * num_tokens + token
    order = key.argsort()
    expert, token, weight = expert[order], token[order], weight[order]
    counts_all = torch.bincount(expert, minlength=num_experts)
    capacity = None
    counts_kept = counts_all
    if capacity_factor is not None:
        capacity = capacity_of(capacity_factor, n_assign, num_experts, available)
        starts = counts_all.cumsum(0) - counts_all
        keep = torch.arange(n_assign, device=probs.device) - starts[expert] < capacity
        token, weight = token[keep], weight[keep]
        counts_kept = counts_all.clamp(max=capacity)
    # Combine slots: row t lists where token t's outputs sit in the expert-grouped order, padded
    # with the index of an all-zero row, so the combine is a few gathers instead of a scatter-add
    # (index_add_ measured ~50x slower than index_select here).
    per_token = torch.bincount(token, minlength=num_tokens)
    by_token = token.argsort(stable=True)
    token_sorted = token[by_token]
    rank_in_token = (torch.arange(token.numel(), device=probs.device)
                     - (per_token.cumsum(0) - per_token)[token_sorted])
    # The layer's single host sync: per-expert counts and the widest token, together.
    synced = torch.cat([counts_kept, per_token.max().reshape(1)]).tolist()
    counts, max_per_token = synced[:-1], max(synced[-1], 1)
    slots = torch.full((num_tokens, max_per_token), token.numel(), dtype=torch.long,
                       device=probs.device)
    slots[token_sorted, rank_in_token] = by_token
    dropped = n_assign - token.numel()
    return Routing(token_idx=token, weights=weight, counts=counts, slots=slots,
                   per_token=per_token, selected=mask.sum(dim=-1), probs=probs, dropped=dropped,
                   capacity=capacity, load=counts_all)


class Router(nn.Module):
    """Linear gate d_model -> E. Training (``weight`` requires grad): an fp32 parameter with
    fake quantisation. Serving (frozen): one `StoredWeight` in fp32, bf16 or int8 (one scale
    per expert row); in bf16/int8 the fp32 parameter is dropped (``weight`` is None)."""

    def __init__(self, d_model: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self._storage: StoredWeight | None = None

    def reset_parameters(self, generator: torch.Generator) -> None:
        with torch.no_grad():
            self.weight.normal_(0.0, self.weight.shape[1] ** -0.5, generator=generator)
        self._storage = None

    @property
    def storage(self) -> StoredWeight:
        """The weight as served now (fp32 storage is the parameter itself, no copy)."""
        if self.weight is not None:  # a parameter exists only while stored fp32
            return StoredWeight.store(self.weight, "fp32")
        if self._storage is None:
            raise RuntimeError("router has neither a parameter nor a stored weight")
        return self._storage

    def store(self, precision: Precision) -> None:
        """Hold the weight in `precision` from now on. From fp32 any precision; from a stored
        bf16/int8 only a lower one (the fp32 values are gone: `load_fp32` first)."""
        current = self.storage
        if current.precision == precision:
            return
        if self.weight is None and not is_lower(precision, current.precision):
            raise ValueError(f"router stored in {current.precision} cannot become {precision} "
                             f"without its fp32 weights (load_fp32)")
        if self.weight is not None and self.weight.requires_grad:
            raise RuntimeError("a router that trains keeps its fp32 parameter (fake quant)")
        source = current.data if current.scale is None else current.materialize(torch.float32)
        stored = StoredWeight.store(source, precision)
        self._storage = stored
        if precision != "fp32":
            self.weight = None  # the point: no fp32 copy left in a quantised router

    def load_fp32(self, weight: torch.Tensor) -> None:
        """Re-materialise the full-precision weight (from the model's source), stored fp32."""
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self._storage = None

    def logits(self, x: torch.Tensor, precision: Precision | None = None) -> torch.Tensor:
        """fp32 logits. Training: weight rounded to `precision` with a straight-through
        gradient. Serving: the stored weight, first converted to `precision` when given and
        different (see `store`); None serves whatever is stored."""
        w = self.weight
        if w is not None and w.requires_grad:
            return F.linear(x.float(), fake_quantize(w, precision or "fp32").float())
        if precision is not None:
            self.store(precision)
            w = self.weight
        # A loaded weight is the fp32 storage itself (`storage`): used as is, no detached view.
        weight = self.storage.materialize(torch.float32) if w is None else (
            w if w.dtype == torch.float32 else w.float())
        return F.linear(x if x.dtype == torch.float32 else x.float(), weight)


class DynamicGate(Router):
    """Top-p routing: per token, the fewest experts whose gate mass reaches the threshold."""

    def forward(self, x: torch.Tensor, *, confidence_threshold: float, min_experts: int,
                max_experts: int, capacity_factor: float | None,
                precision: Precision = "fp32", cost: torch.Tensor | None = None,
                cost_lambda: float = 0.0, allowed: torch.Tensor | None = None) -> Routing:
        """``allowed``: a [E] bool mask of the experts this request may activate (its expert
        group, per-request access); the others get no gate mass and are never selected, even
        when ``min_experts`` asks for more than are allowed."""
        logits = self.logits(x, precision)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        sorted_p, sorted_e, mask = cost_biased_top_p(
            probs, logits, cost=cost, cost_lambda=cost_lambda, threshold=confidence_threshold,
            min_k=min_experts, max_k=min(max_experts, self.num_experts))
        available = None
        if allowed is not None:
            mask = mask & allowed[sorted_e]
            if capacity_factor is not None:
                available = available_experts(allowed, self.num_experts)
        return assign(probs, sorted_p, sorted_e, mask, capacity_factor=capacity_factor,
                      normalize=True, available=available)


class TopKGate(Router):
    """Fixed top-k baseline: k=1 is Switch (weight = raw prob), k>1 renormalises (Mixtral)."""

    def __init__(self, d_model: int, num_experts: int, *, k: int) -> None:
        super().__init__(d_model, num_experts)
        self.k = k

    def forward(self, x: torch.Tensor, *, capacity_factor: float | None,
                precision: Precision = "fp32") -> Routing:
        probs = torch.softmax(self.logits(x, precision), dim=-1)
        top_p, top_e = probs.topk(self.k, dim=-1)
        mask = torch.ones_like(top_p, dtype=torch.bool)
        return assign(probs, top_p, top_e, mask, capacity_factor=capacity_factor,
                      normalize=self.k > 1)


class ToolGate(nn.Module):
    """Per-token head: sigmoid(w·h + b) above the threshold marks the token for a tool call."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(h).squeeze(-1))


def tool_fires(prob: torch.Tensor, *, threshold: float) -> torch.Tensor:
    """Strictly above ``threshold``, compared in float64 as the server's Python comparisons
    (``tools.call_fired``, ``batch_decode``) do: a float32 tensor would round the threshold
    first, and 0.85 rounds up to the float32 0.8500000238, so a probability of exactly that
    value (above 0.85) was reported as not firing while the tool was called."""
    return prob.to(torch.float64) > threshold
