"""Dynamic top-p MoE layer vs fixed top-1/top-2 MoE vs dense SwiGLU of equal active FLOPs, CPU.

    python tests/bench/bench_moe.py [--tokens 256,1024,4096,8192] [--runs 10] [--threads 1]
                                    [--backend grouped,loop] [--backward] [--capacity-factor F]

One process, side by side, interleaved run by run (so machine noise hits every layer alike):
- dynamic: the product layer (top-p 0.6, 1..4 experts/token), per dispatch backend;
- top1 / top2: fixed top-k routing with the same router and expert weights;
- dense-eq: one dense SwiGLU per MoE variant, width = d_ff * mean_k rounded to a multiple of 64,
  i.e. the same expert FLOPs per token. Router FLOPs (2·d·E per token) are reported apart.
Ratio R = (MoE time / MoE active FLOPs) / (dense time / dense FLOPs): 1.0 = the sparse layer
runs its FLOPs as efficiently as a dense matmul; it is the median of per-run ratios.
Also: tokens/s, load imbalance (max/mean tokens per expert, coefficient of variation), mean active
experts, drop rate (dropless unless --capacity-factor). Target: dynamic R <= 1.3 at >= 4096 tokens.
Writes tests/bench/results/bench_moe.json. The router is initialised wider than default (x3) so
its confidences spread like a trained gate's; an untrained near-uniform gate would pick ~4 experts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from sparsegate_workload.experts import HAS_GROUPED_MM
from sparsegate_workload.moe import DenseFFN, DynamicMoE, TopKMoE, dense_equivalent_width

RESULTS = Path(__file__).resolve().parent / "results" / "bench_moe.json"
TARGET_RATIO = 1.3
TARGET_TOKENS = 4096


def _imbalance(counts: list[int]) -> tuple[float, float]:
    t = torch.tensor(counts, dtype=torch.float64)
    mean = t.mean().item()
    return t.max().item() / mean, (t.std(unbiased=False).item() / mean)


def _time(fn, x: torch.Tensor, *, backward: bool, params: list[torch.nn.Parameter]) -> float:
    if backward:
        for p in params:
            p.grad = None
        xg = x.detach().requires_grad_(True)
        start = time.perf_counter()
        y, _ = fn(xg)
        y.sum().backward()
        return time.perf_counter() - start
    with torch.inference_mode():
        start = time.perf_counter()
        fn(x)
        return time.perf_counter() - start


def bench_tokens(n_tokens: int, args: argparse.Namespace) -> list[dict]:
    d, f, e = args.d_model, args.d_ff, args.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_tokens, d, generator=g)
    base = DynamicMoE(d, f, e)
    base.reset_parameters(g)
    with torch.no_grad():
        base.gate.weight.mul_(args.router_scale)
    cap = args.capacity_factor
    # Variants share router and expert weights: only routing differs.
    variants: dict[str, tuple[torch.nn.Module, dict]] = {}
    for backend in args.backend:
        layer = DynamicMoE(d, f, e, backend=backend)
        layer.load_state_dict(base.state_dict())
        variants[f"dynamic[{backend}]"] = (layer, dict(confidence_threshold=args.threshold,
                                                       min_experts=1, max_experts=4,
                                                       capacity_factor=cap))
    for k in (1, 2):
        layer = TopKMoE(d, f, e, k=k, backend=args.backend[0])
        layer.load_state_dict(base.state_dict())
        variants[f"top{k}"] = (layer, dict(capacity_factor=cap))

    rows = {}
    for name, (layer, kw) in variants.items():
        layer.requires_grad_(args.backward)
        with torch.inference_mode():
            _, st = layer(x, **kw)
        width = dense_equivalent_width(d_ff=f, mean_k=st.mean_active)
        dense = DenseFFN(d, width)
        dense.reset_parameters(torch.Generator().manual_seed(1))
        dense.requires_grad_(args.backward)
        max_mean, cv = _imbalance(st.counts)
        rows[name] = dict(layer=layer, kw=kw, dense=dense, stats=dict(
            mean_active_experts=st.mean_active, mean_selected_experts=st.mean_selected,
            drop_rate=st.drop_rate, imbalance_max_over_mean=max_mean, imbalance_cv=cv,
            counts=st.counts, dense_width=width,
            moe_flops=sum(st.counts) * 6 * d * f, dense_flops=n_tokens * 6 * d * width,
            router_flops=n_tokens * 2 * d * e))

    times: dict[str, list[float]] = {n: [] for n in rows} | {n + ":dense": [] for n in rows}
    for run in range(args.runs + 1):  # run 0 warms up
        for name, r in rows.items():
            params = list(r["layer"].parameters()) + list(r["dense"].parameters())
            t_moe = _time(lambda inp: r["layer"](inp, **r["kw"]), x, backward=args.backward,
                          params=params)
            t_dense = _time(r["dense"], x, backward=args.backward, params=params)
            if run:
                times[name].append(t_moe)
                times[name + ":dense"].append(t_dense)

    out = []
    for name, r in rows.items():
        s = r["stats"]
        ratios = [(tm / s["moe_flops"]) / (td / s["dense_flops"])
                  for tm, td in zip(times[name], times[name + ":dense"])]
        t_moe, t_dense = statistics.median(times[name]), statistics.median(times[name + ":dense"])
        passes = 3 if args.backward else 1  # backward ~ 2x forward FLOPs (GF/s column only)
        out.append(dict(tokens=n_tokens, layer=name, **{k: v for k, v in s.items()},
                        moe_ms=t_moe * 1e3, dense_ms=t_dense * 1e3,
                        moe_tokens_per_s=n_tokens / t_moe, dense_tokens_per_s=n_tokens / t_dense,
                        moe_gflops=passes * s["moe_flops"] / t_moe / 1e9,
                        dense_gflops=passes * s["dense_flops"] / t_dense / 1e9,
                        ratio=statistics.median(ratios), ratio_min=min(ratios),
                        ratio_max=max(ratios)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="256,1024,4096,8192")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--threshold", type=float, default=0.6)
    p.add_argument("--router-scale", type=float, default=3.0)
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--backend", default="grouped,loop" if HAS_GROUPED_MM else "loop")
    p.add_argument("--backward", action="store_true", help="time forward+backward")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    args.backend = args.backend.split(",")
    if args.runs < 10:
        sys.exit("medians need >= 10 runs")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.time()
    results = []
    for n in (int(t) for t in args.tokens.split(",")):
        results += bench_tokens(n, args)
    load_after = os.getloadavg()

    mode = "forward+backward" if args.backward else "forward (inference)"
    print(f"MoE layer benchmark, {mode}: d_model {args.d_model}, d_ff {args.d_ff}, "
          f"{args.experts} experts, fp32, {args.threads} thread(s), medians of {args.runs} runs; "
          f"torch {torch.__version__}; loadavg {load_before[0]:.1f} -> {load_after[0]:.1f} on "
          f"{os.cpu_count()} CPUs (shared machine: expect ~25% run-to-run noise)")
    hdr = (f"{'tokens':>6} {'layer':<17} {'k':>5} {'drop':>5} {'max/mean':>8} {'cv':>5} "
           f"{'moe ms':>8} {'tok/s':>9} {'GF/s':>6} {'dense w':>7} {'dense ms':>8} "
           f"{'GF/s':>6} {'R':>5} {'R range':>11}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['tokens']:>6} {r['layer']:<17} {r['mean_active_experts']:>5.2f} "
              f"{r['drop_rate']:>5.1%} {r['imbalance_max_over_mean']:>8.2f} "
              f"{r['imbalance_cv']:>5.2f} {r['moe_ms']:>8.1f} {r['moe_tokens_per_s']:>9.0f} "
              f"{r['moe_gflops']:>6.1f} {r['dense_width']:>7} {r['dense_ms']:>8.1f} "
              f"{r['dense_gflops']:>6.1f} {r['ratio']:>5.2f} "
              f"{r['ratio_min']:>5.2f}-{r['ratio_max']:<5.2f}")
    verdicts = []
    for r in results:
        if r["layer"].startswith("dynamic") and r["tokens"] >= TARGET_TOKENS:
            ok = r["ratio"] <= TARGET_RATIO
            verdicts.append(dict(tokens=r["tokens"], layer=r["layer"], ratio=r["ratio"], met=ok))
            print(f"target R <= {TARGET_RATIO} at {r['tokens']} tokens, {r['layer']}: "
                  f"R = {r['ratio']:.2f} -> {'met' if ok else 'NOT met'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        benchmark="moe_layer", mode=mode, started=started, seconds=time.time() - started,
        torch=torch.__version__, python=platform.python_version(), cpus=os.cpu_count(),
        threads=args.threads, loadavg_before=load_before, loadavg_after=load_after,
        config=dict(d_model=args.d_model, d_ff=args.d_ff, experts=args.experts,
                    threshold=args.threshold, router_scale=args.router_scale,
                    capacity_factor=args.capacity_factor, runs=args.runs,
                    backends=args.backend),
        target=dict(ratio=TARGET_RATIO, min_tokens=TARGET_TOKENS, verdicts=verdicts),
        results=results), indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
