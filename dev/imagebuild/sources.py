"""Reads the checkout: which files go into the project wheel, their digest, the git revision.

In a git checkout the files are ``git ls-files --cached --others --exclude-standard`` of the
package directories (tracked plus new, not ignored: what setuptools would package, without
``__pycache__`` or ``*.egg-info``); elsewhere (an exported tree) the directories are walked.
Symlinks are read through (``sparsegate_contracts/rego/routing.rego`` links to the Rego source).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from imagebuild.errors import ImageBuildError

SKIP_DIRS = {"__pycache__", "build", "dist", ".pytest_cache"}
SKIP_SUFFIXES = (".pyc", ".pyo")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_git_checkout(root: Path) -> bool:
    return _git(root, "rev-parse", "--is-inside-work-tree", check=False).strip() == "true"


def _git(root: Path, *args: str, check: bool = True) -> str:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        if check:
            raise ImageBuildError("git not found (apt-get install git)") from None
        return ""
    if check and proc.returncode != 0:
        raise ImageBuildError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout if proc.returncode == 0 else ""


def _keep(rel: str) -> bool:
    parts = rel.split("/")
    return not (set(parts[:-1]) & SKIP_DIRS or any(p.endswith(".egg-info") for p in parts)
                or rel.endswith(SKIP_SUFFIXES))


def _walk(root: Path, dirs: Iterable[str]) -> list[str]:
    found = []
    for d in dirs:
        for dirpath, dirnames, filenames in os.walk(root / d):
            dirnames[:] = [n for n in dirnames if n not in SKIP_DIRS and not n.endswith(".egg-info")]
            found += [str((Path(dirpath) / f).relative_to(root)) for f in filenames]
    return found


def package_files(root: Path, dirs: Sequence[str]) -> list[str]:
    """Relative paths (sorted) of the files in the packages under ``dirs`` (setuptools'
    ``packages.find`` roots) that exist in the working tree. Files directly in a root (its
    Containerfile, README) are in no package, hence not in the wheel, and not listed."""
    if is_git_checkout(root):
        out = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *dirs)
        rels = [r for r in out.split("\0") if r]
    else:
        rels = _walk(root, dirs)
    # A file deleted in the working tree but still in the index is not an input any more.
    return sorted({r for r in rels if r.count("/") >= 2 and _keep(r) and (root / r).exists()})


def files_digest(root: Path, rels: Sequence[str]) -> str:
    """sha256 over (path, content sha256) of each file, read through symlinks."""
    h = hashlib.sha256()
    for rel in sorted(rels):
        path = root / rel
        if path.is_symlink() and not path.exists():
            raise ImageBuildError(f"{rel} is a broken symlink")
        h.update(f"{rel}\0{sha256_file(path)}\n".encode())
    return h.hexdigest()


def revision(root: Path, paths: Sequence[str]) -> str:
    """The last commit that changed ``paths`` (``-dirty`` when they differ from it in the working
    tree); ``unknown`` outside git. Commits that touch other files leave it, and the tag, alone."""
    if not is_git_checkout(root):
        return "unknown"
    commit = _git(root, "log", "-1", "--format=%H", "--", *paths, check=False).strip()
    if not commit:
        return "unknown"
    dirty = _git(root, "status", "--porcelain", "--", *paths, check=False).strip()
    return f"{commit}-dirty" if dirty else commit


def pyproject(root: Path) -> dict[str, Any]:
    with (root / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def project_version(root: Path) -> str:
    return str(pyproject(root)["project"]["version"])


def go_module_version(go_mod: Path, module: str) -> str:
    """The version ``go.mod`` requires of ``module`` (e.g. OPA's ``v1.22.4`` → ``1.22.4``)."""
    for line in go_mod.read_text().splitlines():
        words = line.replace("require", " ").split()
        if len(words) >= 2 and words[0] == module:
            return words[1].removeprefix("v")
    raise ImageBuildError(f"{go_mod} does not require {module}")
