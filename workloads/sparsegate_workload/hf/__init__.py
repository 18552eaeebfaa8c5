"""Hugging Face MoE checkpoints served with sparsegate's dynamic gate.

`load_moe_checkpoint(path, ...)` reads a local checkpoint (``config.json`` + safetensors, and the
tokenizer files when present) of a supported family through ``transformers`` and replaces every
MoE block's fixed top-k routing with the dynamic gate and the sorted dispatch (`gated_block`).
`build_tiny_checkpoint(path, family=...)` writes a tiny random checkpoint, built in code, for
tests and demos. Nothing here downloads anything.

Kept import-free like the package root: importing ``sparsegate_workload.hf`` must stay cheap,
so the names below load their modules (and torch, transformers) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointError": "checkpoint_files",
    "SUPPORTED_FAMILIES": "families",
    "MoEFamily": "families",
    "SparseGatedCausalLM": "loader",
    "GatedForward": "loader",
    "load_moe_checkpoint": "loader",
    "SparseGatedMoEBlock": "gated_block",
    "GateCall": "gated_block",
    "build_tiny_checkpoint": "tiny",
    "build_tiny_tokenizer": "tiny",
    "ToolHead": "tool_head",
    "fit_tool_head": "tool_head",
    "load_tool_head": "tool_head",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
