"""``sparsegate-train`` / ``python -m sparsegate_workload.training``: train or fine-tune a MoE
language model with sparsegate's gate and write a Hugging Face checkpoint the server serves.

    sparsegate-train --output /tmp/moe-demo                      # new tiny Mixtral, ~1 min CPU
    sparsegate-train --output out --init-from ckpt --trainable routers --steps 200
    python -m sparsegate_workload.server --model-path /tmp/moe-demo \\
        --gate-config /tmp/moe-demo/sparsegate_gate.json

Invalid settings exit with status 2 and an argparse error naming the flag.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from sparsegate_contracts.gate import GateDocument, make_document

from ..cli_types import int_at_least
from .trainer import MAX_CAPACITY_FACTOR, MAX_ENTROPY_BETA, TRAINABLE, GateSetting, ModelShape, \
    StepLog, TrainConfig, TrainingConfigError, evaluate, save_checkpoint, train

GATE_FILE = "sparsegate_gate.json"  # the gate document the model was trained with
# TrainConfig fields whose flag is not "--" + the field name with dashes.
_FLAG_OF = {"threshold": "--confidence-threshold", "text_file": "--text-file"}


def _flag(field: str) -> str:
    return _FLAG_OF.get(field, "--" + field.replace("_", "-"))


def _float_in(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
            bracket = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(f"must be in {bracket}{lo}, {hi}], got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    d, s, g = TrainConfig(), ModelShape(), GateSetting()
    p = argparse.ArgumentParser(
        prog="sparsegate-train",
        description="Train (or fine-tune) a MoE LM's routers and experts with next-token "
                    "cross-entropy + entropyBeta * router entropy + balance loss, routing with "
                    "sparsegate's dynamic gate, and write a Hugging Face checkpoint.")
    p.add_argument("--output", required=True, metavar="DIR",
                   help="checkpoint directory to write (config.json, model.safetensors, "
                        "tokenizer files, sparsegate_training.json, sparsegate_gate.json)")
    p.add_argument("--init-from", metavar="DIR",
                   help="fine-tune this checkpoint (a supported MoE family with tokenizer "
                        "files) instead of building a new model")
    p.add_argument("--text-file", metavar="FILE",
                   help="train on this UTF-8 text (90%% train, 10%% held out) instead of the "
                        "synthetic corpus")
    p.add_argument("--trainable", choices=TRAINABLE, default=None,
                   help="what learns: routers only, MoE layers (routers + experts) or all "
                        "weights (default: all for a new model, routers for --init-from)")
    t = p.add_argument_group("optimisation")
    t.add_argument("--steps", type=int_at_least(1), default=d.steps)
    t.add_argument("--batch-size", type=int_at_least(1), default=d.batch_size)
    t.add_argument("--seq-len", type=int_at_least(2), default=d.seq_len)
    t.add_argument("--lr", type=_float_in(0.0, 10.0, lo_open=True), default=d.lr,
                   help="peak AdamW learning rate (linear warm-up, cosine decay to 10%%)")
    t.add_argument("--warmup-steps", type=int_at_least(0), default=d.warmup_steps)
    t.add_argument("--grad-clip", type=_float_in(0.0, 1e6, lo_open=True), default=d.grad_clip)
    t.add_argument("--seed", type=int_at_least(0), default=d.seed,
                   help="seeds the init, the corpus and the batches (same seed, same weights)")
    t.add_argument("--threads", type=int_at_least(1), default=1,
                   help="torch CPU threads (results are reproducible for a given count)")
    o = p.add_argument_group("objective")
    o.add_argument("--entropy-beta", type=_float_in(0.0, MAX_ENTROPY_BETA),
                   default=d.entropy_beta,
                   help="weight of the mean router entropy (the gate's entropyBeta)")
    o.add_argument("--balance-coef", type=_float_in(0.0, 100.0), default=d.balance_coef,
                   help="weight of the load-balance loss")
    r = p.add_argument_group("routing while training")
    r.add_argument("--top-k", type=int_at_least(1), default=None,
                   help="fixed top-k routing (sets min = max = K; threshold unused)")
    r.add_argument("--confidence-threshold", type=_float_in(0.0, 1.0, lo_open=True),
                   default=g.threshold, help="top-p mass to reach (dynamic routing)")
    r.add_argument("--min-experts", type=int_at_least(1), default=g.min_experts)
    r.add_argument("--max-experts", type=int_at_least(1), default=g.max_experts)
    r.add_argument("--capacity-factor", type=_float_in(0.0, MAX_CAPACITY_FACTOR, lo_open=True),
                   default=None, help="per-expert capacity cap while training, also written "
                   "into the gate document (default: dropless while training)")
    m = p.add_argument_group("new model shape (ignored with --init-from)")
    m.add_argument("--family", default=s.family, help="mixtral, qwen2_moe, qwen3_moe or olmoe")
    m.add_argument("--hidden-size", type=int_at_least(1), default=s.hidden_size)
    m.add_argument("--layers", type=int_at_least(1), default=s.layers)
    m.add_argument("--heads", type=int_at_least(1), default=s.heads)
    m.add_argument("--experts", type=int_at_least(1), default=s.experts)
    m.add_argument("--expert-ffn", type=int_at_least(1), default=s.expert_ffn)
    m.add_argument("--max-positions", type=int_at_least(2), default=s.max_positions)
    m.add_argument("--vocab-size", type=int_at_least(1), default=s.vocab_size,
                   help="tokenizer size to train to (>= 260)")
    m.add_argument("--router-scale", type=_float_in(0.0, 100.0, lo_open=True),
                   default=s.router_scale, help="router init std x sqrt(hidden size)")
    c = p.add_argument_group("synthetic corpus")
    c.add_argument("--corpus-lines", type=int_at_least(1), default=d.corpus_lines)
    c.add_argument("--heldout-lines", type=int_at_least(1), default=d.heldout_lines)
    c.add_argument("--hard-fraction", type=_float_in(0.0, 1.0), default=d.hard_fraction,
                   help="share of hard lines (arithmetic, reversal, sorting)")
    p.add_argument("--tool-gate", choices=("none", "calculator"), default="none",
                   help="calculator: after training, fit a tool-gate head (hf.tool_head) that fires "
                        "where a synthetic 'add a+b=' line reaches '=', written beside the weights "
                        "as sparsegate_tool_gate.safetensors: the server then calls the calculator "
                        "there on /v1/infer")
    p.add_argument("--log-every", type=int_at_least(1), default=50)
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """A validated TrainConfig; raises TrainingConfigError naming the field."""
    if args.top_k is not None:
        gate = GateSetting(threshold=1.0, min_experts=args.top_k, max_experts=args.top_k,
                           capacity_factor=args.capacity_factor)
    else:
        gate = GateSetting(threshold=args.confidence_threshold, min_experts=args.min_experts,
                           max_experts=args.max_experts, capacity_factor=args.capacity_factor)
    shape = ModelShape(family=args.family, hidden_size=args.hidden_size, layers=args.layers,
                       heads=args.heads, experts=args.experts, expert_ffn=args.expert_ffn,
                       max_positions=args.max_positions, vocab_size=args.vocab_size,
                       router_scale=args.router_scale)
    trainable = args.trainable or ("routers" if args.init_from else "all")
    return TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                       lr=args.lr, warmup_steps=args.warmup_steps, grad_clip=args.grad_clip,
                       entropy_beta=args.entropy_beta, balance_coef=args.balance_coef,
                       seed=args.seed, trainable=trainable, gate=gate, shape=shape,
                       corpus_lines=args.corpus_lines, heldout_lines=args.heldout_lines,
                       hard_fraction=args.hard_fraction, text_file=args.text_file,
                       init_from=args.init_from)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except TrainingConfigError as exc:
        parser.error(f"{_flag(exc.field)}: {str(exc).split(': ', 1)[1]}")
    out_path = Path(args.output)
    if out_path.exists() and not out_path.is_dir():
        parser.error(f"--output: {args.output} exists and is not a directory")
    torch.set_num_threads(args.threads)

    def log(e: StepLog) -> None:
        print(f"step {e.step:5d}  loss {e.loss:.4f}  ce {e.ce:.4f}  router entropy "
              f"{e.entropy:.3f}  balance {e.balance:.3f}  experts/token {e.experts:.3f}",
              flush=True)

    try:
        result = train(cfg, log=None if args.quiet else log, log_every=args.log_every)
    except TrainingConfigError as exc:  # found only once the checkpoint is read
        parser.error(f"{_flag(exc.field)}: {str(exc).split(': ', 1)[1]}")
    ev = evaluate(result.lm, result.heldout, seq_len=cfg.seq_len)
    out = save_checkpoint(result, args.output, evaluation=ev)
    document = gate_document(cfg, num_experts=result.lm.num_experts)
    (out / GATE_FILE).write_text(document.file_text() + "\n")
    summary = {"output": str(out), "gate": document.version,
               "seconds": round(result.seconds, 1), "heldout": ev.to_json()}
    if args.tool_gate == "calculator":
        summary["toolGate"] = str(fit_calculator_gate(out, document, seed=cfg.seed))
    print(json.dumps(summary, indent=2))
    return 0


def gate_document(cfg: TrainConfig, *, num_experts: int) -> GateDocument:
    """The gate document of what the run trained with (its capacity factor too, when one was
    set), validated against the model's expert count as the server validates it."""
    params: dict[str, float | int] = {"confidenceThreshold": cfg.gate.threshold,
                                      "minExpertsPerToken": cfg.gate.min_experts,
                                      "maxExpertsPerToken": cfg.gate.max_experts,
                                      "entropyBeta": cfg.entropy_beta}
    if cfg.gate.capacity_factor is not None:
        params["capacityFactor"] = cfg.gate.capacity_factor
    return make_document(params, num_experts=num_experts)


TOOL_GATE_LINES = 400  # synthetic lines the calculator head is fitted on


def fit_calculator_gate(out: Path, document: GateDocument, *, seed: int) -> Path:
    """Fit and write the calculator tool-gate head of the checkpoint in ``out``, under the gate
    it was trained with, on synthetic lines of another seed than the training corpus's."""
    from ..hf import fit_tool_head, load_moe_checkpoint
    from .corpus import generate_lines

    lm = load_moe_checkpoint(out, gate=document)
    lines = [text for text, _ in generate_lines(TOOL_GATE_LINES, seed=seed + 1)]
    head = fit_tool_head(lm, lines, fires=lambda prefix: prefix.startswith("add ") and prefix.endswith("="))
    return head.save(out)


if __name__ == "__main__":
    sys.exit(main())
