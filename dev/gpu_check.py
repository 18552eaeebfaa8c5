"""Device check for a machine with a CUDA GPU (none on the development machines): the model
server's checkpoint path placed on CUDA generates batched, and its tokens match the CPU's.

    python dev/gpu_check.py [--dtype float32|bfloat16] [--requests 8] [--max-tokens 24]

Builds a tiny random Mixtral checkpoint in code (nothing downloaded), loads it through the
server's loader twice (``--device cpu`` and ``--device cuda``, resolved as the server does),
checks that every weight, the KV caches and the MoE dispatch live on the GPU, decodes the same
greedy requests through the continuous-batching decoder on both (all joining at once, so they
decode in one batch) and also each one alone on CUDA, and compares the tokens. Then the other
CUDA code paths, each against the CPU through ``/v1/infer``'s `run_batch` (next tokens and
per-expert counts): the fixed-k fast path (one token and a batch), a capacity cap that drops,
int8 expert storage, an expert group (``allowed_experts``), hardwareCostLambda > 0 (on CUDA the
dispatch records no launch-only times, so with no placement it routes as lambda 0), an expert
placed on the CPU beside a CUDA model, a tool-gate head (kept resident on the GPU: its call
makes no host sync), with --dtype bfloat16 int8 experts whose scales are exact in bf16 (the
expert matmul rounds once), sampled (temperature > 0) batched decoding; and it prints the host syncs of one decode step (torch's sync debug mode) per MoE
layer. Exit 0 when everything matches, 1 with the differences otherwise, 2 when CUDA is unusable
(the reason printed). In float32 the tokens must be equal; in bfloat16/float16 rounding differs
between devices, so it reports the agreement and fails only under 90 % of tokens (the path checks
then only report). ``--device cpu`` dry-runs this script on the CPU (CPU against itself).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch


def decode(hf, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    from sparsegate_workload.batch_decode import BatchDecoder, DecodeRequest

    dec = BatchDecoder(hf)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    start = time.perf_counter()
    events = dec.run([DecodeRequest(key=i, prompt_ids=p, max_tokens=max_tokens)
                      for i, p in enumerate(prompts)], [])
    widest = dec.running
    while True:
        for ev in events:
            tokens[ev.key].append(ev.token)
        if not dec.running:
            break
        events = dec.run([], [])
    if hf.device.type == "cuda":
        torch.cuda.synchronize()
    return [tokens[i] for i in range(len(prompts))], time.perf_counter() - start, widest


def check_paths(path: Path, dtype: str, device: torch.device, base) -> list[str]:
    """Each CUDA code path against the CPU through run_batch (what /v1/infer runs): the next
    tokens and per-expert counts must match; returns what differed (printed either way)."""
    from sparsegate_workload.batch_decode import BatchDecoder, DecodeRequest
    from sparsegate_workload.gateparams import make_document
    from sparsegate_workload.hf.tool_head import ToolHead
    from sparsegate_workload.hf_serving import load
    from sparsegate_workload.hf.placement import parse_placement

    g = torch.Generator().manual_seed(11)
    batch = torch.randint(3, 384, (3, 17), generator=g).tolist()
    one = [batch[0][:9]]
    raw = dict(base.raw_params)
    variants = {
        "fixed k=2": ({**raw, "minExpertsPerToken": 2, "maxExpertsPerToken": 2}, {}),
        "capacity 0.5 (drops)": ({**raw, "capacityFactor": 0.5}, {}),
        "int8 experts": ({**raw, "precisionPolicy": "int8"}, {}),
        "expert group [0, 2, 5]": (raw, {"allowed_experts": [0, 2, 5]}),
        "fixed k=2, group [1, 3]": ({**raw, "minExpertsPerToken": 2, "maxExpertsPerToken": 2,
                                     "capacityFactor": 1.0}, {"allowed_experts": [1, 3]}),
    }
    failures = []

    def compare(name: str, a, b) -> None:
        ok = a == b
        print(f"  {'ok  ' if ok else 'DIFF'} {name}")
        if not ok:
            failures.append(f"{name}: cpu {a} != {device.type} {b}")

    def infer(hf, tokens, **kw):
        result, _ = hf.run_batch(tokens, **kw)
        return result.next_tokens, result.expert_counts

    print(f"code paths, cpu vs {device.type} (run_batch next tokens + expert counts):")
    for name, (params, kw) in variants.items():
        doc = make_document(params)
        cpu, gpu = (load(path, gate=doc, dtype=dtype, device=d) for d in ("cpu", device))
        for label, tokens in (("batch", batch), ("one row", one)):
            compare(f"{name}, {label}", infer(cpu, tokens, **kw), infer(gpu, tokens, **kw))
        if name == "fixed k=2":  # one token alone: the _assign_fixed_k host-side path
            compare(f"{name}, generate 1 token x 6",
                    cpu.generate(one[0], max_tokens=6).token_ids,
                    gpu.generate(one[0], max_tokens=6).token_ids)
    # hardwareCostLambda > 0: CUDA records no host-clock time (it would be launches only), so
    # without placement the cost is uniform and routes exactly as lambda 0.
    gpu = load(path, gate=make_document({**raw, "hardwareCostLambda": 2}), dtype=dtype,
               device=device)
    plain = load(path, gate=base, dtype=dtype, device=device)
    for _ in range(2):
        biased = infer(gpu, batch)
    if device.type == "cuda":  # (on the CPU the times are real: the routing moves)
        compare("hardwareCostLambda 2 vs 0 (no placement)", infer(plain, batch), biased)
        timed = [s for b in gpu.lm.blocks for s in b.cost.seconds_per_row if s is not None]
        compare("no launch-only times recorded on cuda", [], timed)
    # An expert placed on the CPU beside a model on the device, and its measured factor.
    placed = load(path, gate=base, dtype=dtype, device=device,
                  placement=parse_placement({"*:1": {"device": "cpu", "dtype": "float32"}}))
    factors = [round(f, 2) for f in placed.lm.blocks[0].cost.placement]
    print(f"  placement factors (expert 1 on cpu): {factors}")
    compare("expert 1 placed on cpu", infer(plain, batch)[0], infer(placed, batch)[0])
    # A tool-gate head (a CPU weight): kept resident on the model's device when set, so a
    # call copies nothing to the device (it was copied, a host sync, at every call).
    hidden = int(plain.lm.model.config.hidden_size)
    head = ToolHead(weight=torch.randn(hidden, generator=g), bias=0.0)
    cpu = load(path, gate=base, dtype=dtype, device="cpu")
    probs = []
    for hf in (cpu, plain):
        hf.lm.tool_head = head
        probs.append([round(p, 3) for p in hf.run_batch(batch)[0].last_tool_prob])
    compare("tool-gate head last_tool_prob", probs[0], probs[1])
    compare("tool-gate head weight resident on the model's device", device.type,
            plain.lm.tool_head.weight.device.type)
    if device.type == "cuda":
        hidden_states = torch.randn(4, 9, hidden, device=device)
        compare("tool-gate head call: no host syncs", 0,
                count_syncs(lambda: plain.lm.tool_head.probs(hidden_states)))
    # bf16 compute with int8 experts: the per-column scales lie on the bf16 grid, so the
    # expert matmul rounds once (the scale cast to bf16 rounded it again, up to 0.39 %).
    if dtype == "bfloat16":
        from sparsegate_workload.experts import expert_mm

        int8 = load(path, gate=make_document({**raw, "precisionPolicy": "int8"}), dtype=dtype,
                    device=device)
        gate_up = int8.lm.blocks[0].expert_storage[0]
        compare("int8 expert scales exact in bf16", True,
                bool(torch.equal(gate_up.scale.to(torch.bfloat16).float(), gate_up.scale)))
        x = torch.randn(5, gate_up.data.shape[1], generator=g).to(device, torch.bfloat16)
        once = (x @ gate_up.data[1].to(torch.bfloat16)).float().mul(gate_up.scale[1])
        compare("int8 expert matmul in bf16 rounds its scale once", True,
                bool(torch.equal(expert_mm(x, gate_up, 1), once.to(torch.bfloat16))))
    # Sampled batched decoding: the per-sequence CPU generators draw the same tokens.
    sampled = []
    for hf in (cpu, plain):
        dec = BatchDecoder(hf)
        got: dict[int, list[int]] = {0: [], 1: []}
        events = dec.run([DecodeRequest(key=i, prompt_ids=one[0][:5 + i], max_tokens=8,
                                        temperature=0.8, seed=3 + i) for i in range(2)], [])
        while True:
            for ev in events:
                got[ev.key].append(ev.token)
            if not dec.running:
                break
            events = dec.run([], [])
        sampled.append(got)
    compare("sampled batched decode (temperature 0.8)", sampled[0], sampled[1])
    return failures


def count_syncs(fn) -> int:
    """Host syncs torch's CUDA sync debug mode warns about while ``fn()`` runs."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def step_syncs(hf, prompts: list[list[int]]) -> None:
    """Print the host syncs of one batched decode step per MoE layer (torch's CUDA sync debug
    mode warns on each): the design reads the per-expert counts once per layer."""
    if hf.device.type != "cuda":
        return
    import warnings

    from sparsegate_workload.batch_decode import BatchDecoder, DecodeRequest

    dec = BatchDecoder(hf)
    dec.run([DecodeRequest(key=i, prompt_ids=p, max_tokens=4)
             for i, p in enumerate(prompts[:4])], [])
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            dec.run([], [])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    print(f"host syncs in one decode step of {dec.running} sequences: {syncs} "
          f"({syncs / len(hf.lm.blocks):.1f} per MoE layer)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of this script on the CPU (no GPU needed)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()

    from sparsegate_workload.devices import DeviceError, check_model_dtype, resolve_device
    from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
    from sparsegate_workload.hf import build_tiny_checkpoint
    from sparsegate_workload.hf_serving import load

    try:
        device = resolve_device(args.device)
    except DeviceError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        print(f"torch {torch.__version__} CUDA {torch.version.cuda} on "
              f"{torch.cuda.get_device_name(0)} (bf16 supported: {torch.cuda.is_bf16_supported()}, "
              f"natively: {torch.cuda.is_bf16_supported(including_emulation=False)})")
    # --model-dtype bfloat16 on a GPU without bf16: refused (exit 2) as the server does at start.
    try:
        note = check_model_dtype(device, args.dtype)
    except DeviceError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    if note:
        print(f"note: {note}")
    # Dynamic gate (1-3 experts per token), capacity 8x: caps nothing, so batching is exact.
    gate = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 3,
                          "capacityFactor": 8})
    g = torch.Generator().manual_seed(7)
    prompts = [[1] + torch.randint(3, 384, (4 + 3 * i % 13,), generator=g).tolist()
               for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / "mixtral", family="mixtral")
        cpu = load(path, gate=gate, dtype=args.dtype, device="cpu")
        gpu = load(path, gate=gate, dtype=args.dtype, device=device)
        paths_failures = check_paths(path, args.dtype, device, gate)
        # bf16/fp16 round differently on each device: the path checks then only report.
        failures = paths_failures if args.dtype == "float32" else []
    off_device = [n for n, t in [*gpu.lm.model.named_parameters(), *gpu.lm.model.named_buffers()]
                  if t.device.type != device.type]
    if off_device:
        failures.append(f"not on {device.type}: {off_device[:5]}")
    stored = [w.data.device.type for blk in gpu.lm.blocks for w in blk.expert_storage]
    if set(stored) != {device.type}:
        failures.append(f"expert storage devices: {sorted(set(stored))}")
    step_syncs(gpu, prompts)
    decode(gpu, prompts[:2], 2)  # warm-up (CUDA context, kernels)
    want, cpu_s, _ = decode(cpu, prompts, args.max_tokens)
    got, gpu_s, widest = decode(gpu, prompts, args.max_tokens)
    alone = [gpu.generate(p, max_tokens=args.max_tokens).token_ids for p in prompts]
    print(f"batch of {widest}: cpu {cpu_s:.3f} s, cuda {gpu_s:.3f} s")
    pairs = [(a, b) for w, g_ in zip(want, got) for a, b in zip(w, g_)]
    agree = sum(a == b for a, b in pairs) / max(len(pairs), 1)
    print(f"tokens equal cuda batched vs cpu batched: {agree:.1%}; "
          f"requests equal cuda batched vs cuda alone: {sum(a == b for a, b in zip(got, alone))}"
          f"/{len(prompts)}")
    if widest < 2:
        failures.append(f"the requests did not decode together (widest batch {widest})")
    if args.dtype == "float32":
        if got != want:
            failures.append("cuda batched tokens differ from cpu batched tokens")
        if got != alone:
            failures.append("cuda batched tokens differ from cuda alone")
    elif agree < 0.9:
        failures.append(f"only {agree:.1%} of bf16 tokens agree between cuda and cpu")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    print("gpu_check: " + ("FAILED" if failures else "OK"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
