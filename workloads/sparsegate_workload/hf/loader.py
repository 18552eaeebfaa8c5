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

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sparsegate_contracts.gate import GateDocument, GateParams, GateParamsError

from ..moe import MoEStats
from ..precision import PRECISIONS, LayerBytes, Precision, RunningVariance, choose_precision
from ..threshold_control import ThresholdController
from .checkpoint_files import CheckpointError, check_weight_files, family_of, read_config
from .families import MoEFamily
from .gated_block import ActiveGate, GateCall, GateSlot, SparseGatedMoEBlock, pin_gate
from .placement import PlacementSpec, apply_placement, measure_placement_factors
from .precision_file import MeasuredVariances, read_precision_file
from .tool_head import ToolHead, final_hidden, load_tool_head

log = logging.getLogger(__name__)

ACCEPTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Calibration text for checkpoints with a tokenizer: plain English prose, written here (nothing
# downloaded). Its token windows are the "real data" the precision rule measures on.
CALIBRATION_TEXT = (
    "A mixture of experts layer sends every token to a few of its experts. The router scores "
    "each expert, and the gate keeps the fewest experts whose probability mass reaches a "
    "threshold. Experts that see many tokens grow busy while others idle, so training adds a "
    "balance term. When a model is served, its weights can be stored in fewer bits: layers "
    "whose gradients barely move tolerate eight-bit integers, and sensitive layers keep a "
    "sixteen-bit format. The operator rolls a new gate out to a few instances first, watches "
    "error rates and latency, and rolls back when the canary drifts from the stable fleet. "
    "Numbers, names and punctuation matter too: 42 requests, 3.5 seconds, version g-1a2b.")


@dataclasses.dataclass
class GatedForward:
    logits: torch.Tensor            # [B, S, V]
    layers: list[MoEStats]          # one per MoE block, in layer order
    gate: ActiveGate                # the gate every block routed with
    tool_prob: torch.Tensor | None = None  # [B, S] tool-gate probability (None: no tool head)

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
                 tokenizer: Any | None = None,
                 source: Callable[[], list[dict[str, torch.Tensor]]] | None = None) -> None:
        self.model = model
        self.family = family
        self.path = path
        self.tokenizer = tokenizer
        self.top_k = int(model.config.num_experts_per_tok)
        # Unmeasured until `calibrate_gate_precision` or `use_measured`; "auto" then keeps
        # every layer fp32.
        self.gate_sensitivity: list[float] | None = None
        self.expert_sensitivity: list[float] | None = None
        self.calibration_data: str | None = None  # what the variances were measured on
        # Where they came from: "unmeasured", "measured" (here) or "file" (`precision_file`).
        self.sensitivity_source = "unmeasured"
        self.precision_file: Path | None = None
        # A tool-gate head beside the weights (tool_head.py), set by the loader; None: no tool gate.
        self._tool_head: ToolHead | None = None
        # The checkpoint's MoE tensors per block, read again on demand: what a bf16/int8 block
        # is restored from, since it keeps no copy of them (None: lower precisions only).
        self.weight_source = source
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

    @property
    def tool_head(self) -> ToolHead | None:
        return self._tool_head

    @tool_head.setter
    def tool_head(self, head: ToolHead | None) -> None:
        # Kept where the LM head reads its hidden state (the loaded head is a CPU tensor): on
        # a GPU, a CPU weight was copied to the device at every call, a host sync per step.
        device = self.model.get_output_embeddings().weight.device
        self._tool_head = head if head is None or head.weight.device == device else \
            dataclasses.replace(head, weight=head.weight.to(device))

    def upstream_gate_params(self) -> GateParams:
        """Params that reproduce the family's own routing: exactly top-k, fp32 routers.
        Install with ``dropless=True`` (a capacity factor always caps something)."""
        return GateParams(min_experts_per_token=self.top_k, max_experts_per_token=self.top_k,
                          confidence_threshold=1.0, precision_policy="fp32")

    def set_gate(self, gate: GateParams | GateDocument, *, dropless: bool = False,
                 controller: ThresholdController | None = None) -> ActiveGate:
        """Install a gate for the next forwards; one reference swap, so a forward in flight
        keeps the gate it pinned. ``dropless`` ignores capacityFactor (no capacity cap).
        ``controller``: route with its threshold (`ActiveGate.controller`).
        Raises GateParamsError if it asks for more experts per token than the model has."""
        active = self._active_gate(gate, dropless=dropless, controller=controller)
        # Storage first, then the swap: a forward pinned to the old gate computes with
        # whatever each block stores when it reaches it (each block reads its storage once).
        self.store_precisions(active.precisions, active.expert_precisions)
        self._slot.active = active
        return active

    def prepare_gate(self, doc: GateDocument, *, beside: GateDocument | None = None,
                     controller: ThresholdController | None = None) -> ActiveGate:
        """A gate to pin beside the installed one, or beside ``beside`` once that is installed (a
        request-level canary), not installed itself: the weights stay stored as the stable gate
        resolves them, so ``doc``'s precision policy must resolve to that same storage
        (GateParamsError naming precisionPolicy otherwise). ``controller`` as in `set_gate`."""
        active = self._active_gate(doc, dropless=False, controller=controller)
        current = self._active_gate(beside, dropless=False) if beside is not None else self._slot.active
        if (active.precisions, active.expert_precisions) != (current.precisions, current.expert_precisions):
            raise GateParamsError(
                f"precisionPolicy {doc.params.precision_policy!r} resolves to router/expert precisions "
                f"{list(active.precisions)}/{list(active.expert_precisions)}, but this checkpoint stores "
                f"{list(current.precisions)}/{list(current.expert_precisions)} for the installed gate: "
                f"a checkpoint holds one weight storage, so a canary beside it must keep it")
        return active

    def _active_gate(self, gate: GateParams | GateDocument, *, dropless: bool,
                     controller: ThresholdController | None = None) -> ActiveGate:
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
        policy = params.precision_policy
        return ActiveGate(params=params, precisions=self.resolve_precisions(policy),
                          capacity_factor=None if dropless else params.capacity_factor,
                          document=document,
                          expert_precisions=self.resolve_expert_precisions(policy),
                          controller=controller)

    def resolve_precisions(self, policy: str) -> tuple[Precision, ...]:
        """Router weight precision per MoE block. "auto" applies the rule to the measured
        router gradient variance; before `calibrate_gate_precision` ran it keeps fp32."""
        return self._resolve(policy, self.gate_sensitivity)

    def resolve_expert_precisions(self, policy: str) -> tuple[Precision, ...]:
        """Expert weight precision per MoE block, as `resolve_precisions` for the experts."""
        return self._resolve(policy, self.expert_sensitivity)

    def _resolve(self, policy: str, measured: list[float] | None) -> tuple[Precision, ...]:
        if policy != "auto" and policy not in PRECISIONS:
            raise GateParamsError(f"unknown precision policy {policy!r}")
        values: Sequence[float | None] = measured or [None] * len(self.blocks)
        return tuple(choose_precision(policy=policy, sensitivity=v) for v in values)

    def store_precisions(self, gate: Sequence[Precision], experts: Sequence[Precision]
                         ) -> None:
        """Store block i's router in gate[i] and its experts in experts[i]. A block already
        below fp32 that changes is first restored from `weight_source` (the checkpoint read
        again: a transient second copy of the model while it loads), so the result does not
        depend on the order of switches."""
        targets = list(zip(gate, experts, strict=True))
        if len(targets) != len(self.blocks):
            raise ValueError(f"{len(targets)} precisions for {len(self.blocks)} MoE blocks")
        stale = [i for i, (blk, want) in enumerate(zip(self.blocks, targets))
                 if blk.precisions != want and blk.precisions != ("fp32", "fp32")]
        if stale and self.weight_source is not None:
            source = self.weight_source()
            for i in stale:
                self.blocks[i].load_fp32(**source[i])
            del source
        for blk, (g, e) in zip(self.blocks, targets):
            blk.store(gate=g, experts=e)

    def place_experts(self, spec: Mapping[tuple[int | None, int], PlacementSpec]
                      ) -> list[list[float]]:
        """Store the experts `spec` names in their own dtype/device (`placement`), then measure
        and set every block's placement factors (returned per block). Raises PlacementError
        naming the key when it does not fit this model (nothing is placed then)."""
        param = next(self.model.parameters())
        kw = dict(compute_dtype=param.dtype, device=param.device)
        apply_placement(self.blocks, spec, **kw)
        return measure_placement_factors(self.blocks, **kw)

    def weight_bytes(self) -> list[LayerBytes]:
        """Per MoE block: router and expert bytes as stored now, and as fp32 would be."""
        return [blk.weight_bytes() for blk in self.blocks]

    def pinned_gate(self) -> ContextManager[GateCall]:
        """Pin the current gate for everything inside (e.g. a generate()); collects stats."""
        return pin_gate(self._slot.active)

    @contextlib.contextmanager
    def _pinned(self, gate: ActiveGate | None, allowed_experts: Sequence[int] | None,
                device: torch.device) -> Iterator[GateCall]:
        """No autograd, ``gate`` (else the installed one) pinned, ``allowed_experts`` set."""
        with torch.inference_mode(), (pin_gate(gate) if gate is not None else self.pinned_gate()) as call:
            if allowed_experts is not None:
                call.allowed = torch.zeros(self.num_experts, dtype=torch.bool, device=device)
                call.allowed[list(allowed_experts)] = True
            yield call

    def last_position_forward(self, input_ids: torch.Tensor, *, gate: ActiveGate | None = None,
                              allowed_experts: Sequence[int] | None = None
                              ) -> tuple[GatedForward, torch.Tensor]:
        """`forward` with its ``logits`` at each row's last position only ([B, 1, V], not the
        [B, S, V] of every position: GBs for a 150k vocabulary at a few thousand tokens), and the
        final hidden states [B, S, hidden] beside it, which `quality.score_hidden_rows` scores
        with the LM head a chunk of positions at a time."""
        with self._pinned(gate, allowed_experts, input_ids.device) as call:
            hidden = self.model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
            logits = self.model.get_output_embeddings()(hidden[:, -1:])
            tool_prob = self.tool_head.probs(hidden) if self.tool_head is not None else None
        return GatedForward(logits=logits, layers=call.layers, gate=call.gate, tool_prob=tool_prob), hidden

    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                gate: ActiveGate | None = None, allowed_experts: Sequence[int] | None = None) -> GatedForward:
        """One forward under one gate version (``gate``, else the installed one), without autograd.
        ``allowed_experts``: the only experts every block may select (None: all)."""
        with self._pinned(gate, allowed_experts, input_ids.device) as call:
            if self.tool_head is None:
                out, tool_prob = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                            use_cache=False), None
            else:
                out, hidden = final_hidden(self.model, input_ids=input_ids,
                                           attention_mask=attention_mask, use_cache=False)
                tool_prob = self.tool_head.probs(hidden)
        return GatedForward(logits=out.logits, layers=call.layers, gate=call.gate, tool_prob=tool_prob)

    def use_measured(self, measured: MeasuredVariances) -> None:
        """Take the variances of a precision file (`precision_file`) and re-resolve "auto";
        raises CheckpointError naming the file when it measured another layer/expert count."""
        measured.check_model(layers=len(self.blocks), num_experts=self.num_experts)
        self.gate_sensitivity, self.expert_sensitivity = list(measured.router), list(measured.experts)
        self.calibration_data, self.sensitivity_source = measured.data, "file"
        self.precision_file = measured.path
        self._reinstall_gate()

    def _reinstall_gate(self) -> None:
        latest = self._slot.active
        self.set_gate(latest.document or latest.params, dropless=latest.capacity_factor is None,
                      controller=latest.controller)

    def calibrate_gate_precision(self, *, batches: int = 4, batch_size: int = 2,
                                 seq_len: int = 16, seed: int = 1, text: str | None = None,
                                 text_source: str = "CALIBRATION_TEXT") -> list[float]:
        """Measure each block's router and expert gradient variance (as the built-in model
        does: next-token CE + 0.01 balance + entropy terms) and re-resolve "auto". Data: with
        a tokenizer, seeded windows of ``text`` (default `CALIBRATION_TEXT`; ``text_source``
        names it) tokenized by it; without one, seeded random token ids (`calibration_data`
        says which). Blocks stored below fp32 are restored from the checkpoint first. Costs
        `batches` forward+backward passes of the whole model, a gradient per MoE weight and two
        float64 accumulators per MoE weight. Returns the router variances."""
        current = self._slot.active
        n = len(self.blocks)
        self.store_precisions(("fp32",) * n, ("fp32",) * n)
        fp32 = dataclasses.replace(current, precisions=("fp32",) * n,
                                   expert_precisions=("fp32",) * n, controller=None)
        groups = [(blk.gate.weight, (blk.experts.gate_up_proj, blk.experts.down_proj))
                  for blk in self.blocks]
        params = [p for router, experts in groups for p in (router, *experts)]
        gate_acc = [RunningVariance() for _ in groups]
        expert_acc = [RunningVariance() for _ in groups]
        device = params[0].device
        batch_of = self._calibration_batches(batch_size=batch_size, seq_len=seq_len, seed=seed,
                                             text=text, text_source=text_source)
        try:
            for p in params:
                p.requires_grad_(True)
            for _ in range(batches):
                tokens = batch_of().to(device)
                with torch.enable_grad(), pin_gate(fp32) as call:
                    logits = self.model(input_ids=tokens, use_cache=False).logits.float()
                    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                         tokens[:, 1:].reshape(-1))
                    aux = sum(s.aux_loss for s in call.layers)
                    ent = sum(s.entropy_loss for s in call.layers)
                    (ce + 0.01 * aux + ent).backward()
                for i, (router, experts) in enumerate(groups):
                    gate_acc[i].add(router.grad)
                    expert_acc[i].add(torch.cat([w.grad.reshape(-1) for w in experts]))
                for p in params:
                    p.grad = None
        finally:
            for p in params:
                p.requires_grad_(False)
        self.gate_sensitivity = [a.variance() for a in gate_acc]
        self.expert_sensitivity = [a.variance() for a in expert_acc]
        self.sensitivity_source, self.precision_file = "measured", None
        self._reinstall_gate()
        return self.gate_sensitivity

    def _calibration_batches(self, *, batch_size: int, seq_len: int, seed: int,
                             text: str | None, text_source: str) -> Callable[[], torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        vocab = int(self.model.config.vocab_size)
        if self.tokenizer is None:
            self.calibration_data = "random token ids (no tokenizer)"
            return lambda: torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        if text is None:
            text, text_source = CALIBRATION_TEXT, "CALIBRATION_TEXT"
        ids = torch.tensor(self.tokenizer(text)["input_ids"], dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError(f"calibration text {text_source} has no tokens")
        ids = ids.clamp(max=vocab - 1)
        if ids.numel() <= seq_len:
            ids = ids.repeat(seq_len // ids.numel() + 2)
        self.calibration_data = f"{text_source} through its tokenizer ({ids.numel()} tokens)"

        def windows() -> torch.Tensor:
            starts = torch.randint(0, ids.numel() - seq_len + 1, (batch_size,), generator=g)
            return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
        return windows


def _checkpoint_moe_weights(directory: Path, *, family: MoEFamily, dtype: torch.dtype,
                            device: str | torch.device) -> list[dict[str, torch.Tensor]]:
    """Every sparse block's router and expert tensors, read again from the checkpoint (the
    whole model loads transiently; only these tensors are kept)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    block_type = family.block_type()
    return [{"gate": m.gate.weight.detach().to(device),
             "gate_up_proj": m.experts.gate_up_proj.detach().to(device),
             "down_proj": m.experts.down_proj.detach().to(device)}
            for m in model.modules() if isinstance(m, block_type)]


def _refuse_non_finite(model: nn.Module, *, directory: Path, shards: Sequence[Path],
                       dtype: torch.dtype) -> None:
    """Raise CheckpointError naming the first weight holding a NaN or infinite value: the
    checkpoint's tensor and shard when the file holds it, else the model's weight that became
    one in ``dtype`` (a float16 load turns values past 65504 into inf). Served, such a weight
    gives NaN logits (a NaN router row: every token's gate probabilities) or silently wrong
    ones, and int8 storage spreads one NaN over its whole channel. Costs one min/max pass over
    the loaded weights (NaN propagates through both; measured ~5 GiB/s bf16, ~11 GiB/s fp32 on
    2 CPU threads); the files are read again only to name a tensor."""
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue
        flat = param.detach().reshape(-1)
        if flat.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(flat))).all()):
            continue
        in_file = _first_non_finite_tensor(shards)
        if in_file is not None:
            shard, key, nan, inf = in_file
            raise CheckpointError(
                f"{shard}: tensor {key} holds {nan + inf} non-finite values ({nan} NaN, {inf} "
                f"infinite); a model with NaN or infinite weights is not served", file=shard)
        bad = int((~torch.isfinite(flat)).sum())
        raise CheckpointError(
            f"{directory} ({', '.join(p.name for p in shards)}): weight {name} holds {bad} "
            f"values past the range of {dtype} once loaded in it (infinite); load it in a "
            f"wider dtype", file=shards[0])


def _first_non_finite_tensor(shards: Sequence[Path]) -> tuple[Path, str, int, int] | None:
    """(shard, tensor name, NaN count, infinite count) of the first tensor in the files holding
    a non-finite value, None when every stored value is finite."""
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(shard), framework="pt") as fh:
            for key in fh.keys():
                t = fh.get_tensor(key)
                if not t.is_floating_point() or bool(torch.isfinite(t).all()):
                    continue
                nan = int(torch.isnan(t).sum())
                return shard, key, nan, int((~torch.isfinite(t)).sum()) - nan
    return None


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
                        dtype: torch.dtype = torch.float32, calibrate: bool = False,
                        placement: Mapping[tuple[int | None, int], PlacementSpec] | None = None,
                        precision_file: bool = True) -> SparseGatedCausalLM:
    """Read a local checkpoint directory and patch its MoE blocks.

    ``gate`` None installs the family's own top-k routing (dropless); otherwise that gate
    (``dropless`` ignores its capacityFactor). ``precision_file``: take the router and expert
    variances ``precisionPolicy: auto`` resolves from `PRECISION_FILE` beside the weights when
    present (written by ``python -m sparsegate_workload.calibrate``; one that does not match the
    checkpoint raises CheckpointError naming it). ``calibrate`` measures them here instead
    (see `SparseGatedCausalLM.calibrate_gate_precision`).
    ``placement``: experts stored in their own dtype/device (`SparseGatedCausalLM.place_experts`;
    PlacementError when it does not fit).
    Raises CheckpointError (message names the file or field) for unusable input and
    GateParamsError for a gate the model cannot route with.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory = Path(path)
    config_path = directory / "config.json"
    config = read_config(directory)
    family = family_of(config, config_path=config_path)
    if dtype not in ACCEPTED_DTYPES:
        raise CheckpointError(
            f"dtype {dtype} is not accepted (one of "
            f"{', '.join(str(d) for d in ACCEPTED_DTYPES)})", file=None)
    shards = check_weight_files(directory)
    # Before transformers loads anything: a stale precision file fails fast.
    measured = read_precision_file(directory, shards) if precision_file else None
    # Whatever transformers raises (its field validation raises its own types, a field it
    # divides by raises ZeroDivisionError) becomes a CheckpointError naming the file.
    try:
        AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{config_path}: transformers rejects it "
                              f"({type(exc).__name__}: {exc})", file=config_path) from exc
    try:
        # ignore_mismatched_sizes: report a weight of the wrong shape in the loading info
        # (refused below, naming it) rather than as an error that names no weight.
        model, info = AutoModelForCausalLM.from_pretrained(
            directory, local_files_only=True, dtype=dtype,
            output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as exc:
        raise CheckpointError(f"{directory}: transformers could not build the model from "
                              f"{config_path.name} and its weights ({type(exc).__name__}: {exc})",
                              file=directory) from exc
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in (info.get("mismatched_keys") or []))
    if missing or mismatched:
        what = (f"lacks {len(missing)} weights (first: {missing[0]})" if missing
                else f"has {len(mismatched)} weights of the wrong shape (first: {mismatched[0]})")
        names = ", ".join(p.name for p in shards)
        raise CheckpointError(f"{directory} ({names}): {what}", file=shards[0])
    model.to(device)
    _refuse_non_finite(model, directory=directory, shards=shards, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    # Served, the dynamic gate reports its own routing stats: upstream's router-logit recording
    # and load-balancing loss, which a checkpoint saved by a training run asks for on every
    # forward (config.json output_router_logits), would only cost time, and that loss cannot
    # take a KV-cached step's attention mask (a padded batched decode raised). A caller can
    # still ask per call (output_router_logits=True: the patched blocks record their logits).
    model.config.output_router_logits = False
    tokenizer = None
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers and tokenizers raise many types
            present = ", ".join(n for n in TOKENIZER_FILES if (directory / n).is_file())
            raise CheckpointError(f"{directory}: tokenizer files present but unreadable "
                                  f"({present}: {type(exc).__name__}: {exc})",
                                  file=directory) from exc
    lm = SparseGatedCausalLM(
        model, family=family, path=directory, tokenizer=tokenizer,
        source=lambda: _checkpoint_moe_weights(directory, family=family, dtype=dtype,
                                               device=device))
    lm.tool_head = load_tool_head(directory, hidden_size=int(model.config.hidden_size),
                                  has_tokenizer=tokenizer is not None)
    if placement:
        lm.place_experts(placement)
    if measured is not None:
        lm.use_measured(measured)
    if calibrate:
        lm.calibrate_gate_precision()
    if gate is not None:
        lm.set_gate(gate, dropless=dropless)
    log.info("loaded %s checkpoint %s: %d MoE blocks, %d experts, top-%d", family.model_type,
             directory, len(lm.blocks), lm.num_experts, lm.top_k)
    return lm
