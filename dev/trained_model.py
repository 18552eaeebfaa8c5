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
    ``sparsegate_contracts`` they import, transitively (found by reading their import statements,
    so the answer does not depend on what this process happens to have imported)."""
    import ast
    import importlib

    import sparsegate_workload.training as training

    roots = {name: Path(importlib.import_module(name).__file__).parent  # type: ignore[arg-type]
             for name in ("sparsegate_workload", "sparsegate_contracts")}

    def module_file(top: str, parts: list[str]) -> Path | None:
        base = roots[top].joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def imported(path: Path) -> set[Path]:
        top = next(name for name, root in roots.items() if path.is_relative_to(root))
        package = list(path.relative_to(roots[top]).parent.parts)
        found: set[Path] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.ImportFrom):
                named = node.module.split(".") if node.module else []
                if node.level:
                    mod = (top, package[:len(package) - node.level + 1] + named)
                elif named and named[0] in roots:
                    mod = (named[0], named[1:])
                else:
                    continue
                targets += [mod] + [(mod[0], mod[1] + [a.name]) for a in node.names]  # `from . import submodule`
            elif isinstance(node, ast.Import):
                targets += [(n[0], n[1:]) for n in (a.name.split(".") for a in node.names) if n[0] in roots]
            for pkg, parts in targets:
                for depth in range(len(parts) + 1):  # a module's parent packages run their __init__ too
                    f = module_file(pkg, parts[:depth])
                    if f is not None:
                        found.add(f)
        return found

    todo = sorted(Path(training.__file__).parent.glob("*.py"))
    seen: set[Path] = set(todo)
    while todo:
        for f in imported(todo.pop()):
            if f not in seen:
                seen.add(f)
                todo.append(f)
    return sorted(seen)


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
