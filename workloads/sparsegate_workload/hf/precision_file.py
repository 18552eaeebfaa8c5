"""The measured gradient variances of a checkpoint's MoE layers, kept beside its weights.

``python -m sparsegate_workload.calibrate DIR`` measures them once (gradients, so offline) and
writes `PRECISION_FILE`; `load_moe_checkpoint` reads it, so ``precisionPolicy: auto`` stores each
layer's router and experts in the precision the rule picks without a gradient at serving time.

The file records what it was measured on: sha256 of ``config.json`` (and of the shard index),
and each weight file's name, size and sha256 of its safetensors header (tensor names, dtypes,
shapes). A checkpoint that differs in any of these, or in its MoE layer or expert count, is
refused with a CheckpointError naming the file. The tensors' values are not hashed (that would
read every weight byte at each load): weights rewritten in place with the same shapes and
dtypes are not detected, so whatever rewrites them must remove the file (sparsegate-train does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any, Sequence

from .checkpoint_files import CONFIG_FILE, INDEX_FILE, CheckpointError

PRECISION_FILE = "sparsegate_precision.json"
FORMAT = "sparsegate-precision/1"
CALIBRATE_COMMAND = "python -m sparsegate_workload.calibrate"


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _header_bytes(path: Path) -> bytes:
    # Called after checkpoint_files has validated the shard, so the length prefix is sane.
    with path.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return fh.read(length)


def checkpoint_identity(directory: Path, shards: Sequence[Path]) -> dict[str, Any]:
    """What a precision file must match: config, shard index and weight files (names, sizes,
    safetensors headers). Reads only config.json, the index and the shard headers."""
    index = directory / INDEX_FILE
    return {
        "config": _sha256((directory / CONFIG_FILE).read_bytes()),
        "index": _sha256(index.read_bytes()) if index.is_file() else None,
        "weights": [{"file": p.name, "bytes": p.stat().st_size,
                     "header": _sha256(_header_bytes(p))} for p in shards],
    }


@dataclasses.dataclass(frozen=True)
class MeasuredVariances:
    """Per MoE layer: router and expert gradient variance (NaN: the measurement failed)."""

    path: Path
    router: tuple[float, ...]
    experts: tuple[float, ...]
    num_experts: int
    data: str  # what they were measured on

    def check_model(self, *, layers: int, num_experts: int) -> None:
        """Refuse a file measured on another MoE layer or expert count than the loaded model's."""
        if (len(self.router), self.num_experts) != (layers, num_experts):
            raise _stale(self.path, f"it measured {len(self.router)} MoE layers of "
                                    f"{self.num_experts} experts, the model has {layers} of "
                                    f"{num_experts}")


def _stale(path: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: does not match this checkpoint ({why}); re-run `{CALIBRATE_COMMAND} "
        f"{path.parent}` to measure it again, or delete the file (precisionPolicy auto then "
        f"keeps every layer fp32)", file=path)


def _json_number(v: float) -> float | None:
    # strict JSON has no NaN or inf: null, read back as NaN (a failed measurement: fp32)
    return v if math.isfinite(v) else None


def write_precision_file(directory: Path, shards: Sequence[Path], *, router: Sequence[float],
                         experts: Sequence[float], num_experts: int,
                         calibration: dict[str, Any]) -> Path:
    """Write `PRECISION_FILE` in ``directory`` (atomically: a reader never sees half of it)."""
    path = directory / PRECISION_FILE
    record = {
        "format": FORMAT,
        "checkpoint": checkpoint_identity(directory, shards),
        "moeLayers": len(router),
        "experts": num_experts,
        "calibration": calibration,
        "routerVariance": [_json_number(v) for v in router],
        "expertVariance": [_json_number(v) for v in experts],
    }
    tmp = path.with_name(f".{PRECISION_FILE}.tmp")
    tmp.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _variances(record: dict[str, Any], key: str, layers: int, path: Path) -> tuple[float, ...]:
    values = record.get(key)
    if not isinstance(values, list) or len(values) != layers or not all(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                          and math.isfinite(v) and v >= 0) for v in values):
        raise CheckpointError(f"{path}: {key} must be a list of {layers} non-negative numbers "
                              f"or null, got {values!r}", file=path)
    return tuple(math.nan if v is None else float(v) for v in values)


def read_precision_file(directory: Path, shards: Sequence[Path]) -> MeasuredVariances | None:
    """The checkpoint's measured variances, None without `PRECISION_FILE`. Raises
    CheckpointError naming the file when it is unreadable or was measured on other files."""
    path = directory / PRECISION_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})", file=path) from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        got = record.get("format") if isinstance(record, dict) else record
        raise CheckpointError(f"{path}: format must be {FORMAT!r}, got {got!r}", file=path)
    want, have = record.get("checkpoint"), checkpoint_identity(directory, shards)
    if want != have:
        raise _stale(path, _first_difference(want, have))
    layers, experts = record.get("moeLayers"), record.get("experts")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
               for v in (layers, experts)):
        raise CheckpointError(f"{path}: moeLayers and experts must be positive integers",
                              file=path)
    calibration = record.get("calibration")
    data = calibration.get("data") if isinstance(calibration, dict) else None
    return MeasuredVariances(path=path, router=_variances(record, "routerVariance", layers, path),
                             experts=_variances(record, "expertVariance", layers, path),
                             num_experts=experts, data=str(data) if data is not None else "not recorded")


def _first_difference(want: Any, have: dict[str, Any]) -> str:
    if not isinstance(want, dict):
        return "it records no checkpoint identity"
    if want.get("config") != have["config"]:
        return f"{CONFIG_FILE} changed since it was measured"
    if want.get("index") != have["index"]:
        return f"{INDEX_FILE} changed since it was measured"
    recorded = {w.get("file"): w for w in want.get("weights") or [] if isinstance(w, dict)}
    for now in have["weights"]:
        then = recorded.get(now["file"])
        if then is None:
            return f"weight file {now['file']} was not there when it was measured"
        if then.get("bytes") != now["bytes"]:
            return (f"weight file {now['file']} changed since it was measured: "
                    f"{then.get('bytes')} bytes then, {now['bytes']} now")
        if then != now:
            return (f"weight file {now['file']} changed since it was measured: its tensors' "
                    f"names, dtypes or shapes differ")
    return "the weight files changed since it was measured"
