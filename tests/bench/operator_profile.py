"""Where the operator's Python time goes over a window of a benchmark: a sampling profile of its
process taken with py-spy (``py-spy record --gil --format raw``), summed by package and by function.

Used by ``bench_scale.py --operator-profile``. ``--gil`` keeps only the samples of a thread holding
the GIL: the operator runs its event loop and its pools' threads in one process, so the GIL is the
resource their work queues for, and a thread waiting on a socket is left out. Sampling
``--nonblocking`` (the process is not paused to read its stacks) costs the operator little; a
stack read mid-change is at worst attributed to a neighbouring frame.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

RATE_HZ = 100


def py_spy() -> str:
    """py-spy's path; RuntimeError naming the fix when it is not installed (never a silent skip)."""
    found = shutil.which("py-spy")
    if found is None:
        raise RuntimeError("--operator-profile needs py-spy on PATH: pip install -e '.[dev]' "
                           "(dev/setup/python.sh installs it)")
    return found


def start(pid: int, *, seconds: int, output: Path) -> subprocess.Popen:
    """py-spy sampling ``pid`` for ``seconds`` into ``output`` (collapsed stacks)."""
    return subprocess.Popen([py_spy(), "record", "--pid", str(pid), "--duration", str(seconds),
                             "--rate", str(RATE_HZ), "--gil", "--nonblocking", "--format", "raw",
                             "--output", str(output)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def package(frame: str) -> str:
    """The package a py-spy frame (``function (path/to/file.py:line)``) runs in: the first
    component of its (shortened) path, two for ours (``sparsegate.handlers``); ``<builtin>`` for
    a frame without a file."""
    if "(" not in frame:
        return "<builtin>"
    path = frame.rsplit("(", 1)[1].rsplit(":", 1)[0]
    parts = [p for p in path.split("/") if p]
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            parts = parts[parts.index(marker) + 1:]
    if "sparsegate" in parts:
        parts = parts[parts.index("sparsegate"):]
        return ".".join(p.removesuffix(".py") for p in parts[:2])
    stdlib = [i for i, p in enumerate(parts[:-1]) if p.startswith("python3")]
    if stdlib:
        parts = parts[stdlib[-1] + 1:]  # a stdlib module by its full path
    return parts[0].removesuffix(".py") if parts else "<builtin>"


def function(frame: str) -> str:
    """A frame without its line number: ``function (path/to/file.py)``."""
    return frame.rsplit(":", 1)[0] + ")" if ":" in frame else frame


def breakdown(raw: str, *, top: int = 15) -> dict[str, Any]:
    """Collapsed stacks (``frame;frame;...;leaf count`` per line, root first) summed: per package,
    the share of samples with any frame in it (inclusive) and with the leaf in it (self); the
    functions most often at the leaf, and our own (``sparsegate``) functions most often on the
    stack."""
    inclusive: Counter[str] = Counter()
    self_: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        inclusive.update({p: n for p in {package(f) for f in frames}})
        self_[package(frames[-1])] += n
        leaves[function(frames[-1])] += n
        ours.update({f: n for f in {function(f) for f in frames if package(f).startswith("sparsegate")}})

    def shares(counter: Counter[str], limit: int) -> dict[str, float]:
        return {k: round(v / total, 3) for k, v in counter.most_common(limit) if v / total >= 0.005}

    return {"samples": total, "seconds": round(total / RATE_HZ, 1),
            "packageInclusive": shares(inclusive, 30), "packageSelf": shares(self_, 30),
            "topLeafFunctions": shares(leaves, top), "topSparsegateFunctions": shares(ours, top)}


def result(proc: subprocess.Popen, output: Path) -> dict[str, Any]:
    """Waits for py-spy and sums what it recorded; RuntimeError with its message if it failed."""
    _, err = proc.communicate(timeout=120)
    if proc.returncode != 0 or not output.exists():
        raise RuntimeError(f"py-spy exited {proc.returncode}: {err.strip()[-2000:]}")
    return {**breakdown(output.read_text()), "rawProfile": str(output)}
