"""A tiny causal LM whose FFNs are dynamic sparse MoE layers; built in code, seeded, nothing
downloaded. It is untrained: its job is to exercise routing, gating and serving for real.

Mixed precision (precision.py): `build_model` measures each layer's router and expert gradient
variance on seeded calibration batches, freezes the model and stores every layer's weights in
the precisions its gate's ``precisionPolicy`` resolves to. A forward asked for other precisions
re-stores first (in the calling thread, i.e. between the server's batches): a lower precision is
converted from what is stored; anything else is re-derived from the weights' source (for a built
model, its seed), since a bf16/int8 layer keeps no fp32 copy."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sparsegate_contracts.gate import MAX_EXPERTS_LIMIT, GateParams

from .gating import ToolGate
from .moe import DynamicMoE, MoEStats
from .precision import LayerBytes, Precision, RunningVariance, choose_precision


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    num_experts: int = 8
    d_ff: int = 128
    max_seq_len: int = 256
    seed: int = 0
    # An untrained router is near-uniform, so top-p would pick ~all experts; a wider init gives
    # a spread of confidences like a trained gate, so the per-token expert count really varies.
    router_init_scale: float = 3.0
    # The model's own per-token expert bounds (SparseModel spec.model); a gate's range is
    # clamped into them at routing time (see `effective_gate`). None = num_experts.
    min_experts_per_token: int = 1
    max_experts_per_token: int | None = None

    def __post_init__(self) -> None:
        if self.max_experts_per_token is None:
            object.__setattr__(self, "max_experts_per_token", self.num_experts)
        problems = validate_shape(self)
        if problems:
            raise ValueError("invalid model shape: " + "; ".join(problems))

    def shape(self) -> dict[str, int]:
        """The shape as reported by the server (camelCase, SparseModel spec.model names)."""
        return {"dModel": self.d_model, "experts": self.num_experts, "layers": self.n_layers,
                "heads": self.n_heads, "dFF": self.d_ff, "vocab": self.vocab_size,
                "maxSeqLen": self.max_seq_len,
                "minExpertsPerToken": self.min_experts_per_token,
                "maxExpertsPerToken": int(self.max_experts_per_token or self.num_experts),
                "seed": self.seed}


def validate_shape(cfg: ModelConfig) -> list[str]:
    """Every reason the shape cannot be built, as messages (empty when it can)."""
    problems = [f"{name} must be >= 1, got {value}" for name, value in (
        ("d_model", cfg.d_model), ("n_heads", cfg.n_heads), ("n_layers", cfg.n_layers),
        ("d_ff", cfg.d_ff), ("vocab_size", cfg.vocab_size), ("max_seq_len", cfg.max_seq_len),
        ("num_experts", cfg.num_experts)) if value < 1]
    if problems:
        return problems
    if cfg.d_model % cfg.n_heads:
        problems.append(f"d_model ({cfg.d_model}) must be a multiple of n_heads ({cfg.n_heads})")
    if cfg.num_experts > MAX_EXPERTS_LIMIT:
        problems.append(f"num_experts ({cfg.num_experts}) must be at most {MAX_EXPERTS_LIMIT}")
    lo, hi = cfg.min_experts_per_token, cfg.max_experts_per_token or cfg.num_experts
    if not 1 <= lo <= hi <= cfg.num_experts:
        problems.append(f"experts per token must satisfy 1 <= min ({lo}) <= max ({hi}) <= "
                        f"num_experts ({cfg.num_experts})")
    return problems


def default_heads(d_model: int) -> int:
    """Attention heads for a hidden size: 4 (the tiny model's) when they divide it, else 2 or 1,
    so every dModel the SparseModel CRD admits can be built."""
    return next(h for h in (4, 2, 1) if d_model % h == 0)


def expert_backend(cfg: ModelConfig) -> str:
    """F.grouped_mm needs 16-byte aligned fp32 rows; other widths use the per-expert loop."""
    return "auto" if cfg.d_model % 4 == 0 and cfg.d_ff % 4 == 0 else "loop"


def effective_gate(params: GateParams, cfg: ModelConfig) -> GateParams:
    """The gate as routed by this model: its per-token expert range clamped into the model's.

    A gate is validated against the expert count (never more experts than exist); the model's
    own per-token bounds narrow it further without rejecting it, so one GateConfig can serve
    models with different bounds, and the document (version, checksum) stays as written.
    """
    lo_m = cfg.min_experts_per_token
    hi_m = int(cfg.max_experts_per_token or cfg.num_experts)
    lo = min(max(params.min_experts_per_token, lo_m), hi_m)
    hi = min(max(params.max_experts_per_token, lo), hi_m)
    if (lo, hi) == (params.min_experts_per_token, params.max_experts_per_token):
        return params
    return dataclasses.replace(params, min_experts_per_token=lo, max_experts_per_token=hi)


@dataclasses.dataclass
class ModelOutput:
    logits: torch.Tensor            # [B, S, V]
    tool_prob: torch.Tensor         # [B, S] sigmoid of the tool-gate head
    layers: list[MoEStats]

    # Sums over layers, computed when read (training): serving never reads them.
    @property
    def aux_loss(self) -> torch.Tensor:
        return sum((st.aux_loss for st in self.layers), self.logits.new_zeros(()))

    @property
    def entropy_loss(self) -> torch.Tensor:
        """Sum over layers of beta * gate entropy."""
        return sum((st.entropy_loss for st in self.layers), self.logits.new_zeros(()))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.moe = DynamicMoE(cfg.d_model, cfg.d_ff, cfg.num_experts, backend=expert_backend(cfg))

    def forward(self, x: torch.Tensor, *, gate: GateParams, precision: Precision,
                allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.n_heads, d // self.n_heads) \
            .permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        y, stats = self.moe(self.norm2(x), confidence_threshold=gate.confidence_threshold,
                            min_experts=gate.min_experts_per_token,
                            max_experts=gate.max_experts_per_token,
                            capacity_factor=gate.capacity_factor,
                            entropy_beta=gate.entropy_beta, precision=precision,
                            hardware_cost_lambda=gate.hardware_cost_lambda, allowed=allowed)
        return x + y, stats


class TinyMoELM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.tool_gate = ToolGate(cfg.d_model)
        self.gate_sensitivity: list[float] = []     # per layer, router; empty = unmeasured
        self.expert_sensitivity: list[float] = []   # per layer, experts; empty = unmeasured
        # fp32 MoE weights per layer on demand (see store_precisions); None = no source.
        self.weight_source: Callable[[], list[dict[str, torch.Tensor]]] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        g = torch.Generator().manual_seed(self.cfg.seed)
        d = self.cfg.d_model
        with torch.no_grad():
            self.embed.weight.normal_(0.0, 1.0, generator=g)
            self.pos.weight.normal_(0.0, 0.1, generator=g)
            for blk in self.blocks:
                blk.qkv.weight.normal_(0.0, d ** -0.5, generator=g)
                blk.proj.weight.normal_(0.0, d ** -0.5, generator=g)
                blk.moe.reset_parameters(g)
                blk.moe.gate.weight.mul_(self.cfg.router_init_scale)
            self.tool_gate.proj.weight.normal_(0.0, d ** -0.5, generator=g)
            self.tool_gate.proj.bias.zero_()

    def forward(self, tokens: torch.Tensor, *, gate: GateParams,
                precisions: Sequence[Precision],
                expert_precisions: Sequence[Precision] | None = None,
                allowed_experts: Sequence[int] | None = None) -> ModelOutput:
        """`precisions`: router weight precision per layer. Frozen, the layers are first
        stored as asked (`expert_precisions` None: what `gate.precision_policy` resolves to);
        training, routers fake-quantise to `precisions` and experts stay fp32.
        `allowed_experts`: the only experts every layer's gate may select (None: all)."""
        if self.frozen:
            self.store_precisions(precisions, expert_precisions if expert_precisions is not None
                                  else self.resolve_expert_precisions(gate.precision_policy))
        b, s = tokens.shape
        x = self.embed(tokens) + self.pos(torch.arange(s, device=tokens.device))
        stats: list[MoEStats] = []
        allowed = None
        if allowed_experts is not None:
            allowed = torch.zeros(self.cfg.num_experts, dtype=torch.bool, device=tokens.device)
            allowed[list(allowed_experts)] = True
        for blk, precision in zip(self.blocks, precisions, strict=True):
            x, st = blk(x, gate=gate, precision=precision, allowed=allowed)
            stats.append(st)
        h = self.norm(x)
        logits = h @ self.embed.weight.T  # tied embeddings
        return ModelOutput(logits=logits, tool_prob=self.tool_gate(h), layers=stats)

    def resolve_precisions(self, policy: str) -> tuple[Precision, ...]:
        """Router weight precision per layer for a gate's precisionPolicy (unmeasured: fp32)."""
        return _resolve(policy, self.gate_sensitivity, len(self.blocks))

    def resolve_expert_precisions(self, policy: str) -> tuple[Precision, ...]:
        """Expert weight precision per layer for a gate's precisionPolicy (unmeasured: fp32)."""
        return _resolve(policy, self.expert_sensitivity, len(self.blocks))

    @property
    def frozen(self) -> bool:
        """Serving mode: no MoE weight trains, so weights live in their stored precision."""
        return not any(p.requires_grad for blk in self.blocks for p in blk.moe.parameters())

    def store_precisions(self, gate: Sequence[Precision], experts: Sequence[Precision]
                         ) -> None:
        """Store layer i's router weight in gate[i] and expert weights in experts[i]. A layer
        already stored below fp32 is re-derived from `weight_source` when it changes (so the
        result never depends on the order of switches); without a source only a lower
        precision can be reached (ValueError otherwise)."""
        if not self.frozen:
            raise RuntimeError("store_precisions needs a frozen model (requires_grad_(False))")
        targets = list(zip(gate, experts, strict=True))
        if len(targets) != len(self.blocks):
            raise ValueError(f"{len(targets)} precisions for {len(self.blocks)} layers")
        stale = [i for i, (blk, want) in enumerate(zip(self.blocks, targets))
                 if blk.moe.precisions != want and blk.moe.precisions != ("fp32", "fp32")]
        if stale and self.weight_source is not None:
            source = self.weight_source()
            for i in stale:
                self.blocks[i].moe.load_fp32(**source[i])
            del source  # the transient fp32 copy goes now, before anything else is allocated
        for blk, (g, e) in zip(self.blocks, targets):
            blk.moe.store(gate=g, experts=e)

    def weight_bytes(self) -> list[LayerBytes]:
        """Per MoE layer: router and expert bytes as stored now, and as fp32 would be."""
        return [blk.moe.weight_bytes(i) for i, blk in enumerate(self.blocks)]


def _resolve(policy: str, sensitivity: Sequence[float], n_layers: int
             ) -> tuple[Precision, ...]:
    measured: Sequence[float | None] = sensitivity or [None] * n_layers
    return tuple(choose_precision(policy=policy, sensitivity=s) for s in measured)


def seeded_moe_weights(cfg: ModelConfig) -> list[dict[str, torch.Tensor]]:
    """The fp32 MoE weights of a freshly initialised `TinyMoELM(cfg)` (what `build_model`
    serves), per layer: re-derived from the seed, the source a bf16/int8 layer is restored from."""
    fresh = TinyMoELM(cfg)
    return [{"gate": blk.moe.gate.weight.detach(), "w_gate_up": blk.moe.experts.w_gate_up.detach(),
             "w_down": blk.moe.experts.w_down.detach()} for blk in fresh.blocks]


@dataclasses.dataclass(frozen=True)
class Sensitivity:
    gate: list[float]       # per layer: router weight gradient variance
    experts: list[float]    # per layer: expert weights (gate+up and down together)


def measure_sensitivity(model: TinyMoELM, *, gate: GateParams, batches: int = 4,
                        batch_size: int = 4, seq_len: int = 32, seed: int = 1) -> Sensitivity:
    """Per layer: variance across calibration micro-batches of the router weight's and of the
    expert weights' gradient of the training loss (next-token CE + balance + entropy terms), on
    seeded random token batches (the tiny model's own data: it is untrained, no corpus)."""
    g = torch.Generator().manual_seed(seed)
    gate_acc = [RunningVariance() for _ in model.blocks]
    expert_acc = [RunningVariance() for _ in model.blocks]
    fp32 = ("fp32",) * len(model.blocks)
    for _ in range(batches):
        tokens = torch.randint(0, model.cfg.vocab_size, (batch_size, seq_len), generator=g)
        model.zero_grad(set_to_none=True)
        out = model(tokens, gate=gate, precisions=fp32)
        ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                             tokens[:, 1:].reshape(-1))
        (ce + 0.01 * out.aux_loss + out.entropy_loss).backward()
        for i, blk in enumerate(model.blocks):
            gate_acc[i].add(blk.moe.gate.weight.grad)
            ex = blk.moe.experts
            expert_acc[i].add(torch.cat([ex.w_gate_up.grad.reshape(-1),
                                         ex.w_down.grad.reshape(-1)]))
    model.zero_grad(set_to_none=True)
    return Sensitivity(gate=[a.variance() for a in gate_acc],
                       experts=[a.variance() for a in expert_acc])


def measure_gate_sensitivity(model: TinyMoELM, *, gate: GateParams, batches: int = 4,
                             batch_size: int = 4, seq_len: int = 32, seed: int = 1
                             ) -> list[float]:
    """The router half of `measure_sensitivity`."""
    return measure_sensitivity(model, gate=gate, batches=batches, batch_size=batch_size,
                               seq_len=seq_len, seed=seed).gate


def build_model(cfg: ModelConfig = ModelConfig(), *, gate: GateParams = GateParams()
                ) -> TinyMoELM:
    """Seeded model, calibrated for the precision rule, frozen for serving and stored in the
    precisions `gate.precision_policy` resolves to (its seed is the source for re-stores)."""
    model = TinyMoELM(cfg)
    measured = measure_sensitivity(model, gate=gate)
    model.gate_sensitivity, model.expert_sensitivity = measured.gate, measured.experts
    model.eval().requires_grad_(False)
    model.weight_source = lambda: seeded_moe_weights(cfg)
    policy = gate.precision_policy
    model.store_precisions(model.resolve_precisions(policy),
                           model.resolve_expert_precisions(policy))
    return model
