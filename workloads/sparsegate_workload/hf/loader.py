"""Load a local Hugging Face MoE checkpoint and give every MoE block sparsegate's dynamic gate.

    lm = load_moe_checkpoint("/models/mixtral-tiny", gate=document)   # GateDocument or GateParams
    out = lm.forward(input_ids)              # logits + per-layer routing stats, one gate version
    lm.set_gate(new_document)                # hot swap: takes effect on the next forward
    with lm.pinned_gate() as call:           # one gate for a whole generate(); stats in call
        lm.model.generate(input_ids, max_new_tokens=8)

Nothing is downloaded: transformers reads the directory with ``local_files_only=True``, after
`checkpoint_files` has checked it (bad input raises `CheckpointError` naming the file).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from sparsegate_contracts.gate import GateDocument, GateParams, GateParamsError

from ..moe import MoEStats
from ..precision import PRECISIONS, Precision, choose_precision, gradient_variance
from .checkpoint_files import CheckpointError, check_weight_files, family_of, read_config
from .families import MoEFamily
from .gated_block import ActiveGate, GateCall, GateSlot, SparseGatedMoEBlock, pin_gate

log = logging.getLogger(__name__)

ACCEPTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclasses.dataclass
class GatedForward:
    logits: torch.Tensor            # [B, S, V]
    layers: list[MoEStats]          # one per MoE block, in layer order
    gate: ActiveGate                # the gate every block routed with

    @property
    def mean_active_experts(self) -> float:
        return sum(s.mean_active for s in self.layers) / max(len(self.layers), 1)

    @property
    def mean_selected_experts(self) -> float:
        return sum(s.mean_selected for s in self.layers) / max(len(self.layers), 1)

    @property
    def dropped(self) -> int:
        return sum(s.dropped for s in self.layers)


class SparseGatedCausalLM:
    """A transformers causal LM whose MoE blocks route with the gate installed by `set_gate`."""

    def __init__(self, model: nn.Module, *, family: MoEFamily, path: Path,
                 tokenizer: Any | None = None) -> None:
        self.model = model
        self.family = family
        self.path = path
        self.tokenizer = tokenizer
        self.top_k = int(model.config.num_experts_per_tok)
        # Unmeasured until `calibrate_gate_precision`; "auto" then keeps every router in fp32.
        self.gate_sensitivity: list[float] | None = None
        self._slot = GateSlot(ActiveGate(params=self.upstream_gate_params(), precisions=(),
                                         capacity_factor=None))
        self.blocks = _patch_blocks(model, family=family, slot=self._slot)
        if not self.blocks:
            raise CheckpointError(f"{path}: the model has no {family.block_class} to patch",
                                  file=path)
        self.num_experts = self.blocks[0].num_experts  # the router's rows: what really exists
        self.set_gate(self.upstream_gate_params(), dropless=True)

    @property
    def gate(self) -> ActiveGate:
        return self._slot.active

    def upstream_gate_params(self) -> GateParams:
        """Params that reproduce the family's own routing: exactly top-k, fp32 routers.
        Install with ``dropless=True`` (a capacity factor always caps something)."""
        return GateParams(min_experts_per_token=self.top_k, max_experts_per_token=self.top_k,
                          confidence_threshold=1.0, precision_policy="fp32")

    def set_gate(self, gate: GateParams | GateDocument, *, dropless: bool = False
                 ) -> ActiveGate:
        """Install a gate for the next forwards; one reference swap, so a forward in flight
        keeps the gate it pinned. ``dropless`` ignores capacityFactor (no capacity cap).
        Raises GateParamsError if it asks for more experts per token than the model has."""
        document = gate if isinstance(gate, GateDocument) else None
        params = gate.params if isinstance(gate, GateDocument) else gate
        for name, value in (("minExpertsPerToken", params.min_experts_per_token),
                            ("maxExpertsPerToken", params.max_experts_per_token)):
            if value > self.num_experts:
                raise GateParamsError(
                    f"{name} ({value}) exceeds the model's {self.num_experts} experts")
        if params.min_experts_per_token > params.max_experts_per_token:
            raise GateParamsError(
                f"minExpertsPerToken ({params.min_experts_per_token}) must not exceed "
                f"maxExpertsPerToken ({params.max_experts_per_token})")
        active = ActiveGate(params=params,
                            precisions=self.resolve_precisions(params.precision_policy),
                            capacity_factor=None if dropless else params.capacity_factor,
                            document=document)
        self._slot.active = active
        return active

    def resolve_precisions(self, policy: str) -> tuple[Precision, ...]:
        """Router weight precision per MoE block. "auto" uses the measured gate sensitivity;
        before `calibrate_gate_precision` ran it keeps fp32 (unmeasured counts as sensitive)."""
        if policy == "auto" and self.gate_sensitivity is not None:
            return tuple(choose_precision(policy=policy, sensitivity=s)
                         for s in self.gate_sensitivity)
        if policy == "auto":
            return ("fp32",) * len(self.blocks)
        if policy in PRECISIONS:
            return (policy,) * len(self.blocks)  # type: ignore[return-value]
        raise GateParamsError(f"unknown precision policy {policy!r}")

    def pinned_gate(self) -> ContextManager[GateCall]:
        """Pin the current gate for everything inside (e.g. a generate()); collects stats."""
        return pin_gate(self._slot.active)

    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None
                ) -> GatedForward:
        """One forward under one gate version, without autograd."""
        with torch.inference_mode(), self.pinned_gate() as call:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             use_cache=False)
        return GatedForward(logits=out.logits, layers=call.layers, gate=call.gate)

    def calibrate_gate_precision(self, *, batches: int = 4, batch_size: int = 2,
                                 seq_len: int = 16, seed: int = 1) -> list[float]:
        """Measure each router's gradient variance (as the built-in model does: next-token
        CE + 0.01 balance + entropy terms on seeded random tokens) and re-resolve "auto".
        Costs `batches` forward+backward passes of the whole model."""
        g = torch.Generator().manual_seed(seed)
        weights = [blk.gate.weight for blk in self.blocks]
        grads: list[list[torch.Tensor]] = [[] for _ in weights]
        current = self._slot.active
        fp32 = dataclasses.replace(current, precisions=("fp32",) * len(self.blocks))
        device = weights[0].device
        vocab = int(self.model.config.vocab_size)
        try:
            for w in weights:
                w.requires_grad_(True)
            for _ in range(batches):
                tokens = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
                with torch.enable_grad(), pin_gate(fp32) as call:
                    logits = self.model(input_ids=tokens, use_cache=False).logits.float()
                    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                         tokens[:, 1:].reshape(-1))
                    aux = sum(s.aux_loss for s in call.layers)
                    ent = sum(s.entropy_loss for s in call.layers)
                    (ce + 0.01 * aux + ent).backward()
                for i, w in enumerate(weights):
                    grads[i].append(w.grad.detach().float().clone())
                    w.grad = None
        finally:
            for w in weights:
                w.requires_grad_(False)
        self.gate_sensitivity = [gradient_variance(gs) for gs in grads]
        latest = self._slot.active
        self.set_gate(latest.document or latest.params, dropless=latest.capacity_factor is None)
        return self.gate_sensitivity


def _patch_blocks(model: nn.Module, *, family: MoEFamily, slot: GateSlot
                  ) -> list[SparseGatedMoEBlock]:
    block_type = family.block_type()
    renormalize = family.renormalize(model.config)
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, block_type)]
    blocks = []
    for index, (parent, name, child) in enumerate(targets):
        block = SparseGatedMoEBlock(child, moe_index=index, renormalize=renormalize,
                                    shared_expert=family.shared_expert, slot=slot)
        setattr(parent, name, block)
        blocks.append(block)
    return blocks


def load_moe_checkpoint(path: str | Path, *, gate: GateParams | GateDocument | None = None,
                        dropless: bool = False, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, calibrate: bool = False
                        ) -> SparseGatedCausalLM:
    """Read a local checkpoint directory and patch its MoE blocks.

    ``gate`` None installs the family's own top-k routing (dropless); otherwise that gate
    (``dropless`` ignores its capacityFactor). ``calibrate`` measures router sensitivity for
    ``precisionPolicy: auto`` (see `SparseGatedCausalLM.calibrate_gate_precision`).
    Raises CheckpointError (message names the file or field) for unusable input and
    GateParamsError for a gate the model cannot route with.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(path)
    config = read_config(directory)
    family = family_of(config, config_path=directory / "config.json")
    if dtype not in ACCEPTED_DTYPES:
        raise CheckpointError(
            f"dtype {dtype} is not accepted (one of "
            f"{', '.join(str(d) for d in ACCEPTED_DTYPES)})", file=None)
    shards = check_weight_files(directory)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=dtype, output_loading_info=True)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{directory}: transformers could not load it ({exc})",
                              file=directory) from exc
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in (info.get("mismatched_keys") or []))
    if missing or mismatched:
        what = (f"lacks {len(missing)} weights (first: {missing[0]})" if missing
                else f"has {len(mismatched)} weights of the wrong shape (first: {mismatched[0]})")
        names = ", ".join(p.name for p in shards)
        raise CheckpointError(f"{directory} ({names}): {what}", file=shards[0])
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    tokenizer = None
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{directory}: tokenizer files present but unreadable ({exc})",
                                  file=directory) from exc
    lm = SparseGatedCausalLM(model, family=family, path=directory, tokenizer=tokenizer)
    if calibrate:
        lm.calibrate_gate_precision()
    if gate is not None:
        lm.set_gate(gate, dropless=dropless)
    log.info("loaded %s checkpoint %s: %d MoE blocks, %d experts, top-%d", family.model_type,
             directory, len(lm.blocks), lm.num_experts, lm.top_k)
    return lm
