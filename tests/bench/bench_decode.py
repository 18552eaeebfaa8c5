"""Decode throughput of the sparsegate server's continuous-batching engine vs transformers'
own ``generate()``, on one tiny Mixtral checkpoint built in code, side by side in one run.

    python tests/bench/bench_decode.py [--concurrency 1,8,32] [--max-tokens 32] [--runs 3]
                                       [--threads 1] [--d-model 64] [--layers 2]

Same checkpoint, same prompts (distinct, 6 to 20 tokens), greedy, stop at the checkpoint's
end-of-sequence token or ``--max-tokens``:
- sparsegate: the server's generation path minus HTTP — `BatchEngine` + `BatchDecoder` on the
  server's model thread (`ModelThread`), all N requests submitted at once (continuous batching,
  a KV cache per sequence, sparsegate's gated MoE blocks with the family's own top-2, dropless);
- HF sequential: the unpatched checkpoint through ``model.generate()``, one request after the
  other (what serving with ``generate()`` per request gives);
- HF batched: one ``model.generate()`` call over all N prompts left-padded (transformers' own
  static batching; its pad tokens also run through the MoE layers).
tokens/s = tokens generated / wall time of the whole set. Ratio = sparsegate tokens/s over each
baseline's, median of ``--runs`` repetitions (the three run interleaved, so machine noise hits
all alike). The routing is the same top-2 on both sides, so the tokens must agree: the number
of requests whose tokens differ from HF sequential is printed too (the most in any run; expected 0).
Goal (issue "Real MoE models"): >= 2x at 8 concurrent, >= 1x at 1, vs HF sequential.
Writes tests/bench/results/bench_decode.json.
"""

from __future__ import annotations

import argparse
import asyncio
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

from sparsegate_workload.batch_decode import BatchDecoder  # noqa: E402
from sparsegate_workload.batch_engine import BatchEngine  # noqa: E402
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document  # noqa: E402
from sparsegate_workload.hf import build_tiny_checkpoint  # noqa: E402
from sparsegate_workload.hf_serving import load  # noqa: E402
from sparsegate_workload.model_thread import ModelThread  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_decode.json"
GOALS = {8: 2.0, 1: 1.0}  # concurrency -> sparsegate / HF sequential tokens/s


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(n):
        length = 6 + (i * 7) % 15
        out.append([1] + torch.randint(3, vocab, (length - 1,), generator=g).tolist())
    return out


def run_sparsegate(hf, batch: list[list[int]], max_tokens: int, max_num_seqs: int
                   ) -> tuple[float, list[list[int]]]:
    async def go() -> tuple[float, list[list[int]]]:
        with ModelThread() as pool:
            engine = BatchEngine(BatchDecoder(hf), executor=pool, max_num_seqs=max_num_seqs)
            start = time.perf_counter()
            handles = [engine.submit(p, max_tokens=max_tokens) for p in batch]
            gens = await asyncio.gather(*[h.done for h in handles])
            return time.perf_counter() - start, [g.token_ids for g in gens]
    return asyncio.run(go())


def run_hf_sequential(model, batch: list[list[int]], max_tokens: int
                      ) -> tuple[float, list[list[int]]]:
    out = []
    start = time.perf_counter()
    with torch.inference_mode():
        for p in batch:
            ids = torch.tensor([p])
            seq = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
            out.append(_strip(seq[0, len(p):].tolist(), model))
    return time.perf_counter() - start, out


def run_hf_batched(model, batch: list[list[int]], max_tokens: int
                   ) -> tuple[float, list[list[int]]]:
    pad = model.config.pad_token_id
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    start = time.perf_counter()
    with torch.inference_mode():
        seqs = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                              do_sample=False)
    elapsed = time.perf_counter() - start
    return elapsed, [_strip(row[width:].tolist(), model) for row in seqs]


def _strip(tokens: list[int], model) -> list[int]:
    """generate() pads finished rows with pad tokens after their EOS: keep up to the EOS."""
    eos = model.config.eos_token_id
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / "mixtral", family="mixtral",
                                     hidden_size=args.d_model, layers=args.layers,
                                     expert_ffn=args.d_model)
        upstream = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
        # The family's own top-2, capacity 8x (caps nothing): the same routing as upstream.
        top2 = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2,
                              "maxExpertsPerToken": 2, "capacityFactor": 8})
        hf = load(path, gate=top2, device="cpu")
        vocab = hf.vocab_size
        rows = []
        for n in levels:
            batch = prompts(n, vocab)
            times: dict[str, list[float]] = {"sg": [], "seq": [], "bat": []}
            counts: dict[str, list[int]] = {"sg": [], "seq": [], "bat": []}  # tokens, per run
            mismatched = 0  # the most requests differing from HF sequential in any run
            # Untimed warm-up of each path (first calls pay one-off allocations and imports).
            run_sparsegate(hf, batch, 4, max_num_seqs=max(levels))
            run_hf_sequential(upstream, batch[:1], 4)
            run_hf_batched(upstream, batch, 4)
            for _ in range(args.runs):
                t, ours = run_sparsegate(hf, batch, args.max_tokens, max_num_seqs=max(levels))
                times["sg"].append(t)
                t, seq = run_hf_sequential(upstream, batch, args.max_tokens)
                times["seq"].append(t)
                t, bat = run_hf_batched(upstream, batch, args.max_tokens)
                times["bat"].append(t)
                for k, out in (("sg", ours), ("seq", seq), ("bat", bat)):
                    counts[k].append(sum(map(len, out)))
                mismatched = max(mismatched, sum(a != b for a, b in zip(ours, seq, strict=True)))
            # tokens/s of each run from that run's own tokens (and time).
            rate = {k: [c / t for c, t in zip(counts[k], times[k])] for k in times}
            tokens = {k: statistics.median(v) for k, v in counts.items()}
            tps = {k: statistics.median(v) for k, v in rate.items()}
            ratio_seq = statistics.median(a / b for a, b in zip(rate["sg"], rate["seq"]))
            ratio_bat = statistics.median(a / b for a, b in zip(rate["sg"], rate["bat"]))
            rows.append(dict(concurrency=n, tokens=tokens, tokens_per_s=tps,
                             ratio_vs_hf_sequential=ratio_seq, ratio_vs_hf_batched=ratio_bat,
                             requests_with_other_tokens=mismatched, goal=GOALS.get(n)))
    print(f"decode throughput, tiny Mixtral d={args.d_model} layers={args.layers} 8 experts "
          f"top-2, max_tokens={args.max_tokens}, {args.threads} thread(s), median of "
          f"{args.runs}")
    print(f"{'N':>3} {'sparsegate tok/s':>17} {'HF seq tok/s':>13} {'HF batched tok/s':>17} "
          f"{'x HF seq':>9} {'x HF batched':>13} {'goal':>6} {'tokens differ':>14}")
    for r in rows:
        t = r["tokens_per_s"]
        goal = f">={r['goal']:g}" if r["goal"] else "-"
        print(f"{r['concurrency']:>3} {t['sg']:>17.0f} {t['seq']:>13.0f} {t['bat']:>17.0f} "
              f"{r['ratio_vs_hf_sequential']:>9.2f} {r['ratio_vs_hf_batched']:>13.2f} "
              f"{goal:>6} {r['requests_with_other_tokens']:>8}/{r['concurrency']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        machine=platform.processor() or platform.machine(), python=sys.version.split()[0],
        torch=torch.__version__, threads=args.threads, max_tokens=args.max_tokens,
        d_model=args.d_model, layers=args.layers, runs=args.runs, rows=rows), indent=2))


if __name__ == "__main__":
    main()
