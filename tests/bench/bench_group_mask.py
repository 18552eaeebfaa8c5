"""Cost of per-sequence expert-group masks in batched decode: decode steps of one `BatchDecoder`
batch with no scoped sequence, half of them scoped, and all of them scoped, side by side in one
run, on one tiny Mixtral checkpoint built in code (8 experts).

    python tests/bench/bench_group_mask.py [--seqs 16] [--steps 32] [--runs 5] [--threads 1]
                                           [--d-model 64] [--layers 2]

Each configuration prefills the same ``--seqs`` prompts (6 to 20 tokens) in one packed prefill
(untimed), then times ``--steps`` decode steps of the whole batch (greedy; the end-of-sequence
token is ignored here so every configuration steps the same batch size throughout). Scoped
sequences alternate between group a (experts 0-3) and group b (4-7). tokens/s = sequences x
steps / wall time of the steps. Ratio = scoped tokens/s over unscoped tokens/s, the median of
per-run ratios (the configurations run interleaved, in an order rotated each run, so machine
noise hits all alike); "none-again" times the unscoped batch a second time as an A/A control.
Two gates: the family's own top-2 (fixed k: the gated block's fixed-k fast path, which a masked
batch takes too while every top-k pick is allowed, as with groups of 4 here; the general `assign`
otherwise), and a dynamic one (threshold, 1-3 experts).
Writes tests/bench/results/bench_group_mask.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

from sparsegate_workload.batch_decode import BatchDecoder, DecodeRequest  # noqa: E402
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document  # noqa: E402
from sparsegate_workload.hf import build_tiny_checkpoint  # noqa: E402
from sparsegate_workload.hf_serving import load  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_group_mask.json"
GROUPS = ((0, 1, 2, 3), (4, 5, 6, 7))
# Share of scoped sequences; "none-again" is an A/A control (the unscoped batch timed twice):
# its ratio shows the noise of this machine.
CONFIGS = {"none": 0.0, "none-again": 0.0, "half": 0.5, "all": 1.0}


def requests(n: int, vocab: int, scoped: float, steps: int) -> list[DecodeRequest]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(n):
        length = 6 + (i * 7) % 15
        prompt = [1] + torch.randint(3, vocab, (length - 1,), generator=g).tolist()
        # Scoped ones spread evenly through the batch (rows of both groups between unscoped ones).
        scope = GROUPS[i % 2] if int((i + 1) * scoped) > int(i * scoped) else None
        out.append(DecodeRequest(key=i, prompt_ids=prompt, max_tokens=steps + 2, allowed_experts=scope))
    return out


def time_steps(hf, reqs: list[DecodeRequest], steps: int) -> float:
    dec = BatchDecoder(hf)
    dec.add_many(reqs)
    start = time.perf_counter()
    for _ in range(steps):
        dec.step()
    elapsed = time.perf_counter() - start
    assert dec.running == len(reqs), "a sequence ended early: every step must hold the whole batch"
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    gates = {
        "top-2": make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2,
                                "capacityFactor": 8}),
        "dynamic 1-3": make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 3,
                                      "capacityFactor": 8}),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / "mixtral", family="mixtral", hidden_size=args.d_model,
                                     layers=args.layers, expert_ffn=args.d_model)
        for name, doc in gates.items():
            hf = load(path, gate=doc, device="cpu")
            hf.eos_ids = frozenset()  # fixed batch size for the whole run (see the docstring)
            batches = {c: requests(args.seqs, hf.vocab_size, share, args.steps) for c, share in CONFIGS.items()}
            for reqs in batches.values():
                time_steps(hf, reqs, 4)  # untimed warm-up
            times: dict[str, list[float]] = {c: [] for c in CONFIGS}
            order = list(CONFIGS)
            for run in range(args.runs):
                for c in order[run % len(order):] + order[:run % len(order)]:  # rotated: no order bias
                    times[c].append(time_steps(hf, batches[c], args.steps))
            tokens = args.seqs * args.steps
            row = {"gate": name, "tokens_per_s": {c: tokens / statistics.median(t) for c, t in times.items()}}
            for c in ("none-again", "half", "all"):
                row[f"ratio_{c}"] = statistics.median(a / b for a, b in zip(times["none"], times[c]))
            rows.append(row)
    print(f"batched decode with expert-group masks, tiny Mixtral d={args.d_model} layers={args.layers} "
          f"8 experts, {args.seqs} sequences x {args.steps} steps, {args.threads} thread(s), median of {args.runs}")
    print(f"{'gate':>12} {'none tok/s':>11} {'half tok/s':>11} {'all tok/s':>10} {'A/A':>6} "
          f"{'half/none':>10} {'all/none':>9}")
    for r in rows:
        t = r["tokens_per_s"]
        print(f"{r['gate']:>12} {t['none']:>11.0f} {t['half']:>11.0f} {t['all']:>10.0f} "
              f"{r['ratio_none-again']:>6.3f} {r['ratio_half']:>10.3f} {r['ratio_all']:>9.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        machine=platform.processor() or platform.machine(), python=sys.version.split()[0],
        torch=torch.__version__, threads=args.threads, seqs=args.seqs, steps=args.steps,
        d_model=args.d_model, layers=args.layers, runs=args.runs, rows=rows), indent=2))


if __name__ == "__main__":
    main()
