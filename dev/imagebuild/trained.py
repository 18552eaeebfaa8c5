"""The model-server image with the trained demo checkpoint baked in (what the demo's trained model runs).

``FROM`` the stack's model-server image, ``COPY`` of ``dev/trained_model.py``'s cached checkpoint to
:data:`CHECKPOINT_DIR`. The tag digests both inputs (the base reference and the checkpoint's cache
key, which hashes the training arguments and the trainer's source), so an unchanged pair builds
nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

from imagebuild import build, tools

CHECKPOINT_DIR = "/models/sparsegate-demo"
REPOSITORY = "localhost/sparsegate-trained-demo"


def trained_ref(base_ref: str, checkpoint: Path) -> str:
    """``REPOSITORY:<digest of base_ref and the checkpoint's cache key (its directory name)>``."""
    digest = hashlib.sha256("\0".join((base_ref, checkpoint.name)).encode()).hexdigest()[:16]
    return f"{REPOSITORY}:{digest}"


def containerfile(base_ref: str) -> str:
    return f"FROM {base_ref}\nCOPY checkpoint {CHECKPOINT_DIR}\n"


def ensure_trained_image(base_ref: str) -> str:
    """Trains the demo checkpoint unless cached, builds the image unless present; returns its ref."""
    from trained_model import trained_checkpoint

    t0 = time.monotonic()
    checkpoint = trained_checkpoint()
    ref = trained_ref(base_ref, checkpoint)
    if tools.image_exists(ref):
        tools.log(f"trained-demo: {ref} up to date")
        return ref
    tools.require("buildah", "podman")
    cache = tools.cache_dir()
    with tools.locked(cache / ".lock"):
        if tools.image_exists(ref):
            return ref
        ctx = cache / "ctx" / f"trained-demo-{os.getpid()}"
        shutil.rmtree(ctx, ignore_errors=True)
        ctx.mkdir(parents=True)
        try:
            shutil.copytree(checkpoint, ctx / "checkpoint")
            # The server runs as a non-root user: the files must be world-readable (safetensors writes 0600).
            for f in [ctx / "checkpoint", *(ctx / "checkpoint").rglob("*")]:
                f.chmod(0o755 if f.is_dir() else 0o644)
            (ctx / "Containerfile").write_text(containerfile(base_ref))
            tools.run(["buildah", "bud", "--isolation", "chroot", "--pull=never", "--format", "oci",
                       "-t", ref, str(ctx)], what=f"buildah bud of {ref}", timeout=600)
        finally:
            shutil.rmtree(ctx, ignore_errors=True)
    tools.log(f"trained-demo: built {ref} in {time.monotonic() - t0:.1f}s (FROM {base_ref})")
    # Old tags would pin their model-server bases, which the main build's prune then cannot remove.
    build._prune(f"{REPOSITORY}:", ref)
    return ref
