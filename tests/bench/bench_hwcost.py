"""Hardware-aware routing (gate param hardwareCostLambda): p99 batch latency, held-out quality
and the slow expert's share of assignments, with lambda 0 and a few lambda > 0, side by side.

    python tests/bench/bench_hwcost.py [--slow simulated|real] [--delay-us-per-row 200]
                                       [--slow-dtype bfloat16] [--batches 60]
                                       [--lambdas 0,1,2,3,4]

Model: the trained demo checkpoint (dev/trained_model.py: a tiny Mixtral, top-p 0.6 over 1-4 of
8 experts, trained once per machine and cached), served through the sparsegate HF block with
the default gate params (confidenceThreshold 0.6, 1-4 experts, capacityFactor 1.25).

``--slow real``: the chosen expert is really placed in a slower precision, in every MoE layer
(``--expert-placement-json {"*:<e>": {"dtype": "bfloat16"}}``, hf/placement.py; on this CPU,
without bf16 matmul units, a bf16 matmul of the expert's shape is many times slower than fp32),
and its placement factor is measured at load. Its outputs are bf16-rounded, so the perplexity
column includes that (small) precision effect, under every lambda alike.

``--slow simulated`` (default): the bench wraps
the block's per-expert matmul and sleeps ``--delay-us-per-row`` times the rows routed to the
chosen expert before each of its matmuls (two per dispatch: gate+up and down), in every MoE
layer, standing in for an expert placed on a device with lower throughput. The chosen expert is the one with the most assignments at lambda 0 (the case
where placement hurts most). The block's own timer measures the delay like any other cost, so
the per-expert cost the gate sees is learnt online (EWMA), not set by the bench.

Warm-up forwards (the cost EWMA settles), then --batches rounds; each round serves the same
batch of 4 sequences x 32 tokens (from the checkpoint's probe text) once per lambda, in
rotation, so machine noise hits every lambda alike (with ``--slow real`` the unplaced model at
lambda 0 joins the rotation as row "0 fp32", the baseline of the first "ppl vs 0"). Per lambda: batch latency p50/p99 (wall),
median CPU time of the serving thread per batch (time.thread_time: less hit by the other
processes of a shared machine, though not immune), the slow
expert's share of kept assignments, mean experts per token, and held-out perplexity of the probe
windows under that gate (scored without the delay; the routing is the same).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "dev"))

from sparsegate_workload import quality  # noqa: E402
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document  # noqa: E402
from sparsegate_workload.hf import gated_block, load_moe_checkpoint  # noqa: E402
from sparsegate_workload.hf.placement import parse_placement  # noqa: E402
from trained_model import trained_checkpoint  # noqa: E402


def p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slow", choices=("simulated", "real"), default="simulated")
    ap.add_argument("--slow-dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--no-placement-factor", action="store_true",
                    help="--slow real: reset the measured placement factors to 1, so the cost "
                         "is the dispatch timer's alone (what the factor adds on CPU)")
    ap.add_argument("--delay-us-per-row", type=float, default=200.0)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lambdas", default="0,1,2,3,4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    path = trained_checkpoint()
    lm = load_moe_checkpoint(path)
    probe = quality.checkpoint_probe(path, lm.tokenizer, vocab_size=lm.model.config.vocab_size,
                                     context_length=lm.model.config.max_position_embeddings)
    ids = probe.windows[:, :32]
    batches = [ids[(4 * i) % ids.shape[0]:][:4] for i in range(args.batches)]
    batches = [b if b.shape[0] == 4 else ids[:4] for b in batches]
    num_experts = lm.num_experts

    lm.set_gate(make_document(DEFAULT_PARAMS))
    counts0 = [0] * num_experts
    for b in batches[:10]:
        for layer in lm.forward(b).layers:
            counts0 = [c + n for c, n in zip(counts0, layer.counts)]
    slow = max(range(num_experts), key=lambda e: counts0[e])

    real_mm = gated_block.expert_mm
    delay = args.delay_us_per_row / 1e6

    def slow_mm(x, weight, e, *, out=None):  # the simulated slower device
        if e == slow:
            time.sleep(delay * x.shape[0])
        return real_mm(x, weight, e, out=out)

    plain = lm
    if args.slow == "real":
        lm = load_moe_checkpoint(path, placement=parse_placement(
            {f"*:{slow}": {"dtype": args.slow_dtype}}))
        how = (f"placed in {args.slow_dtype} in every layer (measured placement factor per "
               f"layer: {', '.join(f'{b.cost.placement[slow]:.1f}' for b in lm.blocks)}"
               f"{', reset to 1' if args.no_placement_factor else ''})")
        if args.no_placement_factor:
            for b in lm.blocks:
                b.cost.set_placement([1.0] * num_experts)
    else:
        gated_block.expert_mm = slow_mm
        how = (f"simulated +{args.delay_us_per_row:g} us per row per matmul of it in "
               f"every layer")
    print(f"checkpoint {path.name}: {num_experts} experts x {len(lm.blocks)} MoE layers; "
          f"slow expert {slow} (busiest at lambda 0: {counts0[slow] / sum(counts0):.1%} of "
          f"assignments), {how}; "
          f"{args.batches} batches of {tuple(batches[0].shape)} tokens per lambda, 1 thread")
    print(f"{'lambda':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu p50':>8} {'slow share':>11} "
          f"{'experts/tok':>12} {'perplexity':>11} {'ppl vs 0':>9}")
    lambdas = [float(x) for x in args.lambdas.split(",")]
    # (label, model, gate): each lambda on the model with the slow expert; with --slow real
    # also lambda 0 on the unplaced model ("0 fp32": what the slow placement costs).
    rows = [(f"{lam:.2f}", lm, make_document(
        {**DEFAULT_PARAMS, **({"hardwareCostLambda": lam} if lam else {})})) for lam in lambdas]
    if args.slow == "real":
        rows.insert(0, ("0 fp32", plain, make_document(DEFAULT_PARAMS)))
    times = {r[0]: [] for r in rows}
    cpu = {r[0]: [] for r in rows}  # this thread's CPU time: less hit by other processes
    counts = {r[0]: [0] * num_experts for r in rows}
    active = {r[0]: [] for r in rows}
    for _, model, doc in rows:
        model.set_gate(doc)
        for b in batches[:args.warmup]:
            model.forward(b)
    for b in batches:
        for label, model, doc in rows:
            model.set_gate(doc)
            t0, c0 = time.perf_counter(), time.thread_time()
            out = model.forward(b)
            times[label].append((time.perf_counter() - t0) * 1000)
            cpu[label].append((time.thread_time() - c0) * 1000)
            for layer in out.layers:
                counts[label] = [c + n for c, n in zip(counts[label], layer.counts)]
            active[label].append(out.mean_active_experts)
    gated_block.expert_mm = real_mm  # simulated: score without the delay (same routing)
    base_ppl = None
    for label, model, doc in rows:
        model.set_gate(doc)
        ppl = quality.score_checkpoint_probe(model, probe).perplexity
        base_ppl = ppl if base_ppl is None else base_ppl
        c = counts[label]
        print(f"{label:>9} {statistics.median(times[label]):8.1f} {p(times[label], 0.99):8.1f} "
              f"{statistics.median(cpu[label]):8.1f} "
              f"{c[slow] / sum(c):11.1%} {statistics.mean(active[label]):12.2f} "
              f"{ppl:11.4f} {ppl / base_ppl - 1:+9.2%}")
    gated_block.expert_mm = real_mm
    costs = [round(c, 3) for c in lm.blocks[0].cost.vector().tolist()]
    print(f"layer-0 learnt cost vector (normalised): {costs}")


if __name__ == "__main__":
    main()
