"""A tiny causal LM whose FFNs are dynamic sparse MoE layers; built in code, seeded, nothing
downloaded. It is untrained: its job is to exercise routing, gating and serving for real."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .gateparams import GateParams
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
        self.moe = DynamicMoE(cfg.d_model, cfg.d_ff, cfg.num_experts)

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
