"""Locating the Go-built binaries the local control plane runs.

They live in ``$SPARSEGATE_BIN`` (see dev/env.sh) and are built by dev/setup/binaries.sh. A
missing binary is an error, never a reason to skip: tests that need the cluster must fail loudly.
"""

from __future__ import annotations

import os
from pathlib import Path

SETUP_COMMAND = "bash dev/setup/binaries.sh"
CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl")


class MissingBinaryError(RuntimeError):
    """A binary the local cluster needs is not built."""


def bin_dir() -> Path:
    explicit = os.environ.get("SPARSEGATE_BIN")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("SPARSEGATE_CACHE") or str(Path.home() / ".cache" / "sparsegate")
    return Path(cache) / "bin"


def find_binary(name: str, *, directory: Path | None = None) -> Path:
    """Absolute path of ``name`` in the binaries directory, or a clear error saying how to build it."""
    where = directory or bin_dir()
    path = where / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise MissingBinaryError(
            f"required binary {name!r} not found at {path}; build it with `{SETUP_COMMAND} {name}`"
            f" (or `{SETUP_COMMAND}` for all)"
        )
    return path


def find_binaries(names: tuple[str, ...] = CONTROL_PLANE_BINARIES, *, directory: Path | None = None) -> dict[str, Path]:
    """All of ``names``, reporting every missing one at once."""
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name in names:
        try:
            found[name] = find_binary(name, directory=directory)
        except MissingBinaryError:
            missing.append(name)
    if missing:
        raise MissingBinaryError(
            f"required binaries missing from {directory or bin_dir()}: {', '.join(missing)};"
            f" build them with `{SETUP_COMMAND} {' '.join(missing)}`"
        )
    return found
