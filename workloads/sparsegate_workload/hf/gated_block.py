"""The MoE block that replaces a Hugging Face family's sparse block: sparsegate's dynamic gate
and sorted dispatch over the checkpoint's own weights.

Routing is the built-in model's (`gating.top_p_mask` + `gating.assign`): fp32 softmax over the
router logits, the fewest experts whose mass reaches ``confidenceThreshold`` clamped to
``[minExpertsPerToken, maxExpertsPerToken]``, optional capacity cap. Kept probabilities are
renormalised only where the family does so (`families.MoEFamily.renormalize`), so with
min = max = k and no cap the block picks the upstream block's experts with its weights, and
the fp32 logits match upstream's to float rounding (in bf16 the router here still computes its
logits in fp32 where upstream rounds them to bf16, so near-tied tokens can choose otherwise).

Hardware-aware routing: with the gate's ``hardwareCostLambda`` above 0, the selection runs on
softmax(logits - lambda * cost), cost the block's `expert_cost.ExpertCost` (EWMA of each expert's
measured time per row in the inference dispatch on the CPU, times its placement factor, which
alone differentiates experts on CUDA; normalised to [0, 1]); the combine weights stay
the unbiased probabilities. At 0 (the default) routing is bit-identical to no bias.
Experts placed on their own dtype/device (`placement`, ``--expert-placement-json``) run there in
the inference dispatch, timed like the others; their placement factor is measured at load.

Dispatch (FACTS.md "MoE dispatch on CPU"): gather the kept rows once in expert order, one
``mm`` pair per non-empty expert on its contiguous slice (`experts.dispatch_sorted`; in bf16 on
CPU row counts are rounded up to `experts.row_bucket`, so oneDNN builds few kernels), weights
applied in place, combine by gathers. At patch time each expert weight is re-laid out once as
[in, out] contiguous storage and the upstream parameter becomes a transposed view of it (same
shape, values and name, no second copy): measured here, fp32 at ~64 rows per expert runs ~13% faster that way than BLAS
reading the [out, in] layout transposed (bf16 the same either way).

Weight storage (precision.py): the router weight and the expert weights of each block are held
in the precisions the installed gate resolves to (`store`, called by the loader's ``set_gate``):
"fp32" is the checkpoint's tensors as loaded (no copy), bf16 a bf16 copy, int8 int8 values with
one fp32 scale per output channel; in bf16/int8 the loaded parameters are dropped from the
module. A block computes with what it stores: experts dequantised one at a time into the
activation dtype, router logits in fp32.

The gate in force is one immutable `ActiveGate`; the model holds it in a shared `GateSlot` and
swaps it by reference. A caller pins it for a whole forward (or a whole ``generate``) with
`pin_gate`: every block then reads the pinned gate, so that forward never mixes two gate
versions, and each block appends its routing stats to the `GateCall`. A block called outside
any pin reads the slot itself and records nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Iterator

import torch
from torch import nn

from sparsegate_contracts.gate import GateDocument, GateParams

from ..experts import combine, dispatch_sorted, swiglu
from ..expert_cost import ExpertCost, biased_selection_probs
from ..gating import (Router, Routing, assign, available_experts, capacity_of,
                      cost_biased_top_p)
from ..moe import routing_stats
from ..precision import LayerBytes, Precision, StoredWeight, is_lower, layer_bytes
from ..threshold_control import ThresholdController
from .placement import PlacedExpert


@dataclasses.dataclass(frozen=True)
class ActiveGate:
    """A gate as routed: params, per-MoE-layer router and expert weight precision, capacity
    factor (None: dropless) and the document it came from (None when installed from bare
    params). ``controller``: the PI loop of a gate with targetExpertsPerToken (threshold_control),
    given by whoever installs the gate (the model server); blocks then route with its threshold
    of the moment, and the serving code that ran a forward feeds it that forward's mean selected
    experts per token (`GateCall.mean_selected_experts`)."""

    params: GateParams
    precisions: tuple[Precision, ...]
    capacity_factor: float | None
    document: GateDocument | None = None
    expert_precisions: tuple[Precision, ...] = ()
    controller: ThresholdController | None = dataclasses.field(default=None, compare=False)

    @property
    def version(self) -> str | None:
        return self.document.version if self.document is not None else None

    def routed_params(self) -> GateParams:
        """The params blocks route with: the controlled threshold when there is a controller
        (read per block call; it moves only between forwards, when fed)."""
        return self.controller.params(self.params) if self.controller is not None else self.params


class GateSlot:
    """Holder of the gate in force, shared by a model and its blocks; replaced by reference."""

    def __init__(self, active: ActiveGate) -> None:
        self.active = active


@dataclasses.dataclass
class GateCall:
    """One pinned gate and the routing stats of every block call made under it, in order."""

    gate: ActiveGate
    layers: list[MoEStats] = dataclasses.field(default_factory=list)
    # Each block call's whole Routing too, when asked (`pin_gate(keep_routing=True)`): what a
    # batched decode step splits per sequence (which row used which experts).
    routings: list[Routing] | None = None
    # The only experts blocks may select in this call (per-request access): [E] bool for every
    # token (one request's expert group), or [T, E] bool, one row per routed token in the
    # order blocks flatten their input (a batch of sequences of different groups); None: all.
    allowed: torch.Tensor | None = None
    # Blocks route only the first ``rows`` tokens of their input (None: all): the rest is padding
    # a caller appended to round the forward's length up to a shape bucket (batch_decode's
    # prefill in bf16 on CPU); it reaches no expert, no statistic and no capacity share.
    rows: int | None = None
    _available: tuple[torch.Tensor, int, int | None] | None = dataclasses.field(
        default=None, repr=False, compare=False)

    @property
    def mean_active_experts(self) -> float:
        """Kept assignments per token, averaged over block calls (0.0 when none ran)."""
        return sum(s.mean_active for s in self.layers) / len(self.layers) if self.layers else 0.0

    @property
    def mean_selected_experts(self) -> float:
        return (sum(s.mean_selected for s in self.layers) / len(self.layers)
                if self.layers else 0.0)

    @property
    def dropped(self) -> int:
        return sum(s.dropped for s in self.layers)

    def available_experts(self, num_experts: int) -> int | None:
        """`gating.available_experts` of ``allowed``, read from the device once per call
        (every block of a forward has the same mask; on CUDA each read is a host sync)."""
        if self.allowed is None:
            return None
        cached = self._available
        if cached is None or cached[0] is not self.allowed or cached[1] != num_experts:
            cached = self._available = (self.allowed, num_experts,
                                        available_experts(self.allowed, num_experts))
        return cached[2]


_CURRENT_CALL: contextvars.ContextVar[GateCall | None] = contextvars.ContextVar(
    "sparsegate_hf_gate_call", default=None)


@contextlib.contextmanager
def pin_gate(gate: ActiveGate, *, keep_routing: bool = False,
             allowed: torch.Tensor | None = None, rows: int | None = None) -> Iterator[GateCall]:
    """Blocks called inside (in this thread or task) route with `gate` and record into the
    yielded call (their Routing objects too with ``keep_routing``); ``allowed``: `GateCall.allowed`;
    ``rows``: `GateCall.rows`."""
    call = GateCall(gate=gate, routings=[] if keep_routing else None, allowed=allowed, rows=rows)
    token = _CURRENT_CALL.set(call)
    try:
        yield call
    finally:
        _CURRENT_CALL.reset(token)


class SparseGatedMoEBlock(nn.Module):
    """Drop-in for a family's sparse MoE block: same input/output, same parameter names
    (``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``, Qwen2-MoE's
    ``shared_expert*``), so the state dict keeps the checkpoint's keys."""

    def __init__(self, upstream: nn.Module, *, moe_index: int, renormalize: bool,
                 shared_expert: bool, slot: GateSlot) -> None:
        super().__init__()
        weight = upstream.gate.weight
        self.num_experts, hidden = weight.shape
        self.top_k = int(upstream.gate.top_k)
        self.gate = Router(hidden, self.num_experts)
        self.gate.weight = weight  # the checkpoint's parameter itself, not a copy
        self.compute_dtype = weight.dtype  # the loaded dtype: activations, expert matmuls
        self.experts = _relayout_experts(upstream.experts)
        self._expert_storage: tuple[StoredWeight, StoredWeight] | None = None
        # The fp32 `expert_storage` views, built once per pair of loaded tensors (see there).
        self._fp32_storage: tuple | None = None
        if shared_expert:
            self.shared_expert = upstream.shared_expert
            self.shared_expert_gate = upstream.shared_expert_gate
        self.has_shared_expert = shared_expert
        self.moe_index = moe_index
        self.renormalize = renormalize
        self._slot = slot
        # Measured per-expert cost (timed in `dispatch`), used when the gate's
        # hardwareCostLambda is above 0.
        self.cost = ExpertCost(self.num_experts)
        # Experts given their own dtype/device (placement.apply_placement); the rest use the
        # layer's storage.
        self.placed: dict[int, PlacedExpert] = {}

    @property
    def expert_storage(self) -> tuple[StoredWeight, StoredWeight]:
        """(gate+up [E, d, 2f], down [E, f, d]) as held now; "fp32" is the loaded storage."""
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if gate_up is not None and down is not None:
            # Read every block call: the views are kept while the same tensors are loaded (the
            # parameters and their storage, so a ``.data`` swap or a new parameter rebuilds them).
            ptrs = (gate_up.data_ptr(), down.data_ptr())
            cached = self._fp32_storage
            if (cached is None or cached[0] is not gate_up or cached[1] is not down
                    or cached[2] != ptrs):
                cached = (gate_up, down, ptrs, (StoredWeight.store(gate_up.transpose(1, 2), "fp32"),
                                                StoredWeight.store(down.transpose(1, 2), "fp32")))
                if self.experts.gate_up_proj is gate_up:  # not dropped by a `store` meanwhile
                    self._fp32_storage = cached
            return cached[3]
        if self._expert_storage is None:
            raise RuntimeError("experts have neither parameters nor stored weights")
        return self._expert_storage

    @property
    def precisions(self) -> tuple[Precision, Precision]:
        """(router, experts) storage precision now."""
        return self.gate.storage.precision, self.expert_storage[0].precision

    def store(self, *, gate: Precision, experts: Precision) -> None:
        """Hold the router weight in `gate` and the expert weights in `experts` precision;
        bf16/int8 drop the loaded parameters. From bf16/int8 only a lower precision can be
        reached (`load_fp32` first)."""
        self.gate.store(gate)
        gate_up, down = self.expert_storage
        if gate_up.precision == experts:
            return
        if self._expert_storage is not None and not is_lower(experts, gate_up.precision):
            raise ValueError(f"experts stored in {gate_up.precision} cannot become {experts} "
                             f"without the checkpoint's weights (load_fp32)")
        # in_dim=1 of [E, in, out]: one scale per (expert, output column)
        self._expert_storage = tuple(  # type: ignore[assignment]
            StoredWeight.store(w.materialize(torch.float32) if w.scale is not None else w.data,
                               experts, in_dim=1, bf16_scale=self.compute_dtype == torch.bfloat16)
            for w in (gate_up, down))
        if experts != "fp32":
            self.experts.gate_up_proj = None
            self.experts.down_proj = None
            self._fp32_storage = None  # holds the dropped tensors

    def load_fp32(self, *, gate: torch.Tensor, gate_up_proj: torch.Tensor,
                  down_proj: torch.Tensor) -> None:
        """Put back the checkpoint's tensors (upstream layouts [E, d] / [E, 2f, d] / [E, d, f])."""
        self.gate.load_fp32(gate)
        for name, tensor in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            stored = tensor.detach().transpose(1, 2).contiguous()
            setattr(self.experts, name, nn.Parameter(stored.transpose(1, 2),
                                                     requires_grad=False))
        self._expert_storage = None
        self._fp32_storage = None

    def weight_bytes(self) -> LayerBytes:
        return layer_bytes(self.moe_index, self.gate.storage, self.expert_storage)

    def route(self, flat: torch.Tensor, gate: ActiveGate, allowed: torch.Tensor | None = None,
              *, logits: torch.Tensor | None = None, call: GateCall | None = None) -> Routing:
        """``allowed``: [E] bool (every token) or [T, E] bool (per token); the other experts get
        no gate mass and are never selected. ``logits``: the router's fp32 logits of ``flat``,
        when the caller already computed them. ``call``: the pinned call ``allowed`` came from
        (its allowed-expert count is then read once per call, not per block)."""
        params = gate.routed_params()
        # The router as stored (the loader stores what the gate resolves to); logits in fp32.
        if logits is None:
            logits = self.gate.logits(flat)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        kept_allowed = None  # [T, k] per selected expert: allowed (set when a mask applies)
        lo = min(params.min_experts_per_token, self.num_experts)
        hi = min(params.max_experts_per_token, self.num_experts)
        cost_lambda = params.hardware_cost_lambda
        cost = self.cost.vector(logits.device) if cost_lambda > 0 else None
        # The capacity cap's even share is over the experts the mask leaves, not all of them.
        available = None
        if gate.capacity_factor is not None:
            available = (call.available_experts(self.num_experts)
                         if call is not None and allowed is call.allowed
                         else available_experts(allowed, self.num_experts))
        if lo == hi:
            # Fixed k: top-k picks the same experts in the same (descending) order as the
            # threshold search clamped to k, on a [T, k] instead of a sorted [T, E] selection.
            selection = biased_selection_probs(logits, cost, cost_lambda)
            if selection is None:
                sorted_p, sorted_e = probs.topk(hi, dim=-1)
            else:  # pick on the cost-biased probs, weigh with the unbiased ones
                sorted_e = selection.topk(hi, dim=-1).indices
                sorted_p = probs.gather(-1, sorted_e)
            if allowed is not None:
                kept_allowed = _allowed_at(allowed, sorted_e)
            # With a mask, the fast path only when every top-k pick is allowed (each row's group
            # has at least k experts): then it is the same routing as the masked `assign`. That
            # is read with the counts (one host sync), None when some pick is not allowed.
            if not torch.is_grad_enabled() and (
                    FIXED_K_FAST_TOKENS is None or flat.shape[0] <= FIXED_K_FAST_TOKENS):
                routing = _assign_fixed_k(probs, sorted_p, sorted_e,
                                          capacity_factor=gate.capacity_factor,
                                          normalize=self.renormalize, available=available,
                                          allowed=kept_allowed)
                if routing is not None:
                    return routing
            mask = torch.ones_like(sorted_p, dtype=torch.bool)
        else:
            sorted_p, sorted_e, mask = cost_biased_top_p(
                probs, logits, cost=cost, cost_lambda=cost_lambda,
                threshold=params.confidence_threshold, min_k=lo, max_k=hi)
        if allowed is not None:
            # k (or min_k) may exceed the allowed experts: masked ones are never kept.
            mask = mask & (kept_allowed if kept_allowed is not None else _allowed_at(allowed, sorted_e))
        return assign(probs, sorted_p, sorted_e, mask, capacity_factor=gate.capacity_factor,
                      normalize=self.renormalize, available=available)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        call = _CURRENT_CALL.get()
        gate = call.gate if call is not None else self._slot.active
        every = hidden_states.reshape(-1, hidden_states.shape[-1])
        # Padding rows past call.rows (a bucketed prefill) are not routed; their output is zero.
        flat = every if call is None or call.rows is None else every[:call.rows]
        logits = self.gate.logits(flat)
        _record_router_logits(logits, flat.dtype)
        routing = self.route(flat, gate, call.allowed if call is not None else None,
                             logits=logits, call=call)
        out = self.dispatch(flat, routing)
        if flat.shape[0] < every.shape[0]:
            out = torch.cat([out, out.new_zeros(every.shape[0] - flat.shape[0], out.shape[1])])
        if self.has_shared_expert:
            shared = self.shared_expert(every)
            out = out + torch.sigmoid(self.shared_expert_gate(every)) * shared
        if call is not None:
            call.layers.append(routing_stats(routing, entropy_beta=gate.params.entropy_beta))
            if call.routings is not None:
                call.routings.append(routing)
        return out.reshape(hidden_states.shape)

    def dispatch(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """[T, d] -> [T, d]: the kept experts' SwiGLU outputs, combined with the gate weights."""
        params = self.experts.gate_up_proj
        if torch.is_grad_enabled() and (flat.requires_grad or routing.weights.requires_grad or (
                params is not None and params.requires_grad)):
            w = routing.weights.unsqueeze(-1).to(flat.dtype)
            xs = flat.index_select(0, routing.token_idx)
            d_model = xs.shape[1]
            # [E, d, 2f] and [E, f, d]: contiguous views of the storage `_relayout_experts` made.
            w_gate_up = self.experts.gate_up_proj.transpose(1, 2)
            w_down = self.experts.down_proj.transpose(1, 2)
            # unbind once: indexing the stacked weight per expert under autograd would build a
            # full-size gradient per select (FACTS.md).
            gu, dn = w_gate_up.unbind(0), w_down.unbind(0)
            chunks, start = [], 0
            for e, n in enumerate(routing.counts):
                if n:
                    h = swiglu(xs[start:start + n] @ gu[e])
                    chunks.append(h @ dn[e])
                    start += n
            ys = torch.cat(chunks) * w if chunks else xs.new_zeros(0, d_model)
            return combine(torch.cat([ys, ys.new_zeros(1, d_model)]), routing.slots)
        # Inference (experts.dispatch_sorted). The storage is read once, so a re-store between
        # calls cannot split this one.
        gate_up, down = self.expert_storage
        return combine(dispatch_sorted(flat, routing, gate_up, down, cost=self.cost,
                                       placed=self.placed), routing.slots)


@functools.lru_cache(maxsize=1)
def _output_collector() -> object | None:
    """transformers' context variable holding what the running forward records (the dict its
    ``capture_outputs`` fills), None where this transformers has none."""
    import importlib

    for name in ("transformers.utils.output_capturing", "transformers.utils.generic"):
        try:
            collector = getattr(importlib.import_module(name), "_active_collector", None)
        except ImportError:
            continue
        if collector is not None:
            return collector
    return None


def _record_router_logits(logits: torch.Tensor, dtype: torch.dtype) -> None:
    """What the upstream router's output recorder does: with ``output_router_logits`` (a call
    argument or config.json), append this block's [T, E] router logits for the model output's
    ``router_logits`` and its load-balancing ``aux_loss``. transformers hooks only its own router
    class, which the patch replaced: without this the tuple is empty and every forward of such
    a checkpoint raises IndexError in ``load_balancing_loss_func``."""
    collector = _output_collector()
    recorded = collector.get() if collector is not None else None  # type: ignore[attr-defined]
    if isinstance(recorded, dict) and "router_logits" in recorded:
        recorded["router_logits"].append(logits.to(dtype))


def _allowed_at(allowed: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[T, k] bool: whether each token may use each of its candidate ``experts`` [T, k]
    (``allowed`` [E] for all tokens, or [T, E] per token)."""
    return allowed[experts] if allowed.dim() == 1 else allowed.gather(1, experts)


# A fixed k in inference takes `_assign_fixed_k`, the same Routing in about half the tensor ops
# of `assign`; measured here (1 thread, 8 experts, top-2) about half its time at every size from
# 8 to 16,384 tokens, so there is no size limit (None); a test sets 0 to take `assign` only.
FIXED_K_FAST_TOKENS: int | None = None


def _assign_fixed_k(probs: torch.Tensor, sorted_p: torch.Tensor, sorted_e: torch.Tensor, *,
                    capacity_factor: float | None, normalize: bool,
                    available: int | None = None, allowed: torch.Tensor | None = None
                    ) -> Routing | None:
    """`gating.assign` for every token keeping exactly its top k (inference only): identical
    fields, order and slots. A capacity cap that would drop something takes `assign` itself.
    ``allowed``: [T, k] bool, whether each pick may be used (an expert-group mask), read in the
    same host sync as the counts; None is returned when one may not (the masked `assign` then).
    A single token (decoding one sequence) orders its k picks on the host (k integers) instead of
    the sort and scatter a batch needs, and reuses its constant index tensors."""
    num_tokens, num_experts = probs.shape
    k = sorted_p.shape[1]
    device = probs.device
    n_assign = num_tokens * k
    if num_tokens == 1:
        if allowed is None:
            picks = sorted_e.tolist()[0]  # the block's single host sync
        else:
            *picks, ok = torch.cat([sorted_e.view(-1), allowed.all().view(1)]).tolist()
            if not ok:
                return None
        counts = [0] * num_experts
        for e in picks:
            counts[e] += 1
    else:
        # Assignment i = (token i // k, rank i % k); grouped by expert, then rank, then token.
        flat_e = sorted_e.reshape(-1)
        position = torch.arange(n_assign, device=device)
        token = torch.div(position, k, rounding_mode="floor")
        order = ((flat_e * k + position % k) * num_tokens + token).argsort()
        counts_all = torch.bincount(flat_e, minlength=num_experts)
        if allowed is None:
            counts = counts_all.tolist()  # the block's single host sync, as in assign
        else:
            *counts, ok = torch.cat([counts_all, allowed.all().view(1)]).tolist()
            if not ok:
                return None
    capacity = None
    if capacity_factor is not None:
        capacity = capacity_of(capacity_factor, n_assign, num_experts, available)
        if max(counts) > capacity:
            return assign(probs, sorted_p, sorted_e, torch.ones_like(sorted_p, dtype=torch.bool),
                          capacity_factor=capacity_factor, normalize=normalize,
                          available=available)
    weights = sorted_p / sorted_p.sum(dim=-1, keepdim=True) if normalize else sorted_p
    if num_tokens == 1:
        order = tuple(sorted(range(k), key=picks.__getitem__))
        ranked = weights.view(-1)
        if order != tuple(range(k)):  # already in expert order: no gather
            ranked = ranked.index_select(0, _order_index(order, device))
        token_idx, slots, per_token = _one_token_indices(k, device)
        return Routing(token_idx=token_idx, weights=ranked,
                       counts=counts, slots=slots, per_token=per_token, selected=per_token,
                       probs=probs, dropped=0, capacity=capacity, load=counts)
    # slots[t] = where token t's k outputs sit in the grouped order, ascending (expert order),
    # as assign lays them out.
    where = torch.empty_like(order)
    where[order] = position
    per_token = torch.full((num_tokens,), k, device=device)
    return Routing(token_idx=token[order], weights=weights.reshape(-1)[order], counts=counts,
                   slots=where.view(num_tokens, k).sort(dim=1).values, per_token=per_token,
                   selected=per_token, probs=probs, dropped=0, capacity=capacity,
                   load=counts_all)


@functools.lru_cache(maxsize=256)
def _order_index(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A one-token routing's permutation of its k picks into expert order, as an index tensor
    (built once per permutation and device; read, never written)."""
    return torch.tensor(order, device=device)


@functools.lru_cache(maxsize=64)
def _one_token_indices(k: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-token routing's token_idx [k] (all 0), slots [1, k] (0..k-1) and per-token count
    [1] (k): the same every step, so built once (routings are read, never written)."""
    return (torch.zeros(k, dtype=torch.long, device=device),
            torch.arange(k, device=device).view(1, k),
            torch.full((1,), k, device=device))


def _relayout_experts(experts: nn.Module) -> nn.Module:
    """Store gate_up_proj [E, 2f, d] and down_proj [E, d, f] as transposed views of
    contiguous [E, d, 2f] / [E, f, d] tensors; one expert tensor is copied at a time."""
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(experts, name)
        if param.transpose(1, 2).is_contiguous():
            continue  # already laid out (e.g. a block patched twice)
        with torch.no_grad():
            stored = param.detach().transpose(1, 2).contiguous()
        setattr(experts, name, nn.Parameter(stored.transpose(1, 2),
                                            requires_grad=param.requires_grad))
    return experts
