"""A tool-gate head for a Hugging Face checkpoint: the built-in model's `gating.ToolGate`
(sigmoid(w·h + b) per token) over the hidden state the checkpoint's LM head reads.

A checkpoint ships none; one is read from ``sparsegate_tool_gate.safetensors`` beside the weights
(tensors ``weight`` [hidden] and ``bias`` [1], float32) when that file is present, and only for a
checkpoint with a tokenizer (tool arguments and results are text). `fit_tool_head` makes one: a
logistic regression on the frozen model's final hidden states, labelled by a rule over each
position's text so far (e.g. "an ``add`` line has just reached ``=``"), so the gate fires where a
tool's answer should follow. It changes nothing in the model: without the file, no tool gate.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .checkpoint_files import CheckpointError

TOOL_HEAD_FILE = "sparsegate_tool_gate.safetensors"


@dataclasses.dataclass(frozen=True)
class ToolHead:
    weight: torch.Tensor  # [hidden] float32
    bias: float

    def probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [...] tool-gate probability per position."""
        return torch.sigmoid(hidden.float() @ self.weight.to(hidden.device) + self.bias)

    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(directory) / TOOL_HEAD_FILE
        save_file({"weight": self.weight.detach().float().cpu().contiguous(),
                   "bias": torch.tensor([self.bias], dtype=torch.float32)}, str(path))
        return path


def load_tool_head(directory: str | Path, *, hidden_size: int, has_tokenizer: bool) -> ToolHead | None:
    """The head beside a checkpoint's weights, None when there is no file. Raises
    CheckpointError naming the file when it is unreadable, misshapen, or the checkpoint has no
    tokenizer to read tool arguments with."""
    path = Path(directory) / TOOL_HEAD_FILE
    if not path.is_file():
        return None
    if not has_tokenizer:
        raise CheckpointError(f"{path}: a tool-gate head needs the checkpoint's tokenizer "
                              f"(tool arguments and results are text), and it has none", file=path)
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types
        raise CheckpointError(f"{path}: unreadable tool-gate head ({exc})", file=path) from exc
    weight, bias = tensors.get("weight"), tensors.get("bias")
    if weight is None or bias is None or tuple(weight.shape) != (hidden_size,) or bias.numel() != 1:
        raise CheckpointError(
            f"{path}: a tool-gate head holds weight [{hidden_size}] and bias [1], got "
            f"{ {k: list(v.shape) for k, v in tensors.items()} }", file=path)
    bad = [k for k, v in (("weight", weight), ("bias", bias)) if not bool(v.float().isfinite().all())]
    if bad:  # a NaN head's probability is NaN, never above the threshold: a silently dead gate
        raise CheckpointError(f"{path}: tool-gate head {' and '.join(bad)}: NaN or "
                              f"infinite values", file=path)
    return ToolHead(weight=weight.float(), bias=float(bias.reshape(())))


def final_hidden(model: Any, **inputs: Any) -> tuple[Any, torch.Tensor]:
    """Run ``model(**inputs)`` and capture what its LM head reads ([B, S, hidden]): the final
    hidden state, whatever the family calls its last norm."""
    captured: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: captured.append(args[0]))
    try:
        out = model(**inputs)
    finally:
        hook.remove()
    return out, captured[-1]


def fit_tool_head(lm: Any, texts: Sequence[str], *, fires: Callable[[str], bool],
                  steps: int = 500, lr: float = 0.05) -> ToolHead:
    """Fit a head on ``lm`` (a `SparseGatedCausalLM` with a tokenizer, under its installed
    gate): position i of a text is positive when ``fires(text of tokens 0..i)``. Full-batch Adam
    on class-balanced logistic loss over standardised features, from zeros (deterministic);
    the standardisation is folded into the returned weight and bias. Raises ValueError when
    the labels are all one class or there is no tokenizer."""
    tok = lm.tokenizer
    if tok is None:
        raise ValueError("fit_tool_head needs a checkpoint with a tokenizer")
    if steps < 1 or not lr > 0:
        raise ValueError(f"steps must be >= 1 and lr > 0, got steps={steps}, lr={lr}")
    device = next(lm.model.parameters()).device
    feats, labels = [], []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        with torch.inference_mode():
            _, hidden = final_hidden(lm.model, input_ids=torch.tensor([ids], device=device),
                                     use_cache=False)
        feats.append(hidden[0].float().cpu())
        labels.append(torch.tensor([float(fires(tok.decode(ids[:i + 1]))) for i in range(len(ids))]))
    x, y = torch.cat(feats), torch.cat(labels)
    positives = float(y.sum())
    if positives == 0 or positives == len(y):
        raise ValueError(f"fires() labelled {int(positives)} of {len(y)} positions: a head needs both classes")
    mu, sd = x.mean(0), x.std(0) + 1e-6
    z = (x - mu) / sd
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=lr)
    pos_weight = torch.tensor((len(y) - positives) / positives)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(z @ w + b, y, pos_weight=pos_weight).backward()
            opt.step()
    weight = (w.detach() / sd)
    return ToolHead(weight=weight, bias=float(b.detach() - (mu * weight).sum()))
