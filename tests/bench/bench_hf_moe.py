"""A loaded Hugging Face Mixtral checkpoint's MoE block: upstream forward vs sparsegate's patched
block vs a dense SwiGLU of equal active FLOPs, CPU, side by side.

    python tests/bench/bench_hf_moe.py [--tokens 256,1024,4096] [--dtypes fp32,bf16] [--runs 10]
                                       [--threads 1] [--d-model 512] [--d-ff 1024] [--roof 2048]

A one-layer Mixtral checkpoint (8 experts, top-2, random weights, router drawn wider so its
confidences spread) is built in code, saved, and loaded twice from disk: unpatched through
transformers (its default experts implementation on this torch, and "eager" for reference) and
through `load_moe_checkpoint` with the family's own top-2 gate (min = max = 2, dropless), so all
three blocks route every token to the same two experts with the same weights (the outputs'
largest difference is printed and recorded for each size; nothing fails on it). Runs interleave block by block, so machine noise hits all alike.
- R vs upstream = patched time / upstream (default) time, median of per-run ratios (same work,
  so < 1 means our routing+dispatch is faster). Goal: <= 0.8 at >= 1024 tokens.
- R vs dense = (MoE time / MoE active FLOPs) / (dense time / dense FLOPs), as bench_moe.py
  defines it; dense width = d_ff * 2 (top-2), router FLOPs counted apart. Goal: <= 1.3 at 256.
- at the dense FFN's speed: the R vs upstream our block would have if it ran its FLOPs as fast as the
  dense FFN runs its own (printed with the goal): how much of the goal dispatch overhead can reach.
- route ms: the patched block's routing alone (gate matmul, softmax, top-k, grouping, the one
  host sync), timed in the same runs, to show where its time goes.
- of roof = our block's FLOP/s / the machine's dense GEMM roof in the same dtype (one square
  ``--roof``-sized matmul, timed in the same interleaved runs). Goal: bf16 >= 0.5 at >= 1024
  tokens. The roof is this CPU's: bf16 runs on AMX or AVX512-BF16 where the CPU has them
  (printed), and is emulated through fp32 where it has neither.
- quality of each dtype against fp32, on the whole one-layer model loaded both ways (seeded
  token ids, the family's top-2 gate): next-token top-1 agreement, mean KL(fp32 || dtype) and the
  relative L2 error of the logits.
- fresh shapes (bf16, ``--fresh`` calls each, run first): the patched block on token counts it has
  not seen (64-1,024, distinct), alternating calls with the dispatch's row buckets
  (`experts.row_bucket`) and without, then the same calls again: buckets/none time ratio on first
  sight (oneDNN builds a kernel per new matmul shape) and once every shape was seen (the cost of
  the padded rows).
Writes tests/bench/results/bench_hf_moe.json.
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

from sparsegate_workload.experts import DenseSwiGLU  # noqa: E402
from sparsegate_workload.hf import build_tiny_checkpoint, load_moe_checkpoint  # noqa: E402
from sparsegate_workload.moe import dense_equivalent_width  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_hf_moe.json"
GOAL_VS_UPSTREAM, GOAL_UPSTREAM_MIN_TOKENS = 0.8, 1024
GOAL_VS_DENSE, GOAL_DENSE_TOKENS = 1.3, 256
GOAL_OF_ROOF, GOAL_ROOF_DTYPE, GOAL_ROOF_MIN_TOKENS = 0.5, "bf16", 1024
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_blocks(path: Path, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    upstream = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    eager = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                 experts_implementation="eager")
    lm = load_moe_checkpoint(path, dtype=dtype)  # family top-2, dropless
    return dict(upstream=upstream.model.layers[0].mlp.eval(),
                upstream_impl=upstream.config._experts_implementation,
                eager=eager.model.layers[0].mlp.eval(), lm=lm, patched=lm.blocks[0])


def bench(n_tokens: int, dtype_name: str, blocks: dict, args: argparse.Namespace) -> dict:
    d, f = args.d_model, args.d_ff
    dtype = DTYPES[dtype_name]
    x = torch.randn(1, n_tokens, d, generator=torch.Generator().manual_seed(n_tokens)).to(dtype)
    lm, patched = blocks["lm"], blocks["patched"]
    width = dense_equivalent_width(d_ff=f, mean_k=2.0)
    dense = DenseSwiGLU(d, width)
    dense.reset_parameters(torch.Generator().manual_seed(1))
    dense = dense.to(dtype).requires_grad_(False)
    flat = x.reshape(-1, d)
    gen = torch.Generator().manual_seed(2)
    roof_a = torch.randn(args.roof, args.roof, generator=gen).to(dtype)
    roof_b = torch.randn(args.roof, args.roof, generator=gen).to(dtype)

    def run_patched() -> None:
        with lm.pinned_gate():  # the server's path: one pinned gate, stats recorded
            patched(x)

    fns = {"upstream": lambda: blocks["upstream"](x), "eager": lambda: blocks["eager"](x),
           "patched": run_patched, "dense": lambda: dense(flat),
           "route": lambda: patched.route(flat, lm.gate), "roof": lambda: roof_a @ roof_b}
    with torch.inference_mode():
        y_up, y_eager = blocks["upstream"](x), blocks["eager"](x)
        with lm.pinned_gate() as call:
            y_ours = patched(x)
        max_diff = max((y_ours - y_up).abs().max().item(), (y_eager - y_up).abs().max().item())
        times: dict[str, list[float]] = {k: [] for k in fns}
        for run in range(args.runs + 1):  # run 0 warms up
            for name, fn in fns.items():
                t = _timed(fn)
                if run:
                    times[name].append(t)
    stats = call.layers[0]
    moe_flops = sum(stats.counts) * 6 * d * f
    dense_flops = n_tokens * 6 * d * width
    roof_flops = 2 * args.roof ** 3
    med = {k: statistics.median(v) for k, v in times.items()}

    def r_dense(name: str) -> list[float]:
        return [(tm / moe_flops) / (td / dense_flops)
                for tm, td in zip(times[name], times["dense"])]

    vs_up = [tp / tu for tp, tu in zip(times["patched"], times["upstream"])]
    of_roof = [(moe_flops / tp) / (roof_flops / tr) for tp, tr in zip(times["patched"], times["roof"])]
    # What R vs upstream would be if our block ran its FLOPs as fast as the dense FFN runs its own
    # (one big GEMM pair, no routing): a mark for how much of the goal dispatch overhead can reach.
    at_dense = [(td * moe_flops / dense_flops) / tu for td, tu in zip(times["dense"], times["upstream"])]
    return dict(
        tokens=n_tokens, dtype=dtype_name, upstream_impl=blocks["upstream_impl"],
        mean_active_experts=stats.mean_active, dropped=stats.dropped,
        max_abs_diff_vs_upstream=max_diff, dense_width=width, moe_flops=moe_flops,
        dense_flops=dense_flops, router_flops=n_tokens * 2 * d * patched.num_experts,
        **{f"{k}_ms": v * 1e3 for k, v in med.items()},
        patched_gflops=moe_flops / med["patched"] / 1e9,
        upstream_gflops=moe_flops / med["upstream"] / 1e9,
        dense_gflops=dense_flops / med["dense"] / 1e9,
        roof_gflops=roof_flops / med["roof"] / 1e9, of_roof=statistics.median(of_roof),
        ratio_vs_upstream=statistics.median(vs_up), ratio_vs_upstream_min=min(vs_up),
        ratio_vs_upstream_max=max(vs_up),
        ratio_vs_upstream_at_dense_speed=statistics.median(at_dense),
        ratio_vs_eager=statistics.median(tp / te for tp, te in zip(times["patched"],
                                                                   times["eager"])),
        ratio_vs_dense=statistics.median(r_dense("patched")),
        upstream_ratio_vs_dense=statistics.median(r_dense("upstream")))


def fresh_shapes(path: Path, calls: int) -> dict:
    """bf16 patched block on never-seen token counts, row buckets on vs off, alternating."""
    import random

    from sparsegate_workload import experts

    lm = load_moe_checkpoint(path, dtype=torch.bfloat16)
    block = lm.blocks[0]
    counts = random.Random(7).sample(range(64, 1025), 2 * calls)
    gen = torch.Generator().manual_seed(3)
    hidden = lm.model.config.hidden_size
    xs = [torch.randn(1, n, hidden, generator=gen).to(torch.bfloat16) for n in counts]
    bucketed = experts.uses_row_buckets
    times: dict[str, list[list[float]]] = {"buckets": [[], []], "none": [[], []]}
    try:
        with torch.inference_mode(), lm.pinned_gate():
            for sweep in (0, 1):  # first sight, then every shape seen once
                for i, x in enumerate(xs):
                    name = "buckets" if i % 2 == 0 else "none"
                    experts.uses_row_buckets = bucketed if name == "buckets" else (lambda _x: False)
                    times[name][sweep].append(_timed(lambda: block(x)))
    finally:
        experts.uses_row_buckets = bucketed
    first = sum(times["buckets"][0]) / sum(times["none"][0])
    again = sum(times["buckets"][1]) / sum(times["none"][1])
    return dict(calls=calls, token_counts=(64, 1024),
                buckets_first_ms=sum(times["buckets"][0]) * 1e3,
                none_first_ms=sum(times["none"][0]) * 1e3,
                buckets_again_ms=sum(times["buckets"][1]) * 1e3,
                none_again_ms=sum(times["none"][1]) * 1e3,
                ratio_first=first, ratio_again=again)


def quality(path: Path, dtype_name: str, *, batch: int = 4, seq: int = 128) -> dict:
    """Whole-model logits in ``dtype_name`` vs fp32, both loaded from the same checkpoint."""
    ref = load_moe_checkpoint(path, dtype=torch.float32)
    low = load_moe_checkpoint(path, dtype=DTYPES[dtype_name])
    ids = torch.randint(0, ref.model.config.vocab_size, (batch, seq),
                        generator=torch.Generator().manual_seed(12345))
    a = ref.forward(ids).logits.float()
    b = low.forward(ids).logits.float()
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    return dict(dtype=dtype_name, tokens=batch * seq,
                top1_agreement=(a.argmax(-1) == b.argmax(-1)).float().mean().item(),
                mean_kl=kl.mean().item(),
                logits_rel_l2=((a - b).norm() / a.norm()).item())


def cpu_flags() -> list[str]:
    """The matrix/bf16 features that decide the bf16 roof (Linux /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith("amx") or f in ("avx512_bf16", "avx512f", "avx2"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="256,1024,4096")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--roof", type=int, default=2048, help="side of the square roof GEMM")
    p.add_argument("--fresh", type=int, default=40,
                   help="calls per variant of the bf16 fresh-shapes measure (0: skip it)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.runs < 10:
        sys.exit("medians need >= 10 runs")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.time()
    results, qualities = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / "mixtral", family="mixtral", layers=1,
                                     hidden_size=args.d_model, heads=8,
                                     expert_ffn=args.d_ff, experts=args.experts, top_k=2,
                                     tokenizer=False)
        # Before anything else: the fresh-shapes measure needs matmul shapes oneDNN has not seen.
        fresh = fresh_shapes(path, args.fresh) if args.fresh and "bf16" in args.dtypes else None
        for dtype_name in args.dtypes.split(","):
            blocks = load_blocks(path, DTYPES[dtype_name])
            for n in (int(t) for t in args.tokens.split(",")):
                results.append(bench(n, dtype_name, blocks, args))
            if dtype_name != "fp32":
                qualities.append(quality(path, dtype_name))
    load_after = os.getloadavg()

    print(f"HF Mixtral MoE block (d_model {args.d_model}, d_ff {args.d_ff}, {args.experts} "
          f"experts, top-2, loaded from safetensors): upstream transformers forward vs "
          f"sparsegate patched vs dense SwiGLU; {args.threads} thread(s), medians of "
          f"{args.runs} runs; torch {torch.__version__}; loadavg {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f} on {os.cpu_count()} CPUs (shared machine: ~25% run-to-run noise)")
    hdr = (f"{'tokens':>6} {'dtype':<5} {'upstream ms':>11} {'eager ms':>8} {'ours ms':>8} "
           f"{'route ms':>8} {'dense ms':>8} {'ours GF/s':>9} {'R vs up':>7} {'R range':>11} "
           f"{'R vs eager':>10} {'R vs dense':>10} {'up vs dense':>11} {'roof GF/s':>9} "
           f"{'of roof':>7} {'max |diff|':>10}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['tokens']:>6} {r['dtype']:<5} {r['upstream_ms']:>11.1f} {r['eager_ms']:>8.1f} "
              f"{r['patched_ms']:>8.1f} {r['route_ms']:>8.2f} {r['dense_ms']:>8.1f} "
              f"{r['patched_gflops']:>9.1f} {r['ratio_vs_upstream']:>7.2f} "
              f"{r['ratio_vs_upstream_min']:>5.2f}-{r['ratio_vs_upstream_max']:<5.2f} "
              f"{r['ratio_vs_eager']:>10.2f} {r['ratio_vs_dense']:>10.2f} "
              f"{r['upstream_ratio_vs_dense']:>11.2f} {r['roof_gflops']:>9.1f} {r['of_roof']:>7.2f} "
              f"{r['max_abs_diff_vs_upstream']:>10.2e}")
    print(f"upstream default experts implementation: {results[0]['upstream_impl']}")
    flags = cpu_flags()
    print(f"roof: one {args.roof}^3 matmul per dtype; CPU flags {' '.join(flags) or '(unknown)'} "
          f"({'bf16 in hardware' if any(f.startswith('amx') or f == 'avx512_bf16' for f in flags) else 'no AMX or AVX512-BF16: bf16 is emulated'})")
    for q in qualities:
        print(f"quality {q['dtype']} vs fp32 (whole model, {q['tokens']} tokens): top-1 agreement "
              f"{q['top1_agreement']:.4f}, mean KL {q['mean_kl']:.2e}, logits rel. L2 {q['logits_rel_l2']:.2e}")
    if fresh is not None:
        print(f"fresh shapes (bf16, {fresh['calls']} calls each, never-seen token counts 64-1,024, "
              f"alternating): row buckets {fresh['buckets_first_ms']:.0f} ms vs none "
              f"{fresh['none_first_ms']:.0f} ms on first sight (ratio {fresh['ratio_first']:.2f}); "
              f"the same calls again {fresh['buckets_again_ms']:.0f} vs {fresh['none_again_ms']:.0f} ms "
              f"(ratio {fresh['ratio_again']:.2f})")
    verdicts = []
    for r in results:
        if r["tokens"] >= GOAL_UPSTREAM_MIN_TOKENS:
            verdicts.append(dict(goal=f"R vs upstream <= {GOAL_VS_UPSTREAM}", tokens=r["tokens"],
                                 dtype=r["dtype"], ratio=r["ratio_vs_upstream"],
                                 at_dense_speed=r["ratio_vs_upstream_at_dense_speed"],
                                 met=r["ratio_vs_upstream"] <= GOAL_VS_UPSTREAM))
        if r["tokens"] >= GOAL_ROOF_MIN_TOKENS and r["dtype"] == GOAL_ROOF_DTYPE:
            verdicts.append(dict(goal=f"of the {r['dtype']} roof >= {GOAL_OF_ROOF}", tokens=r["tokens"],
                                 dtype=r["dtype"], ratio=r["of_roof"], roof_gflops=r["roof_gflops"],
                                 met=r["of_roof"] >= GOAL_OF_ROOF))
        if r["tokens"] == GOAL_DENSE_TOKENS:
            verdicts.append(dict(goal=f"R vs dense <= {GOAL_VS_DENSE}", tokens=r["tokens"],
                                 dtype=r["dtype"], ratio=r["ratio_vs_dense"],
                                 met=r["ratio_vs_dense"] <= GOAL_VS_DENSE))
    for v in verdicts:
        mark = (f" (at the dense FFN's speed per FLOP it would be {v['at_dense_speed']:.2f})"
                if "at_dense_speed" in v else "")
        print(f"goal {v['goal']} at {v['tokens']} tokens, {v['dtype']}: {v['ratio']:.2f} -> "
              f"{'met' if v['met'] else 'NOT met'}{mark}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        benchmark="hf_moe_block", mode="forward (inference)", started=started,
        seconds=time.time() - started, torch=torch.__version__,
        transformers=__import__("transformers").__version__,
        python=platform.python_version(), cpus=os.cpu_count(), threads=args.threads,
        cpu_flags=flags, quality=qualities, fresh_shapes=fresh,
        loadavg_before=load_before, loadavg_after=load_after,
        config=dict(family="mixtral", d_model=args.d_model, d_ff=args.d_ff,
                    experts=args.experts, top_k=2, runs=args.runs, dtypes=args.dtypes,
                    roof=args.roof),
        goals=verdicts, results=results), indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
