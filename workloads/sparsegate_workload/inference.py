"""One serving batch through the model: tokens in, next tokens and routing stats out.
Pure torch (no web framework) so the server stays a thin adapter."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from sparsegate_contracts.gate import GateParams

from .gating import tool_fires
from .model import TinyMoELM
from .precision import Precision
from .quality import Score, score_rows


@dataclasses.dataclass(frozen=True)
class InferenceResult:
    next_tokens: list[int]                  # greedy next token per sequence
    last_logits: list[list[float]] | None   # [B, V] when asked for
    expert_counts: list[list[int]]          # [layer][expert] tokens processed in this batch
    active_experts_per_token: float         # mean over layers of kept assignments per token
    selected_experts_per_token: float       # same, before the capacity cap
    dropped_assignments: int
    gate_entropy: float                     # mean over layers (nats)
    tool_calls: list[list[int]]             # per sequence: positions whose tool gate fired
    tool_gate_fire_rate: float
    num_tokens: int
    prompt_score: Score = Score(0.0, 0)     # next-token NLL of the batch's own tokens (quality.py)
    last_tool_prob: list[float] = dataclasses.field(default_factory=list)  # [B] at the last position


def run_batch(model: TinyMoELM, tokens: Sequence[Sequence[int]], *, gate: GateParams,
              precisions: Sequence[Precision], return_logits: bool = False,
              allowed_experts: Sequence[int] | None = None) -> InferenceResult:
    """``allowed_experts``: the request's expert group (per-request access); None: every expert."""
    batch = torch.tensor(tokens, dtype=torch.long)
    with torch.inference_mode():
        out = model(batch, gate=gate, precisions=precisions, allowed_experts=allowed_experts)
        last = out.logits[:, -1, :]
        fired = tool_fires(out.tool_prob, threshold=gate.tool_gate_threshold)
        n_layers = len(out.layers)
        return InferenceResult(
            next_tokens=last.argmax(dim=-1).tolist(),
            last_logits=last.tolist() if return_logits else None,
            expert_counts=[st.counts for st in out.layers],
            active_experts_per_token=sum(st.mean_active for st in out.layers) / n_layers,
            selected_experts_per_token=sum(st.mean_selected for st in out.layers) / n_layers,
            dropped_assignments=sum(st.dropped for st in out.layers),
            gate_entropy=sum(st.entropy for st in out.layers) / n_layers,
            tool_calls=[row.nonzero().squeeze(1).tolist() for row in fired],
            tool_gate_fire_rate=float(fired.float().mean()),
            num_tokens=batch.numel(),
            prompt_score=score_rows(out.logits, batch),
            last_tool_prob=out.tool_prob[:, -1].tolist(),
        )
