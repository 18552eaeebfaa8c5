"""The external programs (podman, buildah, mmdebstrap) and the per-machine cache and lock.

podman and buildah read the project's ``dev/containers/containers.conf`` (runc, no default
ulimits) through ``CONTAINERS_CONF``; podman's own defaults do not run on these machines.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from imagebuild.errors import ImageBuildError

REPO = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = REPO / "dev" / "containers" / "containers.conf"
DEBIAN_TOOLS = "podman buildah runc mmdebstrap uidmap"
INSTALL_HINT = f"sudo bash dev/setup/debian.sh {DEBIAN_TOOLS}   (or run dev/setup.sh)"


def cache_dir() -> Path:
    root = Path(os.environ.get("SPARSEGATE_CACHE") or Path.home() / ".cache" / "sparsegate")
    return root / "images"


def bin_dir() -> Path:
    return Path(os.environ.get("SPARSEGATE_BIN") or Path.home() / ".cache" / "sparsegate" / "bin")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return e


def require(*names: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        raise ImageBuildError(f"{' '.join(missing)} not found on PATH; install with: {INSTALL_HINT}")


def log(msg: str) -> None:
    print(f"[imagebuild] {msg}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], *, what: str, timeout: float = 3600, cwd: Path | None = None,
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs ``argv``; on failure raises with its command line and the tail of its output."""
    if not os.path.isabs(argv[0]):
        require(argv[0])
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env={**env(), **(extra_env or {})}, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise ImageBuildError(f"{what} did not finish within {timeout:.0f}s: {' '.join(argv)}") from None
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-4000:]
        raise ImageBuildError(f"{what} failed ({proc.returncode}): {' '.join(argv)}\n{tail}")
    return proc


def image_exists(ref: str) -> bool:
    require("podman")
    return subprocess.run(["podman", "image", "exists", ref], env=env(), capture_output=True,
                          stdin=subprocess.DEVNULL, check=False).returncode == 0


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One builder per machine at a time (like dev/setup/binaries.sh): the others wait, then
    find the images built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        t0 = time.monotonic()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another build ({path})")
            fcntl.flock(f, fcntl.LOCK_EX)
            log(f"lock acquired after {time.monotonic() - t0:.1f}s")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def local_images(reference: str) -> dict[str, float]:
    """ref → creation time (unix) of the local images matching ``reference`` (podman's filter)."""
    out = run(["podman", "images", "--format", "json", "--filter", f"reference={reference}"], what="podman images")
    found: dict[str, float] = {}
    for image in json.loads(out.stdout or "[]"):
        for name in image.get("Names") or []:
            found[name] = float(image.get("Created") or 0)
    return found


def remove_image(ref: str) -> bool:
    """``podman rmi`` (never forced: an image a container uses, or a base with children, stays)."""
    return subprocess.run(["podman", "rmi", ref], env=env(), capture_output=True, stdin=subprocess.DEVNULL,
                          check=False).returncode == 0
