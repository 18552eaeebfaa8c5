"""Mixed precision of MoE weights: memory, layer time and quality of bf16 / int8 vs fp32, CPU.

    python tests/bench/bench_precision.py [--tokens 256,1024,4096] [--runs 10] [--threads 1]
                                          [--d-model 256] [--d-ff 512] [--experts 8]

One process, side by side:
- memory: bytes of router + expert weights of the built-in model (`build_model`, stored per
  policy fp32 / bf16 / int8 / auto), read from the stored tensors; ratio vs fp32. Goal: int8
  experts <= 0.3x fp32 (int8 values + one fp32 scale per output channel);
- time: one frozen `DynamicMoE` layer (d-model x d-ff, E experts, router x3 wider as in
  bench_moe.py, top-p 0.6, 1..4 experts/token) stored per precision, forward at each token
  count, runs interleaved across precisions; ratio = median time / median fp32 time (> 1:
  slower; on CPU the dequantisation per expert is extra work, the matmuls stay fp32);
- quality: the built-in model on held-out seeded tokens (seed 12345, not the calibration seed):
  mean squared logit error vs fp32, top-1 agreement with fp32, next-token perplexity and its
  ratio to fp32 (the model is untrained and its tied embeddings make its logits very peaked,
  so its perplexity on random tokens is astronomically high, ~1e20; only the ratio says
  anything).
Writes tests/bench/results/bench_precision.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsegate_workload.gateparams import GateParams
from sparsegate_workload.model import ModelConfig, build_model
from sparsegate_workload.moe import DynamicMoE

RESULTS = Path(__file__).resolve().parent / "results" / "bench_precision.json"
POLICIES = ("fp32", "bf16", "int8", "auto")
INT8_EXPERT_GOAL = 0.3


def memory(model) -> dict[str, dict]:
    out = {}
    for policy in POLICIES:
        model.store_precisions(model.resolve_precisions(policy),
                               model.resolve_expert_precisions(policy))
        layers = [b.to_json() for b in model.weight_bytes()]
        gate = sum(b["gateBytes"] for b in layers)
        experts = sum(b["expertBytes"] for b in layers)
        gate32 = sum(b["gateFp32Bytes"] for b in layers)
        experts32 = sum(b["expertFp32Bytes"] for b in layers)
        out[policy] = {"layers": layers, "gateBytes": gate, "expertBytes": experts,
                       "gateRatio": gate / gate32, "expertRatio": experts / experts32,
                       "totalRatio": (gate + experts) / (gate32 + experts32)}
    return out


def layer_times(args: argparse.Namespace) -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    base = DynamicMoE(args.d_model, args.d_ff, args.experts, backend="loop")
    base.reset_parameters(g)
    with torch.no_grad():
        base.gate.weight.mul_(3.0)
    base.requires_grad_(False)
    layers = {}
    for p in ("fp32", "bf16", "int8"):
        layer = copy.deepcopy(base)
        layer.store(gate=p, experts=p)
        layers[p] = layer
    out = {}
    for n in args.tokens:
        x = torch.randn(n, args.d_model, generator=g)
        times: dict[str, list[float]] = {p: [] for p in layers}
        with torch.inference_mode():
            for p, layer in layers.items():  # warm-up
                layer(x, precision=p)
            for _ in range(args.runs):
                for p, layer in layers.items():
                    start = time.perf_counter()
                    layer(x, precision=p)
                    times[p].append(time.perf_counter() - start)
        med = {p: statistics.median(t) for p, t in times.items()}
        out[str(n)] = {p: {"medianMs": 1e3 * med[p], "ratioVsFp32": med[p] / med["fp32"]}
                       for p in layers}
    return out


def quality(model) -> dict[str, dict]:
    tokens = torch.randint(0, model.cfg.vocab_size, (8, 64),
                           generator=torch.Generator().manual_seed(12345))
    outs = {}
    with torch.inference_mode():
        for policy in POLICIES:
            outs[policy] = model(tokens, gate=GateParams(precision_policy=policy),
                                 precisions=model.resolve_precisions(policy)).logits.float()
    ref = outs["fp32"]

    def ppl(logits: torch.Tensor) -> float:
        return math.exp(float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                              tokens[:, 1:].reshape(-1))))

    ref_ppl = ppl(ref)
    return {p: {"logitMSE": float(((o - ref) ** 2).mean()),
                "top1Agreement": float((o.argmax(-1) == ref.argmax(-1)).float().mean()),
                "perplexity": ppl(o), "perplexityRatio": ppl(o) / ref_ppl}
            for p, o in outs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="256,1024,4096",
                    type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model(ModelConfig())
    sens = {"gate": model.gate_sensitivity, "experts": model.expert_sensitivity}
    mem = memory(model)
    qual = quality(model)
    times = layer_times(args)

    print(f"gradient variance per layer (threshold 1e-3): router {sens['gate']}, "
          f"experts {sens['experts']}")
    print("\nmemory of router + expert weights, built-in model (bytes, ratio vs fp32)")
    print(f"{'policy':8} {'precisions (gate/experts)':28} {'gate B':>8} {'experts B':>10} "
          f"{'gate x':>7} {'experts x':>9} {'total x':>8}")
    for p, m in mem.items():
        prec = ",".join(f"{b['gatePrecision']}/{b['expertPrecision']}" for b in m["layers"])
        print(f"{p:8} {prec:28} {m['gateBytes']:>8} {m['expertBytes']:>10} "
              f"{m['gateRatio']:>7.3f} {m['expertRatio']:>9.3f} {m['totalRatio']:>8.3f}")
    int8_ratio = mem["int8"]["expertRatio"]
    print(f"goal int8 experts <= {INT8_EXPERT_GOAL}x: {int8_ratio:.3f}x "
          f"({'met' if int8_ratio <= INT8_EXPERT_GOAL else 'NOT met'})")
    print(f"\nDynamicMoE layer forward (d {args.d_model}, f {args.d_ff}, E {args.experts}, "
          f"{args.threads} thread(s), median of {args.runs}): ms and ratio vs fp32")
    for n, row in times.items():
        print(f"  T={n:>5}: " + "  ".join(f"{p} {r['medianMs']:.2f} ms ({r['ratioVsFp32']:.2f}x)"
                                          for p, r in row.items()))
    print("\nquality on held-out seeded tokens vs fp32 (built-in model, 8x64 tokens)")
    for p, q in qual.items():
        print(f"  {p:5} logit MSE {q['logitMSE']:.2e}  top-1 agreement {q['top1Agreement']:.4f}"
              f"  perplexity {q['perplexity']:.2f} ({q['perplexityRatio']:.4f}x)")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": args.threads, "python": sys.version.split()[0]},
        "sensitivity": sens, "memory": mem, "layerTime": times, "quality": qual,
        "int8ExpertGoal": INT8_EXPERT_GOAL, "int8ExpertGoalMet": int8_ratio <= INT8_EXPERT_GOAL,
    }, indent=2))
    print(f"\nwrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
