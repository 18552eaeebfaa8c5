"""A tiny causal LM whose FFNs are dynamic sparse MoE layers; built in code, seeded, nothing
downloaded. It is untrained: its job is to exercise routing, gating and serving for real."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sparsegate_contracts.gate import MAX_EXPERTS_LIMIT, GateParams

from .gating import ToolGate
from .moe import DynamicMoE, MoEStats
from .precision import Precision, choose_precision, gradient_variance


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
    aux_loss: torch.Tensor          # sum over layers
    entropy_loss: torch.Tensor      # sum over layers of beta * gate entropy


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.moe = DynamicMoE(cfg.d_model, cfg.d_ff, cfg.num_experts, backend=expert_backend(cfg))

    def forward(self, x: torch.Tensor, *, gate: GateParams, precision: Precision
                ) -> tuple[torch.Tensor, MoEStats]:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.n_heads, d // self.n_heads) \
            .permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        y, stats = self.moe(self.norm2(x), confidence_threshold=gate.confidence_threshold,
                            min_experts=gate.min_experts_per_token,
                            max_experts=gate.max_experts_per_token,
                            capacity_factor=gate.capacity_factor,
                            entropy_beta=gate.entropy_beta, precision=precision)
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
        self.gate_sensitivity: list[float] = []
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
                precisions: Sequence[Precision]) -> ModelOutput:
        b, s = tokens.shape
        x = self.embed(tokens) + self.pos(torch.arange(s, device=tokens.device))
        stats: list[MoEStats] = []
        for blk, precision in zip(self.blocks, precisions, strict=True):
            x, st = blk(x, gate=gate, precision=precision)
            stats.append(st)
        h = self.norm(x)
        logits = h @ self.embed.weight.T  # tied embeddings
        zero = logits.new_zeros(())
        return ModelOutput(logits=logits, tool_prob=self.tool_gate(h), layers=stats,
                           aux_loss=sum((st.aux_loss for st in stats), zero),
                           entropy_loss=sum((st.entropy_loss for st in stats), zero))

    def resolve_precisions(self, policy: str) -> tuple[Precision, ...]:
        return tuple(choose_precision(policy=policy, sensitivity=s)
                     for s in self.gate_sensitivity)


def measure_gate_sensitivity(model: TinyMoELM, *, gate: GateParams, batches: int = 4,
                             batch_size: int = 4, seq_len: int = 32, seed: int = 1
                             ) -> list[float]:
    """Per layer: variance across calibration micro-batches of the gate weight's gradient of
    the training loss (next-token CE + balance + entropy terms); seeded, so deterministic."""
    g = torch.Generator().manual_seed(seed)
    grads: list[list[torch.Tensor]] = [[] for _ in model.blocks]
    fp32 = ("fp32",) * len(model.blocks)
    for _ in range(batches):
        tokens = torch.randint(0, model.cfg.vocab_size, (batch_size, seq_len), generator=g)
        model.zero_grad(set_to_none=True)
        out = model(tokens, gate=gate, precisions=fp32)
        ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                             tokens[:, 1:].reshape(-1))
        (ce + 0.01 * out.aux_loss + out.entropy_loss).backward()
        for i, blk in enumerate(model.blocks):
            grads[i].append(blk.moe.gate.weight.grad.detach().clone())
    model.zero_grad(set_to_none=True)
    return [gradient_variance(gs) for gs in grads]


def build_model(cfg: ModelConfig = ModelConfig(), *, gate: GateParams = GateParams()
                ) -> TinyMoELM:
    """Seeded model, calibrated for the precision rule, frozen for serving."""
    model = TinyMoELM(cfg)
    model.gate_sensitivity = measure_gate_sensitivity(model, gate=gate)
    model.eval().requires_grad_(False)
    for blk in model.blocks:
        blk.moe.gate.freeze_precisions()
    return model
