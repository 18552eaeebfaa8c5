"""The trained demo checkpoint, built once per machine and cached (tests, demos).

``trained_checkpoint()`` runs ``python -m sparsegate_workload.training`` (``sparsegate-train``)
with the given arguments into ``~/.cache/sparsegate/trained/<key>``, where the key hashes the
arguments and the source of the training package and of every project module it imports
(:func:`trainer_sources`), so a changed recipe, trainer or model code it uses trains again. The
default arguments are the demo recipe (a tiny Mixtral, top-p 0.6 over 1-4 of 8 experts, 400
steps, seed 0: about a minute on one CPU core). Training writes into a temporary directory and
renames it into place, so a killed run never leaves a half-written cache entry.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

CACHE = Path(os.environ.get("SPARSEGATE_CACHE", Path.home() / ".cache" / "sparsegate")) / "trained"
DEMO_ARGS: tuple[str, ...] = ("--steps", "400", "--seed", "0", "--threads", "1")


def trainer_sources() -> list[Path]:
    """The training package's modules and every module of ``sparsegate_workload`` or
    ``sparsegate_contracts`` they import, transitively, with their parent packages (whose
    ``__init__`` runs too). The import graph is grimp's (import-linter's), built from the sources'
    import statements, so the answer does not depend on what this process happens to have imported."""
    import importlib.util

    import grimp

    graph = grimp.build_graph("sparsegate_workload", "sparsegate_contracts")
    training = "sparsegate_workload.training"
    modules = {training, *graph.find_descendants(training)}
    for module in list(modules):
        modules |= graph.find_upstream_modules(module)
    with_parents = {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 2)}
    return sorted(Path(importlib.util.find_spec(m).origin) for m in with_parents)  # type: ignore[union-attr, arg-type]


def _key(args: Sequence[str]) -> str:
    h = hashlib.sha256("\0".join(args).encode())
    for f in trainer_sources():
        h.update(f"{f.parent.name}/{f.name}".encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def trained_checkpoint(args: Sequence[str] = DEMO_ARGS, *, timeout_s: float = 900) -> Path:
    """The checkpoint directory trained with ``args`` (trains it unless cached)."""
    out = CACHE / _key(args)
    if (out / "sparsegate_training.json").is_file():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be training the same key
        if (out / "sparsegate_training.json").is_file():
            return out
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        proc = subprocess.run([sys.executable, "-m", "sparsegate_workload.training", "--output", str(tmp),
                               "--quiet", *args], capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"sparsegate-train {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        tmp.rename(out)
    return out
