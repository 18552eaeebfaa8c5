"""Device check for a machine with a CUDA GPU (none on the development machines): the model
server's checkpoint path placed on CUDA generates batched, and its tokens match the CPU's.

    python dev/gpu_check.py [--dtype float32|bfloat16] [--requests 8] [--max-tokens 24]

Builds a tiny random Mixtral checkpoint in code (nothing downloaded), loads it through the
server's loader twice (``--device cpu`` and ``--device cuda``, resolved as the server does),
checks that every weight, the KV caches and the MoE dispatch live on the GPU, decodes the same
greedy requests through the continuous-batching decoder on both (all joining at once, so they
decode in one batch) and also each one alone on CUDA, and compares the tokens. Exit 0 when
everything matches, 1 with the differences otherwise, 2 when CUDA is unusable (the reason
printed). In float32 the tokens must be equal; in bfloat16 rounding differs between devices, so
it reports the agreement and fails only under 90 % of tokens.
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args()

    from sparsegate_workload.devices import DeviceError, resolve_device
    from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
    from sparsegate_workload.hf import build_tiny_checkpoint
    from sparsegate_workload.hf_serving import load

    try:
        device = resolve_device("cuda")
    except DeviceError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__} CUDA {torch.version.cuda} on {torch.cuda.get_device_name(0)}")
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
    failures = []
    off_device = [n for n, t in [*gpu.lm.model.named_parameters(), *gpu.lm.model.named_buffers()]
                  if t.device.type != "cuda"]
    if off_device:
        failures.append(f"not on cuda: {off_device[:5]}")
    stored = [w.data.device.type for blk in gpu.lm.blocks for w in blk.expert_storage]
    if set(stored) != {"cuda"}:
        failures.append(f"expert storage devices: {sorted(set(stored))}")
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
