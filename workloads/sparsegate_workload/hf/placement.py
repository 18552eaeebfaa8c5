"""Per-expert placement of a checkpoint's experts (server flag ``--expert-placement-json``).

A placement stores chosen experts' weights in another dtype and/or on another device than the
rest of their layer: ``{"<layer>:<expert>": {"dtype": ..., "device": ...}}``, layer an MoE block
index or ``*`` (every block); a ``<layer>:<expert>`` key wins over ``*:<expert>``. The block's
inference dispatch moves that expert's rows to its device and dtype, runs the SwiGLU there and
writes the result back in the activation dtype (the training path ignores placement).

The placed copy is made from the expert's weights as stored when `apply_placement` runs (the
layer's own storage stays too, so placed experts are held twice); later gate precision changes
do not touch it.

`measure_placement_factors` times one matmul of each layer's expert shape per (device, dtype)
present, median of a few repetitions, and sets each expert's `ExpertCost` placement factor to
its (device, dtype) time relative to the fastest. On CPU the dispatch timer already sees the
placed expert's real compute, so there the factor mostly makes the slow expert costly before it
was ever timed (and multiplies the measured slowdown once more); on an accelerator the dispatch
records no time (its host timer would see only kernel launches), and the factor alone carries
the signal.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .gated_block import SparseGatedMoEBlock

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLAG = "--expert-placement-json"


class PlacementError(ValueError):
    """A placement that cannot apply; the message names the key and field."""


@dataclasses.dataclass(frozen=True)
class PlacementSpec:
    """One key's request: None fields keep the layer's own dtype/device."""

    dtype: torch.dtype | None
    device: torch.device | None


def parse_placement(doc: Any) -> dict[tuple[int | None, int], PlacementSpec]:
    """The flag's JSON (already decoded) -> {(layer or None for "*", expert): spec}."""
    if not isinstance(doc, Mapping):
        raise PlacementError(f"{FLAG} must be a JSON object, got {type(doc).__name__}")
    out: dict[tuple[int | None, int], PlacementSpec] = {}
    for key, value in doc.items():
        where = f"{FLAG}[{key!r}]"
        layer_s, sep, expert_s = str(key).partition(":")
        if not sep or not expert_s.isdigit() or not (layer_s == "*" or layer_s.isdigit()):
            raise PlacementError(f"{where}: key must be '<layer>:<expert>' or '*:<expert>' "
                                 f"(non-negative integers)")
        if not isinstance(value, Mapping) or not value:
            raise PlacementError(f"{where} must be an object with 'dtype' and/or 'device'")
        unknown = sorted(set(value) - {"dtype", "device"})
        if unknown:
            raise PlacementError(f"{where}: unknown field {unknown[0]!r} (dtype, device)")
        dtype = None
        if "dtype" in value:
            if value["dtype"] not in DTYPES:
                raise PlacementError(f"{where}.dtype must be one of {', '.join(DTYPES)}, "
                                     f"got {value['dtype']!r}")
            dtype = DTYPES[value["dtype"]]
        device = None
        if "device" in value:
            name = value["device"]
            try:
                device = torch.device(name) if isinstance(name, str) else None
            except RuntimeError:
                device = None
            if device is None or device.type not in ("cpu", "cuda"):
                raise PlacementError(f"{where}.device must be 'cpu', 'cuda' or 'cuda:N', "
                                     f"got {name!r}")
            if device.type == "cuda" and (not torch.cuda.is_available() or (
                    device.index or 0) >= torch.cuda.device_count()):
                raise PlacementError(f"{where}.device {name!r}: no such CUDA device here")
        out[(None if layer_s == "*" else int(layer_s), int(expert_s))] = PlacementSpec(dtype, device)
    return out


def parse_placement_json(text: str) -> dict[tuple[int | None, int], PlacementSpec]:
    try:
        return parse_placement(json.loads(text))
    except json.JSONDecodeError as e:
        raise PlacementError(f"{FLAG}: not JSON ({e})") from e


class PlacedExpert:
    """One expert's SwiGLU weights ([d, 2f] and [f, d], contiguous) on its own device/dtype."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up = gate_up
        self.down = down
        self.dtype = gate_up.dtype
        self.device = gate_up.device

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out <- SwiGLU(x) computed on this expert's device in its dtype (copied back)."""
        h = x.to(self.device, self.dtype) @ self.gate_up
        gate, up = h.chunk(2, dim=-1)
        out.copy_(F.silu(gate, inplace=True).mul_(up) @ self.down)


def apply_placement(blocks: Sequence[SparseGatedMoEBlock],
                    spec: Mapping[tuple[int | None, int], PlacementSpec], *,
                    compute_dtype: torch.dtype, device: torch.device) -> None:
    """Give each placed expert of `blocks` its own weights (checked against the model first:
    nothing changes when a key does not fit). ``compute_dtype``/``device``: the layer's own."""
    num_experts = blocks[0].num_experts if blocks else 0
    for (layer, expert) in spec:
        key = f"{FLAG}['{'*' if layer is None else layer}:{expert}']"
        if layer is not None and layer >= len(blocks):
            raise PlacementError(f"{key}: layer {layer} out of range (the model has "
                                 f"{len(blocks)} MoE blocks)")
        if expert >= num_experts:
            raise PlacementError(f"{key}: expert {expert} out of range (the model has "
                                 f"{num_experts} experts)")
    for i, block in enumerate(blocks):
        gate_up, down = block.expert_storage
        placed: dict[int, PlacedExpert] = {}
        for e in range(block.num_experts):
            want = spec.get((i, e)) or spec.get((None, e))
            if want is None:
                continue
            dt, dev = want.dtype or compute_dtype, want.device or device
            placed[e] = PlacedExpert(
                gate_up.materialize(torch.float32, e).to(dev, dt).contiguous(),
                down.materialize(torch.float32, e).to(dev, dt).contiguous())
        block.placed = placed


def _median_mm_seconds(rows: int, d_in: int, d_out: int, dtype: torch.dtype,
                       device: torch.device, reps: int) -> float:
    x = torch.randn(rows, d_in, device=device).to(dtype)
    w = torch.randn(d_in, d_out, device=device).to(dtype)
    # This device's queue: a bare synchronize() waits for the current device only (cuda:0).
    sync = ((lambda: torch.cuda.synchronize(device)) if device.type == "cuda"
            else (lambda: None))
    x @ w  # warm-up (kernel selection, first-touch)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        x @ w
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_placement_factors(blocks: Sequence[SparseGatedMoEBlock], *,
                              compute_dtype: torch.dtype, device: torch.device,
                              rows: int = 32, reps: int = 7) -> list[list[float]]:
    """Set every block's placement factors from a timed [rows, d] @ [d, 2f] per (device,
    dtype) present in it; returns them per block. All 1.0 where nothing is placed."""
    result = []
    for block in blocks:
        d_in, d_out = block.expert_storage[0].data.shape[1:]
        placed = getattr(block, "placed", {})
        where = [(placed[e].device, placed[e].dtype) if e in placed else (device, compute_dtype)
                 for e in range(block.num_experts)]
        seconds = {k: _median_mm_seconds(rows, d_in, d_out, k[1], k[0], reps)
                   for k in dict.fromkeys(where)} if len(set(where)) > 1 else {where[0]: 1.0}
        fastest = min(seconds.values())
        factors = [seconds[k] / fastest for k in where]
        block.cost.set_placement(factors)
        result.append(factors)
    return result
