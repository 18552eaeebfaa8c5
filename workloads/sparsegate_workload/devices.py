"""``--device``: where a checkpoint's weights, KV caches and MoE dispatch run."""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """The requested device cannot be used here."""


def resolve_device(choice: str) -> torch.device:
    """``auto``: CUDA when torch sees a GPU, else CPU. ``cuda`` without a usable GPU raises
    DeviceError saying why (a CPU-only torch build, or no GPU visible to this process)."""
    if choice not in DEVICE_CHOICES:
        raise DeviceError(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}")
    if choice == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if choice == "auto":
        return torch.device("cpu")
    why = ("this torch build has no CUDA support" if torch.version.cuda is None
           else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU (check the "
                "pod's nvidia.com/gpu limit, the node's driver and CUDA_VISIBLE_DEVICES)")
    raise DeviceError(f"--device cuda was requested but CUDA is not available: {why}")
