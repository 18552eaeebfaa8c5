"""Checks a checkpoint directory before transformers reads it, so bad input fails with one
exception type whose message names the offending file (or field) instead of a deep stack trace.

What is checked, all without loading a tensor: ``config.json`` exists, is a JSON object and names
a supported MoE family with a SwiGLU (``silu``) activation; the safetensors weights exist (one
``model.safetensors``, else every shard listed in ``model.safetensors.index.json``, as
transformers picks them); every shard's header parses, stores only accepted dtypes, its tensors'
byte ranges tile the data block, and the file holds exactly the bytes its header promises (a
truncated download fails here); every tensor the index maps to a shard is in that shard.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from .families import SUPPORTED_FAMILIES, MoEFamily

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype codes the loader accepts (floating point weights it can run).
ACCEPTED_STORED_DTYPES = ("F32", "BF16", "F16")
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}  # bytes per element of each accepted dtype
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


class CheckpointError(ValueError):
    """A checkpoint the loader cannot use; `file` is the offending file (None: the directory)."""

    def __init__(self, message: str, *, file: Path | None = None) -> None:
        super().__init__(message)
        self.file = file


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory", file=directory)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a Hugging Face checkpoint needs config.json)",
                              file=path)
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})", file=path) from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: must hold a JSON object", file=path)
    return config


def family_of(config: dict[str, Any], *, config_path: Path) -> MoEFamily:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not a supported MoE family "
            f"(supported: {', '.join(sorted(SUPPORTED_FAMILIES))})", file=config_path)
    family = SUPPORTED_FAMILIES[model_type]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(
            f"{config_path}: hidden_act {act!r} is not supported (the experts run SwiGLU: silu)",
            file=config_path)
    experts_field = next((f for f in family.experts_fields if f in config),
                         family.experts_fields[0])
    for field in (experts_field, "num_experts_per_tok"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{config_path}: {field} must be a positive integer, "
                                  f"got {value!r}", file=config_path)
    if config["num_experts_per_tok"] > config[experts_field]:
        raise CheckpointError(
            f"{config_path}: num_experts_per_tok ({config['num_experts_per_tok']}) exceeds "
            f"{experts_field} ({config[experts_field]})", file=config_path)
    return family


def safetensors_header(path: Path) -> dict[str, Any]:
    """Parse one shard's header and check the file is as long as the header says."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated (no safetensors header)", file=path)
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"{path}: truncated or corrupt (header of {header_len} bytes, file of "
                    f"{size} bytes)", file=path)
            header = json.loads(fh.read(header_len))
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})", file=path) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})", file=path) from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header", file=path)
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = math.prod(int(d) for d in shape)
            begin, end = int(begin), int(end)
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt entry for tensor {name!r}", file=path) \
                from exc
        if dtype not in ACCEPTED_STORED_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} is stored as {dtype}; accepted dtypes are "
                f"{', '.join(ACCEPTED_STORED_DTYPES)}", file=path)
        spans.append((begin, end, name, numel * _ITEMSIZE[dtype]))
    # The format's own rule, which safetensors enforces when transformers opens the file (with a
    # message that names no file): the tensors' byte ranges tile the data block in order, each
    # as long as its shape and dtype say, and the data block ends where the file does.
    data_end = 0
    for begin, end, name, nbytes in sorted(spans):
        if begin != data_end or end - begin != nbytes:
            raise CheckpointError(
                f"{path}: corrupt safetensors header (tensor {name!r} at bytes [{begin}, {end}) "
                f"of the data block: expected [{data_end}, {data_end + nbytes}))", file=path)
        data_end = end
    if 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{path}: truncated ({size} bytes, its header describes "
            f"{8 + header_len + data_end})", file=path)
    if 8 + header_len + data_end < size:
        raise CheckpointError(
            f"{path}: corrupt ({size} bytes, but its header describes only "
            f"{8 + header_len + data_end})", file=path)
    return header


def check_weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors shards, each checked; raises CheckpointError. The files
    transformers loads: ``model.safetensors`` when present, whatever index lies beside it
    (``save_pretrained`` leaves an earlier save's index there), else the index's shards."""
    index_path = directory / INDEX_FILE
    single = directory / SINGLE_WEIGHTS
    if single.is_file():
        safetensors_header(single)
        return [single]
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a safetensors index ({exc})",
                                  file=index_path) from exc
        expected: dict[str, set[str]] = {}
        for tensor, shard in weight_map.items():
            # A shard is a file of this directory: never read one an index points elsewhere.
            # Checked on the name, not resolved (Hub cache snapshots are symlinks to blobs).
            if not isinstance(shard, str) or not shard or Path(shard).anchor or \
                    ".." in Path(shard).parts:
                raise CheckpointError(
                    f"{index_path}: tensor {tensor!r} maps to {shard!r}, which is not a file "
                    f"name inside {directory}", file=index_path)
            expected.setdefault(shard, set()).add(tensor)
        shards = []
        for shard, tensors in sorted(expected.items()):
            path = directory / shard
            if not path.is_file():
                raise CheckpointError(
                    f"{path}: missing shard (listed in {INDEX_FILE} for {len(tensors)} tensors)",
                    file=path)
            absent = sorted(tensors - set(safetensors_header(path)))
            if absent:
                raise CheckpointError(
                    f"{path}: lacks {len(absent)} tensors {INDEX_FILE} maps to it "
                    f"(first: {absent[0]})", file=path)
            shards.append(path)
        return shards
    others = sorted(p.name for p in directory.glob("*.bin")) + \
        sorted(p.name for p in directory.glob("*.pt"))
    hint = f" (found {', '.join(others)}: only safetensors weights are read)" if others else ""
    raise CheckpointError(f"{single}: missing, and no {INDEX_FILE}{hint}", file=single)
