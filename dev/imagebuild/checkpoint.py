"""A model-server image with a checkpoint baked in: ``FROM`` a base image, ``COPY`` of a checkpoint
directory to where a SparseModel's ``spec.model.source`` names it (what the e2e tests serve)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from localcluster import podman


def bake_checkpoint(base: str, checkpoint: Path, *, ctx: Path, target: str, tag: str) -> str:
    """Builds ``tag`` from ``base`` with ``checkpoint`` copied to ``target``; returns ``tag``."""
    ctx.mkdir(parents=True, exist_ok=True)
    staged = ctx / "checkpoint"
    if checkpoint.resolve() != staged.resolve():
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(checkpoint, staged)
    # The server runs as a non-root user: the files must be world-readable (safetensors writes 0600).
    for f in [staged, *staged.rglob("*")]:
        f.chmod(0o755 if f.is_dir() else 0o644)
    (ctx / "Containerfile").write_text(f"FROM {base}\nCOPY checkpoint {target}\n")
    subprocess.run(["buildah", "bud", "--isolation", "chroot", "-q", "-t", tag, str(ctx)], check=True,
                   capture_output=True, env=podman._env(), timeout=300)
    return tag
