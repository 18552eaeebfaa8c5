"""The trained demo checkpoint, built once per machine and cached (tests, demos).

``trained_checkpoint()`` runs ``python -m sparsegate_workload.training`` (``sparsegate-train``)
with the given arguments into ``~/.cache/sparsegate/trained/<key>``, where the key hashes the
arguments and the training package's source, so a changed recipe or trainer trains again. The
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


def _key(args: Sequence[str]) -> str:
    import sparsegate_workload.training as training

    h = hashlib.sha256("\0".join(args).encode())
    for f in sorted(Path(training.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
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
