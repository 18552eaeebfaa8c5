"""SwiGLU experts with grouped dispatch, and the dense SwiGLU FFN they are compared with.

Dispatch (see FACTS.md "MoE dispatch on CPU"): the router already sorted assignments by expert
and synced the counts once, so here we gather the token rows once, run each non-empty expert on
its contiguous slice (or all experts in one `F.grouped_mm`), multiply by the combine weight and
scatter-add back. Gate and up projections are one fused [d, 2f] weight per expert.

Storage (precision.py): trained as fp32 parameters; frozen for serving they can be stored bf16
or int8 (one scale per expert and output column) with no fp32 copy left. The loop dequantises
one expert at a time into the activation dtype (int8: the values are cast, the matmul output is
scaled per column, which equals using q * scale as the weight).

Row buckets (`row_bucket`): in bf16/fp16 on CPU a matmul runs through oneDNN, which generates a
kernel for every new shape (measured here: ~4 ms the first time a row count is seen vs ~0.9 ms
after, [~300, 512] x [512, 2048] bf16). Per-expert row counts change with every batch, so the
dispatch runs each expert on its rows rounded up to a bucket (at most 1/16 more from 256 rows):
the extra rows are the next expert's rows (or a zero tail), and their outputs are overwritten by
the next expert or never read.
"""

from __future__ import annotations

import time
from typing import Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .expert_cost import ExpertCost
from .gating import Routing
from .precision import Precision, StoredWeight, is_lower

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over the fused projection; in place when no autograd graph needs h."""
    gate, up = h.chunk(2, dim=-1)
    if torch.is_grad_enabled() and h.requires_grad:
        return F.silu(gate) * up
    # A strided [n, f] view is fine for the next matmul (BLAS takes a leading dimension).
    return F.silu(gate, inplace=True).mul_(up)


class DenseSwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(d_model, 2 * d_ff))
        self.w_down = nn.Parameter(torch.empty(d_ff, d_model))

    def reset_parameters(self, generator: torch.Generator) -> None:
        d_model, d_ff = self.w_down.shape[1], self.w_down.shape[0]
        with torch.no_grad():
            self.w_gate_up.normal_(0.0, d_model ** -0.5, generator=generator)
            self.w_down.normal_(0.0, d_ff ** -0.5, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x @ self.w_gate_up) @ self.w_down

    def flops_per_token(self) -> int:
        d_ff, d_model = self.w_down.shape
        return 2 * d_model * 3 * d_ff


class SwiGLUExperts(nn.Module):
    """E SwiGLU experts; `backend` is "loop" (per non-empty expert), "grouped" or "auto"."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, backend: str = "auto"
                 ) -> None:
        super().__init__()
        if backend not in ("auto", "loop", "grouped"):
            raise ValueError(f"unknown backend {backend!r}")
        if backend == "grouped" and not HAS_GROUPED_MM:
            raise RuntimeError("this torch has no F.grouped_mm")
        self.backend = backend
        self.num_experts = num_experts
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, d_model, 2 * d_ff))
        self.w_down = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self._storage: tuple[StoredWeight, StoredWeight] | None = None

    def reset_parameters(self, generator: torch.Generator) -> None:
        d_ff, d_model = self.w_down.shape[1], self.w_down.shape[2]
        with torch.no_grad():
            self.w_gate_up.normal_(0.0, d_model ** -0.5, generator=generator)
            self.w_down.normal_(0.0, d_ff ** -0.5, generator=generator)

    def flops_per_assignment(self) -> int:
        d_ff, d_model = self.storage[1].data.shape[1:]
        return 2 * d_model * 3 * d_ff

    @property
    def storage(self) -> tuple[StoredWeight, StoredWeight]:
        """(fused gate+up [E, d, 2f], down [E, f, d]) as served now; fp32 is the parameters."""
        if self.w_gate_up is not None and self.w_down is not None:
            return (StoredWeight.store(self.w_gate_up, "fp32"),
                    StoredWeight.store(self.w_down, "fp32"))
        if self._storage is None:
            raise RuntimeError("experts have neither parameters nor stored weights")
        return self._storage

    @property
    def storage_precision(self) -> Precision:
        return self.storage[0].precision

    def store(self, precision: Precision) -> None:
        """Hold the expert weights in `precision`; bf16/int8 drop the fp32 parameters. From a
        stored bf16/int8 only a lower precision is possible (`load_fp32` first)."""
        gate_up, down = self.storage
        if gate_up.precision == precision:
            return
        if self.w_gate_up is None and not is_lower(precision, gate_up.precision):
            raise ValueError(f"experts stored in {gate_up.precision} cannot become {precision} "
                             f"without their fp32 weights (load_fp32)")
        if self.w_gate_up is not None and self.w_gate_up.requires_grad:
            raise RuntimeError("experts that train keep their fp32 parameters")
        # in_dim=1: the input dimension of [E, in, out]; one scale per (expert, out column).
        stored = tuple(StoredWeight.store(w.materialize(torch.float32)
                                          if w.scale is not None else w.data,
                                          precision, in_dim=1) for w in (gate_up, down))
        self._storage = stored  # type: ignore[assignment]
        if precision != "fp32":
            self.w_gate_up = None
            self.w_down = None

    def load_fp32(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
        """Re-materialise the full-precision weights (from the model's source)."""
        self.w_gate_up = nn.Parameter(w_gate_up.detach(), requires_grad=False)
        self.w_down = nn.Parameter(w_down.detach(), requires_grad=False)
        self._storage = None

    def _use_grouped(self) -> bool:
        if self.backend != "auto":
            return self.backend == "grouped"
        # Measured here (tests/bench/bench_moe.py, 2-core CPU, torch 2.15): the sorted loop over
        # non-empty experts is on par with F.grouped_mm at 256-1024 tokens and faster from 4096 on
        # (R 1.04 vs 1.21 forward, 2 threads; 1.00 vs 1.11 forward+backward, 1 thread), because this
        # loop never indexes a stacked weight under autograd. grouped stays selectable.
        return False

    def forward(self, x: torch.Tensor, routing: Routing, *, cost: ExpertCost | None = None
                ) -> torch.Tensor:
        """x: [T, d] -> [T, d]; tokens no expert kept contribute zero (residual carries them).
        ``cost``: records each expert's measured time per row (inference loop backend only: the
        grouped kernel runs every expert in one call, so it has no per-expert time)."""
        w = routing.weights.unsqueeze(-1).to(x.dtype)
        n_assign, d_model = routing.token_idx.numel(), x.shape[1]
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (
                self.w_gate_up is not None and self.w_gate_up.requires_grad)):
            xs = x.index_select(0, routing.token_idx)
            ys = self._experts_autograd(xs, routing.counts) * w
            ys = torch.cat([ys, ys.new_zeros(1, d_model)])
        else:
            gate_up, down = self.storage  # read once: a concurrent re-store cannot split a batch
            if self._use_grouped():
                xs = x.index_select(0, routing.token_idx)
                ys = x.new_empty(n_assign + 1, d_model)
                ys[n_assign].zero_()
                ys[:n_assign] = self._grouped(xs, routing.counts, gate_up, down)
                ys[:n_assign].mul_(w)
            else:
                ys = dispatch_sorted(x, routing, gate_up, down, cost=cost)
        return combine(ys, routing.slots)

    def _grouped(self, xs: torch.Tensor, counts: list[int], gate_up: StoredWeight,
                 down: StoredWeight) -> torch.Tensor:
        # grouped_mm takes whole stacked weights: a bf16/int8 storage is dequantised in full
        # for the call (a transient copy; the loop backend dequantises one expert at a time).
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        h = F.grouped_mm(xs, gate_up.materialize(xs.dtype), offs=offs)
        return F.grouped_mm(swiglu(h), down.materialize(xs.dtype), offs=offs)

    def _experts_autograd(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self._use_grouped():  # the parameters themselves: autograd needs them
            offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            h = F.grouped_mm(xs, self.w_gate_up, offs=offs)
            return F.grouped_mm(swiglu(h), self.w_down, offs=offs)
        # unbind once: indexing the stacked weight per expert would build a full-size gradient
        # per select in backward (FACTS.md).
        w_gu, w_down = self.w_gate_up.unbind(0), self.w_down.unbind(0)
        chunks, start = [], 0
        for e, n in enumerate(counts):
            if n:
                chunks.append(swiglu(xs[start:start + n] @ w_gu[e]) @ w_down[e])
                start += n
        return torch.cat(chunks) if chunks else xs.new_zeros(0, xs.shape[1])


_BUCKETED_DTYPES = (torch.bfloat16, torch.float16)


def row_bucket(n: int) -> int:
    """The rows an expert's matmul runs on for ``n`` assigned rows when buckets apply: 1 stays 1
    (a matrix-vector product), up to 256 the next multiple of 16 (AMX tiles are 16 rows), above
    that the next multiple of 2**(bit_length(n) - 5): 16 buckets per octave, at most 1/16 more
    rows. 81 distinct row counts up to 4,096."""
    if n <= 1:
        return n
    if n <= 16:
        return 16
    step = max(16, 1 << (n.bit_length() - 5))
    return -(-n // step) * step


def uses_row_buckets(x: torch.Tensor) -> bool:
    """Whether the dispatch of ``x`` rounds row counts up (`row_bucket`): bf16/fp16 on CPU,
    where matmuls are oneDNN's, whose kernels are built per shape."""
    return buckets_rows(x.device, x.dtype)


def buckets_rows(device: torch.device | str, dtype: torch.dtype) -> bool:
    """`uses_row_buckets` for tensors of ``dtype`` on ``device`` (a model's, before any input)."""
    return torch.device(device).type == "cpu" and dtype in _BUCKETED_DTYPES


def dispatch_sorted(x: torch.Tensor, routing: Routing, gate_up: StoredWeight,
                    down: StoredWeight, *, cost: ExpertCost | None = None,
                    placed: Mapping[int, PlacedRun] | None = None) -> torch.Tensor:
    """Inference dispatch: x [T, d] -> [A + 1 (+ tail), d], each kept assignment's weighted
    SwiGLU output in expert order, row A zero (combine's padding row). Rows are gathered once;
    each non-empty expert runs on its contiguous slice (rounded up to `row_bucket` where
    `uses_row_buckets`), writing straight into its slice of the output. ``cost``: each expert's
    measured time per row (recorded on the CPU only); ``placed``: experts that run elsewhere
    (unbucketed) by ``run(x, out)``."""
    counts = routing.counts
    n_assign, d_model = routing.token_idx.numel(), x.shape[1]
    tail = (max((row_bucket(n) - n for n in counts if n), default=0)
            if uses_row_buckets(x) else 0)
    # One token (a decode step): each expert it uses runs that one row, so x is every expert's
    # input as it stands, no gather.
    single = x.shape[0] == 1 and max(counts, default=0) <= 1
    if tail:
        xs = x.new_empty(n_assign + tail, d_model)
        torch.index_select(x, 0, routing.token_idx, out=xs[:n_assign])
        xs[n_assign:].zero_()
    elif not single:
        xs = x.index_select(0, routing.token_idx)
    # A padded expert writes past its slice into the next one's, which runs later and
    # overwrites it; the last one's overflow lands in rows >= A, and row A is zeroed after.
    ys = x.new_empty(n_assign + max(tail, 1), d_model)
    if x.device.type != "cpu":
        # Off the CPU nothing here synchronises, so the host clock would time kernel launches:
        # about the same per expert whatever its rows, i.e. per row the least-loaded experts
        # would look the costliest and hardware-aware routing would pile tokens onto the
        # busiest. Only CPU times are real; elsewhere the cost is the placement factor.
        cost = None
    start = 0
    clock = time.perf_counter
    for e, n in enumerate(counts):
        if not n:
            continue
        end = start + n
        t0 = clock()
        spot = placed.get(e) if placed else None
        if spot is not None:
            spot.run(x if single else xs[start:end], ys[start:end])
        else:
            rows = end + (row_bucket(n) - n if tail else 0)
            h = swiglu(expert_mm(x if single else xs[start:rows], gate_up, e))
            expert_mm(h, down, e, out=ys[start:rows])
        if cost is not None:
            cost.record(e, clock() - t0, n)
        start = end
    ys[n_assign].zero_()
    w = routing.weights
    ys[:n_assign].mul_((w if w.dtype == x.dtype else w.to(x.dtype)).unsqueeze(-1))
    return ys


class PlacedRun(Protocol):
    """An expert that runs on its own device/dtype (hf.placement.PlacedExpert)."""

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None: ...


def expert_mm(x: torch.Tensor, weight: StoredWeight, e: int, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ expert e's weight in x's dtype (into `out` when given). int8: cast the values and
    scale the output columns (x @ (q * s) == (x @ q) * s for a per-column s), so no scaled
    weight copy is made; except in fp16, where the cast copy is scaled before the matmul."""
    if weight.scale is None:
        return torch.mm(x, weight.materialize(x.dtype, e), out=out)
    if x.dtype == torch.float16:
        # x @ q is 1/scale times x @ w (|q| up to 127): in fp16 (max 65504) it overflows to inf
        # where x @ w fits, so fp16 scales the weight first (in fp32 math, one rounding).
        return torch.mm(x, weight.data[e].to(x.dtype).mul_(weight.scale[e]), out=out)
    y = torch.mm(x, weight.data[e].to(x.dtype), out=out)
    return y.mul_(weight.scale[e].to(x.dtype))


def combine(ys_padded: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_r ys_padded[slots[t, r]]: one gather per rank, no scatter-add. A single
    token's slots are 0..width-1 (its kept outputs are the first rows, in order, or the padding
    row 0 when none was kept; `gating.assign`): it adds row slices instead, in the same order."""
    if slots.shape[0] == 1:
        out = ys_padded[0:1]
        for r in range(1, slots.shape[1]):
            row = ys_padded[r:r + 1]
            out = out + row if r == 1 or out.requires_grad else out.add_(row)
        return out
    out = ys_padded.index_select(0, slots[:, 0])
    for r in range(1, slots.shape[1]):
        out = out + ys_padded.index_select(0, slots[:, r]) if out.requires_grad \
            else out.add_(ys_padded.index_select(0, slots[:, r]))
    return out


def naive_moe_reference(x: torch.Tensor, experts: SwiGLUExperts, routing: Routing
                        ) -> torch.Tensor:
    """Per-assignment Python loop, for tests only: the obviously correct (slow) definition."""
    out = torch.zeros_like(x)
    expert_of = []
    for e, n in enumerate(routing.counts):
        expert_of += [e] * n
    for a, e in enumerate(expert_of):
        t = int(routing.token_idx[a])
        h = swiglu(x[t] @ experts.w_gate_up[e]) @ experts.w_down[e]
        out[t] = out[t] + routing.weights[a] * h
    return out
