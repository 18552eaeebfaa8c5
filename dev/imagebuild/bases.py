"""Base images from Debian's packages: ``mmdebstrap`` a bookworm rootfs, ``podman import`` it.

No registry is reachable from these machines, so ``FROM debian`` is not an option. A base is
tagged by the digest of its recipe (packages, suite, mirrors, options): it is rebuilt only when
the recipe changes, never because time passed (bump ``spec.RECIPE_VERSION`` or change the
recipe to pick up Debian point releases).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from imagebuild import spec, tools
from imagebuild.errors import ImageBuildError


def ensure_base(base: spec.BaseSpec, cache: Path) -> float | None:
    """Builds ``base.ref`` unless present; returns the seconds it took (None: nothing to do)."""
    if tools.image_exists(base.ref):
        return None
    tools.require("mmdebstrap", "podman")
    if os.geteuid() != 0:
        raise ImageBuildError(f"building {base.ref} runs `mmdebstrap --mode=root`: run as root (sudo)")
    t0 = time.monotonic()
    tools.log(f"base {base.ref}: mmdebstrap {base.suite} ({', '.join(base.packages)}) ...")
    work = cache / "bases"
    work.mkdir(parents=True, exist_ok=True)
    tarball = work / f"{base.tag}.{os.getpid()}.tar"
    try:
        tools.run(spec.mmdebstrap_argv(base, str(tarball)), what=f"mmdebstrap of {base.ref}", timeout=1800)
        tools.run(spec.import_argv(base, str(tarball)), what=f"podman import of {base.ref}")
    finally:
        tarball.unlink(missing_ok=True)
    took = time.monotonic() - t0
    tools.log(f"base {base.ref}: built in {took:.1f}s")
    return took
