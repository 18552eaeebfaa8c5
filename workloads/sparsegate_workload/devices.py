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


def check_model_dtype(device: torch.device, dtype: str, *, flag: str = "--model-dtype"
                      ) -> str | None:
    """Whether ``--model-dtype dtype`` (``flag``) can run on ``device``. bfloat16 on a GPU without native
    bf16 (compute capability below 8.0, e.g. a T4 or V100): DeviceError naming the flag when
    torch cannot use bf16 there at all (its matmuls would fail on every request after a load
    that looked fine); where torch only emulates it, the warning to log (it runs, slower than
    float16, without tensor cores). None: nothing to say."""
    if device.type != "cuda" or dtype != "bfloat16":
        return None
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    gpu = f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor})"
    if not torch.cuda.is_bf16_supported(including_emulation=True):
        raise DeviceError(f"{flag} bfloat16: {gpu} does not support bfloat16; use "
                          f"{flag} float16 or float32")
    return (f"{flag} bfloat16: {gpu} has no native bfloat16 (compute capability 8.0+); "
            f"torch emulates it, slower than {flag} float16")
