"""Train or fine-tune a Hugging Face MoE language model with sparsegate's own gate in the loop.

The model is a transformers causal LM (Mixtral by default) whose MoE blocks are replaced by
`hf.gated_block.SparseGatedMoEBlock`, exactly as the server loads it, so training routes with
the gate that serving will use (top-p threshold, min/max experts, optional capacity cap) and
the saved checkpoint is what ``--model-path`` serves.

Objective, per step (the design article's entropy-regularised loss plus load balancing, summed
over MoE layers as `model.measure_sensitivity` does):

    loss = next-token cross-entropy
         + entropy_beta * sum_layers mean router entropy          (sharper gate, fewer experts)
         + balance_coef * sum_layers E * sum_e f_e * P_e           (Switch-style balance)

A new model starts from a seeded random checkpoint written by `hf.tiny.build_tiny_checkpoint`;
``init_from`` fine-tunes an existing checkpoint instead. ``trainable`` picks what learns: the
routers only, the MoE layers (routers + experts), or every weight. Runs are deterministic for a
seed on one machine and thread count (seeded init, seeded batches, no dropout).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from sparsegate_contracts.gate import GateParams

from ..hf.checkpoint_files import CheckpointError
from ..hf.families import SUPPORTED_FAMILIES
from ..hf.gated_block import ActiveGate, pin_gate
from ..hf.loader import SparseGatedCausalLM, load_moe_checkpoint
from ..hf.precision_file import PRECISION_FILE
from ..hf.tiny import build_tiny_checkpoint
from ..hf.tool_head import TOOL_HEAD_FILE
from ..quality import PROBE_FILE, PROBE_LINES
from .corpus import TokenClass, TokenStream, build_tokenizer, generate_lines, tokenize_lines, \
    tokenize_text

TRAINABLE = ("routers", "moe", "all")
# The gate document's ranges (sparsegate_contracts.gate.validate_params) for the settings the
# CLI writes into it: a run that trains must also write a gate document the server accepts.
MAX_ENTROPY_BETA = 10.0
MAX_CAPACITY_FACTOR = 64.0
TRAINING_FILE = "sparsegate_training.json"  # written beside config.json: how it was trained


class TrainingConfigError(ValueError):
    """Invalid training settings; `field` names the setting (the CLI maps it to its flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class GateSetting:
    """How the gate routes during training: top-k is min = max = k (threshold unused)."""

    threshold: float = 0.6
    min_experts: int = 1
    max_experts: int = 4
    capacity_factor: float | None = None   # None: dropless

    @classmethod
    def top_k(cls, k: int) -> GateSetting:
        return cls(threshold=1.0, min_experts=k, max_experts=k)

    @property
    def label(self) -> str:
        if self.min_experts == self.max_experts:
            return f"top-{self.min_experts}"
        return f"top-p {self.threshold:g} [{self.min_experts},{self.max_experts}]"


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A new model's shape (ignored when fine-tuning: the checkpoint has one)."""

    family: str = "mixtral"
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    experts: int = 8
    expert_ffn: int = 128
    max_positions: int = 256
    vocab_size: int = 320            # tokenizer trained to at most this many tokens
    router_scale: float = 1.0        # router init std = router_scale / sqrt(hidden_size)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    grad_clip: float = 1.0
    # The gate document's entropyBeta. The design article's 0.1 collapsed routing here (router
    # entropy -> 0.002 nats, every token of a layer on one expert: balance loss 7.99 of 8), so
    # training defaults to 0.001, which keeps top-p's expert count responsive to the threshold.
    entropy_beta: float = 0.001
    balance_coef: float = 0.01      # load-balance weight, as in model.measure_sensitivity
    seed: int = 0
    trainable: str = "all"
    gate: GateSetting = GateSetting()
    shape: ModelShape = ModelShape()
    corpus_lines: int = 20_000      # synthetic training lines (~250k tokens)
    heldout_lines: int = 1_500
    hard_fraction: float = 0.5
    text_file: str | None = None    # train on this text instead of the synthetic corpus
    init_from: str | None = None    # fine-tune this checkpoint instead of a new model

    def __post_init__(self) -> None:
        problems = validate(self)
        if problems:
            raise problems[0]


def validate(cfg: TrainConfig) -> list[TrainingConfigError]:
    """Every problem with `cfg`, each naming its field (empty when it can train)."""
    out: list[TrainingConfigError] = []

    def need(ok: bool, field: str, message: str) -> None:
        if not ok:
            out.append(TrainingConfigError(field, message))

    for name in ("steps", "batch_size", "seq_len", "corpus_lines", "heldout_lines"):
        value = getattr(cfg, name)
        need(value >= 1, name, f"must be >= 1, got {value}")
    need(cfg.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {cfg.warmup_steps}")
    for name in ("lr", "grad_clip"):
        value = getattr(cfg, name)
        need(math.isfinite(value) and value > 0, name, f"must be a finite number > 0, got {value}")
    for name in ("entropy_beta", "balance_coef"):
        value = getattr(cfg, name)
        need(math.isfinite(value) and value >= 0, name,
             f"must be a finite number >= 0, got {value}")
    need(not cfg.entropy_beta > MAX_ENTROPY_BETA, "entropy_beta",
         f"must be <= {MAX_ENTROPY_BETA:g} (the gate document's entropyBeta range), "
         f"got {cfg.entropy_beta}")
    need(0.0 <= cfg.hard_fraction <= 1.0, "hard_fraction",
         f"must be in [0, 1], got {cfg.hard_fraction}")
    need(cfg.trainable in TRAINABLE, "trainable",
         f"must be one of {', '.join(TRAINABLE)}, got {cfg.trainable!r}")
    g = cfg.gate
    need(0.0 < g.threshold <= 1.0, "threshold", f"must be in (0, 1], got {g.threshold}")
    need(1 <= g.min_experts <= g.max_experts, "min_experts",
         f"must satisfy 1 <= min_experts ({g.min_experts}) <= max_experts ({g.max_experts})")
    need(g.capacity_factor is None or (math.isfinite(g.capacity_factor)
                                       and 0 < g.capacity_factor <= MAX_CAPACITY_FACTOR),
         "capacity_factor", f"must be in (0, {MAX_CAPACITY_FACTOR:g}] (or unset: dropless), "
         f"got {g.capacity_factor}")
    s = cfg.shape
    need(s.family in SUPPORTED_FAMILIES, "family",
         f"must be one of {', '.join(sorted(SUPPORTED_FAMILIES))}, got {s.family!r}")
    for name in ("hidden_size", "layers", "heads", "experts", "expert_ffn", "max_positions"):
        value = getattr(s, name)
        need(value >= 1, name, f"must be >= 1, got {value}")
    need(s.vocab_size >= 260, "vocab_size",
         f"must be >= 260 (256 bytes + 3 special tokens), got {s.vocab_size}")
    need(s.heads >= 1 and s.hidden_size % max(s.heads, 1) == 0, "heads",
         f"must divide hidden_size ({s.hidden_size}), got {s.heads}")
    need(math.isfinite(s.router_scale) and s.router_scale > 0, "router_scale",
         f"must be > 0, got {s.router_scale}")
    if cfg.init_from is None:
        need(g.max_experts <= s.experts, "max_experts",
             f"must be <= experts ({s.experts}), got {g.max_experts}")
        need(cfg.seq_len <= s.max_positions, "seq_len",
             f"must be <= max_positions ({s.max_positions}), got {cfg.seq_len}")
    elif not (Path(cfg.init_from) / "config.json").is_file():
        out.append(TrainingConfigError("init_from",
                                       f"{cfg.init_from} has no config.json (not a checkpoint)"))
    if cfg.text_file is not None and not Path(cfg.text_file).is_file():
        out.append(TrainingConfigError("text_file", f"{cfg.text_file} is not a readable file"))
    return out


@dataclasses.dataclass
class StepLog:
    step: int
    loss: float
    ce: float
    entropy: float          # mean router entropy over layers (nats)
    balance: float          # mean balance loss over layers (1.0 = uniform)
    experts: float          # mean experts per token over layers


@dataclasses.dataclass
class Evaluation:
    """Held-out scores of one model under one gate: every token scored once."""

    loss: float                          # mean next-token cross-entropy (nats)
    experts: float                       # mean experts per token, averaged over MoE layers
    tokens: int
    by_class: dict[str, dict[str, float]]   # TokenClass name -> {loss, experts, tokens}
    loss_experts_corr: float             # Pearson r of per-token loss and per-token experts

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def to_json(self) -> dict[str, Any]:
        return {"loss": self.loss, "perplexity": self.perplexity, "experts": self.experts,
                "tokens": self.tokens, "byClass": self.by_class,
                "lossExpertsCorrelation": self.loss_experts_corr}


@dataclasses.dataclass
class TrainResult:
    lm: SparseGatedCausalLM
    tokenizer: Any
    heldout: TokenStream
    history: list[StepLog]
    seconds: float
    config: TrainConfig

    @property
    def gate(self) -> ActiveGate:
        return self.lm.gate


def gate_params(setting: GateSetting, *, entropy_beta: float) -> GateParams:
    """The gate document params that route like `setting` (fp32, so nothing is quantised)."""
    return GateParams(confidence_threshold=setting.threshold,
                      min_experts_per_token=setting.min_experts,
                      max_experts_per_token=setting.max_experts,
                      capacity_factor=setting.capacity_factor or 1.0,
                      entropy_beta=entropy_beta, precision_policy="fp32")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def prepare_data(cfg: TrainConfig, tokenizer: Any | None
                 ) -> tuple[Any, TokenStream, TokenStream]:
    """(tokenizer, train stream, held-out stream). A new tokenizer is trained on the training
    text when none is given; held-out lines come from another seed (never trained on)."""
    if cfg.text_file is not None:
        try:
            text = Path(cfg.text_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise TrainingConfigError("text_file", f"{cfg.text_file} is not UTF-8 text "
                                      f"({exc})") from None
        except OSError as exc:
            raise TrainingConfigError("text_file", f"{cfg.text_file} is not readable "
                                      f"({exc})") from None
        cut = int(len(text) * 0.9)
        if tokenizer is None:
            tokenizer = build_tokenizer([text[:cut]], vocab_size=cfg.shape.vocab_size)
        return tokenizer, tokenize_text(tokenizer, text[:cut]), tokenize_text(tokenizer,
                                                                              text[cut:])
    train = generate_lines(cfg.corpus_lines, seed=cfg.seed, hard_fraction=cfg.hard_fraction)
    held = generate_lines(cfg.heldout_lines, seed=10_000 + cfg.seed,
                          hard_fraction=cfg.hard_fraction)
    if tokenizer is None:
        # Trained on the first lines only: the merges settle quickly and this stays fast.
        tokenizer = build_tokenizer([t for t, _ in train[:4000]],
                                    vocab_size=cfg.shape.vocab_size)
    return tokenizer, tokenize_lines(tokenizer, train), tokenize_lines(tokenizer, held)


def probe_lines(cfg: TrainConfig, *, count: int = PROBE_LINES) -> list[str]:
    """The first ``count`` held-out lines (never trained on): the probe set a served checkpoint's
    quality is scored on at each gate load (``quality.PROBE_FILE``). For a text file, its held-out
    tail (the last 10 %, as `prepare_data` cuts it); else the synthetic held-out seed's lines."""
    if cfg.text_file is not None:
        text = Path(cfg.text_file).read_text(encoding="utf-8")
        tail = text[int(len(text) * 0.9):]
        return [ln for ln in tail.splitlines() if ln.strip()][:count]
    held = generate_lines(min(count, cfg.heldout_lines), seed=10_000 + cfg.seed,
                          hard_fraction=cfg.hard_fraction)
    return [t for t, _ in held]


def _new_model(cfg: TrainConfig, tokenizer: Any, workdir: Path) -> SparseGatedCausalLM:
    s = cfg.shape
    build_tiny_checkpoint(workdir, family=s.family, seed=cfg.seed, hidden_size=s.hidden_size,
                          layers=s.layers, heads=s.heads, experts=s.experts,
                          top_k=min(2, s.experts), expert_ffn=s.expert_ffn,
                          vocab_size=len(tokenizer), max_positions=s.max_positions,
                          router_scale=s.router_scale, tokenizer=False)
    return load_moe_checkpoint(workdir)


def _trainable_params(lm: SparseGatedCausalLM, which: str) -> list[torch.nn.Parameter]:
    if which == "all":
        params = list(lm.model.parameters())
    elif which == "moe":
        params = [p for blk in lm.blocks for p in (blk.gate.weight, blk.experts.gate_up_proj,
                                                    blk.experts.down_proj)]
    else:
        params = [blk.gate.weight for blk in lm.blocks]
    lm.model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params


def _lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = (step - cfg.warmup_steps) / span
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _check_lengths(cfg: TrainConfig, stream: TokenStream, heldout: TokenStream) -> None:
    """Training draws windows of seq_len + 1 tokens and evaluation scores whole seq_len chunks:
    a corpus too short for either is a setting error found before any step is taken."""
    for part, share, tokens, need, synthetic_field in (
            ("training", "first 90 %", len(stream), cfg.seq_len + 1, "corpus_lines"),
            ("held-out", "last 10 %", len(heldout), cfg.seq_len, "heldout_lines")):
        if tokens < need:
            where = (f"{cfg.text_file}'s {part} part (its {share})" if cfg.text_file is not None
                     else f"the {part} corpus")
            raise TrainingConfigError(
                "text_file" if cfg.text_file is not None else synthetic_field,
                f"{where} has {tokens} tokens; seq_len {cfg.seq_len} needs at least {need}")


def train(cfg: TrainConfig, *, log: Callable[[StepLog], None] | None = None,
          log_every: int = 50) -> TrainResult:
    """Train per `cfg` and return the model (patched, in memory) with its held-out data."""
    _quiet_transformers()
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's RNG
        torch.manual_seed(cfg.seed)
        with tempfile.TemporaryDirectory(prefix="sparsegate-train-") as tmp:
            if cfg.init_from is not None:
                try:
                    lm = load_moe_checkpoint(cfg.init_from)
                except CheckpointError as exc:  # its message names the file at fault
                    raise TrainingConfigError("init_from", str(exc)) from None
                if lm.tokenizer is None:
                    raise TrainingConfigError("init_from", f"{cfg.init_from} has no tokenizer "
                                              "files (needed to encode the corpus)")
                if cfg.gate.max_experts > lm.num_experts:
                    raise TrainingConfigError(
                        "max_experts", f"must be <= the checkpoint's {lm.num_experts} experts, "
                        f"got {cfg.gate.max_experts}")
                tokenizer, stream, heldout = prepare_data(cfg, lm.tokenizer)
            else:
                tokenizer, stream, heldout = prepare_data(cfg, None)
                lm = _new_model(cfg, tokenizer, Path(tmp))
        _check_lengths(cfg, stream, heldout)
        # The on-disk source of a new model is its random init: never restore from it.
        lm.weight_source = None
        vocab = int(lm.model.config.vocab_size)
        if int(stream.ids.max()) >= vocab:
            raise TrainingConfigError("init_from", f"tokenizer ids reach {int(stream.ids.max())}"
                                      f" but the model's vocab_size is {vocab}")
        lm.model.train()
        params = _trainable_params(lm, cfg.trainable)
        lm.set_gate(gate_params(cfg.gate, entropy_beta=cfg.entropy_beta),
                    dropless=cfg.gate.capacity_factor is None)
        active = lm.gate
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        data_gen = torch.Generator().manual_seed(cfg.seed)
        history: list[StepLog] = []
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, cfg)
            ids, _ = stream.windows(batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                    generator=data_gen)
            with pin_gate(active) as call:
                logits = lm.model(input_ids=ids, use_cache=False).logits
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                 ids[:, 1:].reshape(-1))
            layers = call.layers
            entropy_term = sum((s.entropy_loss for s in layers), ce.new_zeros(()))
            balance = sum((s.aux_loss for s in layers), ce.new_zeros(()))
            loss = ce + entropy_term + cfg.balance_coef * balance
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            entry = StepLog(step=step + 1, loss=float(loss.detach()), ce=float(ce.detach()),
                            entropy=sum(s.entropy for s in layers) / len(layers),
                            balance=float(balance.detach()) / len(layers),
                            experts=sum(s.mean_active for s in layers) / len(layers))
            history.append(entry)
            if log is not None and (entry.step % log_every == 0 or entry.step == cfg.steps
                                    or entry.step == 1):
                log(entry)
    lm.model.eval()
    lm.model.requires_grad_(False)
    return TrainResult(lm=lm, tokenizer=tokenizer, heldout=heldout, history=history,
                       seconds=time.perf_counter() - start, config=cfg)


def evaluate(lm: SparseGatedCausalLM, stream: TokenStream, *, gate: GateParams | None = None,
             seq_len: int = 64, batch_size: int = 32) -> Evaluation:
    """Score every held-out token once under `gate`, run dropless (default: the gate installed
    now, as installed: its capacity cap applies). Per-token experts are each MoE block's kept experts for the position that
    predicts the token, averaged over blocks; tokens are grouped by their `TokenClass`."""
    previous = lm.gate
    if gate is not None:
        lm.set_gate(gate, dropless=True)
    active = lm.gate
    captured: list[torch.Tensor] = []
    hooks = [blk.register_forward_hook(
        lambda mod, args, _out: captured.append(
            mod.route(args[0].reshape(-1, args[0].shape[-1]), active).per_token.float()))
        for blk in lm.blocks]
    ids_all, classes_all = stream.chunks(seq_len=seq_len)
    losses, experts, classes = [], [], []
    try:
        with torch.inference_mode(), pin_gate(active):
            for i in range(0, ids_all.shape[0], batch_size):
                ids = ids_all[i:i + batch_size]
                captured.clear()
                logits = lm.model(input_ids=ids, use_cache=False).logits
                ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:],
                                     reduction="none")
                per_tok = torch.stack(captured).mean(0).view(ids.shape)[:, :-1]
                losses.append(ce.reshape(-1))
                experts.append(per_tok.reshape(-1))
                classes.append(classes_all[i:i + batch_size, 1:].reshape(-1))
    finally:
        for h in hooks:
            h.remove()
        if gate is not None:
            lm.set_gate(previous.document or previous.params,
                        dropless=previous.capacity_factor is None)
    loss, exp, cls = torch.cat(losses), torch.cat(experts), torch.cat(classes)
    by_class = {}
    for c in TokenClass:
        sel = cls == c
        if sel.any():
            by_class[c.name.lower()] = {"loss": float(loss[sel].mean()),
                                        "experts": float(exp[sel].mean()),
                                        "tokens": int(sel.sum())}
    corr = float(torch.corrcoef(torch.stack([loss, exp]))[0, 1]) if exp.std() > 0 else 0.0
    return Evaluation(loss=float(loss.mean()), experts=float(exp.mean()), tokens=int(loss.numel()),
                      by_class=by_class, loss_experts_corr=0.0 if math.isnan(corr) else corr)


def _source_output_router_logits(cfg: TrainConfig) -> bool:
    """config.json's output_router_logits of the checkpoint fine-tuned (False for a new model)."""
    if cfg.init_from is None:
        return False
    try:
        source = json.loads((Path(cfg.init_from) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(source.get("output_router_logits", False)) if isinstance(source, dict) else False


def save_checkpoint(result: TrainResult, out: str | Path, *,
                    evaluation: Evaluation | None = None) -> Path:
    """Write the trained model as a Hugging Face checkpoint (config.json + model.safetensors +
    tokenizer files) that `hf.load_moe_checkpoint` and the server's ``--model-path`` read, plus
    `TRAINING_FILE` recording the objective, the gate it was trained with and its scores, and
    `quality.PROBE_FILE` with held-out lines (`probe_lines`)."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out)
    lm, cfg = result.lm, result.config
    config = copy.deepcopy(lm.model.config)  # the in-memory model keeps its own
    setting = cfg.gate
    # The family's own top-k (what the loader installs without a gate document): top-k runs
    # keep their k; a top-p run gets its trained upper bound.
    config.num_experts_per_tok = setting.max_experts
    # The loader turns output_router_logits off in memory (serving does not want it): write the
    # fine-tuned checkpoint's own value back, not the loader's override.
    config.output_router_logits = _source_output_router_logits(cfg)
    # A fresh upstream model holding the trained tensors: the patched blocks keep the same
    # parameter names, so the state dict maps one to one (strict).
    with torch.random.fork_rng(devices=[]):
        fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict({k: v.detach().contiguous() for k, v in
                           lm.model.state_dict().items()}, strict=True)
    # Staged beside the output (same filesystem), then moved in: no half-written checkpoint.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".sparsegate-train-", dir=out_dir.parent))
    try:
        fresh.save_pretrained(staging)
        result.tokenizer.save_pretrained(staging)
        record = {
            "objective": {"task": "next-token cross-entropy", "entropyBeta": cfg.entropy_beta,
                          "balanceCoef": cfg.balance_coef},
            "gate": {"confidenceThreshold": setting.threshold,
                     "minExpertsPerToken": setting.min_experts,
                     "maxExpertsPerToken": setting.max_experts,
                     "capacityFactor": setting.capacity_factor},
            "trainable": cfg.trainable, "steps": cfg.steps, "batchSize": cfg.batch_size,
            "seqLen": cfg.seq_len, "lr": cfg.lr, "seed": cfg.seed,
            "corpus": (f"text file {cfg.text_file}" if cfg.text_file else
                       f"synthetic: {cfg.corpus_lines} lines, hardFraction {cfg.hard_fraction}"),
            "initFrom": cfg.init_from, "seconds": round(result.seconds, 1),
            "finalTrainLoss": result.history[-1].ce if result.history else None,
            "heldout": evaluation.to_json() if evaluation is not None else None,
        }
        (staging / TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
        # The server scores this file at each gate load (quality.py): held-out text, not the
        # code-made fallback, so a model trained on a user's text is probed on that text.
        (staging / PROBE_FILE).write_text("".join(line + "\n" for line in probe_lines(cfg)),
                                          encoding="utf-8")
        out_dir.mkdir(parents=True, exist_ok=True)
        # Variances measured on the weights replaced here would still match the file's check
        # (same names, shapes and sizes): remove it, so auto is not resolved from old weights.
        # Likewise a tool-gate head fitted on the old weights' hidden states (the CLI fits a
        # new one after saving when asked): left, the server would load and fire it.
        (out_dir / PRECISION_FILE).unlink(missing_ok=True)
        (out_dir / TOOL_HEAD_FILE).unlink(missing_ok=True)
        for item in staging.iterdir():
            target = out_dir / item.name
            if target.is_dir():
                shutil.rmtree(target)
            item.replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir

