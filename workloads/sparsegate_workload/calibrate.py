"""``python -m sparsegate_workload.calibrate DIR`` (or ``sparsegate-calibrate DIR``): measure a
Hugging Face MoE checkpoint's per-layer router and expert gradient variances once, offline, and
write them beside its weights (`hf.precision_file.PRECISION_FILE`), so a server loading it under
``precisionPolicy: auto`` stores each layer in the precision the rule picks (variance > 0.001:
bf16, otherwise int8) without computing a gradient itself.

Calibration text: ``--text-file FILE``; else the checkpoint's probe file
(`quality.PROBE_FILE`, which sparsegate-train writes) when present; else the short in-code
`hf.loader.CALIBRATION_TEXT`. A checkpoint without a tokenizer is measured on seeded random ids.

Exit status: 0 written, 1 the checkpoint did not load or calibrate, 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .cli_types import int_at_least

DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sparsegate_workload.calibrate",
        description="Measure a MoE checkpoint's per-layer gradient variances and write "
                    "sparsegate_precision.json beside its weights, for precisionPolicy auto.")
    p.add_argument("checkpoint", metavar="DIR", help="the checkpoint directory (written into)")
    p.add_argument("--text-file", metavar="FILE",
                   help="UTF-8 calibration text (default: DIR/sparsegate_probe.txt when present, "
                        "else a short built-in English text)")
    # Defaults = SparseGatedCausalLM.calibrate_gate_precision's, so both measure alike.
    p.add_argument("--batches", type=int_at_least(2), default=4,
                   help="forward+backward passes; the variance is taken across them")
    p.add_argument("--batch-size", type=int_at_least(1), default=2)
    p.add_argument("--seq-len", type=int_at_least(2), default=16)
    p.add_argument("--seed", type=int_at_least(0), default=1, help="picks the text windows")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype the model is loaded and differentiated in")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int_at_least(1), default=1, help="torch CPU threads")
    return p


def calibrate(directory: Path, *, text: str | None, text_source: str, batches: int,
              batch_size: int, seq_len: int, seed: int, dtype: str, device: str
              ) -> dict[str, Any]:
    """Load, measure and write; returns the summary printed. Raises CheckpointError."""
    import torch

    from .hf.checkpoint_files import check_weight_files
    from .hf.loader import load_moe_checkpoint
    from .hf.precision_file import write_precision_file
    from .precision import choose_precision

    # precision_file=False: a stale file must not stop the run that replaces it.
    lm = load_moe_checkpoint(directory, dtype=getattr(torch, dtype), device=device,
                             precision_file=False)
    started = time.perf_counter()
    lm.calibrate_gate_precision(batches=batches, batch_size=batch_size, seq_len=seq_len,
                                seed=seed, text=text, text_source=text_source)
    seconds = time.perf_counter() - started
    assert lm.gate_sensitivity is not None and lm.expert_sensitivity is not None
    path = write_precision_file(
        directory, check_weight_files(directory), router=lm.gate_sensitivity,
        experts=lm.expert_sensitivity, num_experts=lm.num_experts,
        calibration={"data": lm.calibration_data, "batches": batches, "batchSize": batch_size,
                     "seqLen": seq_len, "seed": seed, "dtype": dtype,
                     "seconds": round(seconds, 3)})
    for i, (g, e) in enumerate(zip(lm.gate_sensitivity, lm.expert_sensitivity)):
        failed = [name for name, v in (("router", g), ("expert", e)) if not math.isfinite(v)]
        if failed:  # inf/NaN gradients (e.g. fp16 overflow): written as null, auto keeps fp32
            print(f"calibrate: layer {i}: {' and '.join(failed)} gradient variance is not "
                  f"finite (inf/NaN gradients); recorded as null, precisionPolicy auto keeps "
                  f"{'them' if len(failed) > 1 else 'it'} fp32", file=sys.stderr)
    return {"file": str(path), "data": lm.calibration_data, "seconds": round(seconds, 3),
            "layers": [{"layer": i, "routerVariance": _json_number(g),
                        "expertVariance": _json_number(e),
                        "autoRouter": choose_precision(policy="auto", sensitivity=g),
                        "autoExperts": choose_precision(policy="auto", sensitivity=e)}
                       for i, (g, e) in enumerate(zip(lm.gate_sensitivity,
                                                      lm.expert_sensitivity))]}


def _json_number(v: float) -> float | None:
    return v if math.isfinite(v) else None  # the summary is strict JSON, as the file is


def _device_error(name: str) -> str | None:
    """Why ``--device name`` cannot be used here (None: it can): a bad flag exits 2 with the
    reason, as the server's --device does, not with torch's traceback halfway through loading."""
    import torch

    from .devices import DeviceError, resolve_device

    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        return f"--device must be cpu, cuda or cuda:N, got {name!r}"
    if device.type == "cuda":
        try:
            resolve_device("cuda")
        except DeviceError as exc:
            return str(exc)
        if (device.index or 0) >= torch.cuda.device_count():
            return (f"--device {name}: no such CUDA device here "
                    f"({torch.cuda.device_count()} visible)")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    directory = Path(args.checkpoint)
    from .quality import PROBE_FILE

    text, source = None, "CALIBRATION_TEXT"
    text_path = Path(args.text_file) if args.text_file else directory / PROBE_FILE
    if args.text_file or text_path.is_file():
        what = "--text-file" if args.text_file else "probe file"
        try:
            text, source = text_path.read_text(encoding="utf-8"), str(text_path)
        except (OSError, UnicodeDecodeError) as exc:
            parser.error(f"{what} {text_path}: {exc}")
        if not text.strip():
            parser.error(f"{what} {text_path} is empty")
    import torch

    from .hf.checkpoint_files import CheckpointError

    device_error = _device_error(args.device)
    if device_error is not None:
        parser.error(device_error)
    from .devices import DeviceError, check_model_dtype
    try:
        note = check_model_dtype(torch.device(args.device), args.dtype, flag="--dtype")
    except DeviceError as exc:
        parser.error(str(exc))
    if note:
        print(f"calibrate: {note}", file=sys.stderr)
    torch.set_num_threads(args.threads)
    try:
        summary = calibrate(directory, text=text, text_source=source, batches=args.batches,
                            batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                            dtype=args.dtype, device=args.device)
    except (CheckpointError, ValueError) as exc:  # ValueError: e.g. text with no tokens
        print(f"calibrate: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
