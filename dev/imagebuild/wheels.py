"""Wheels for the images, prepared on the host (``pip install`` from the network inside a build
fails certificate verification here) and installed offline inside the build.

* dependency wheel sets: ``pip download --only-binary=:all:`` for Debian bookworm's CPython 3.11 on
  manylinux x86_64, into ``<cache>/wheels/<set>-<key>/``, the key being a digest of the
  requirement list and that target (so a set is downloaded once per machine and never changes);
* the project wheel: ``pip wheel --no-deps --no-build-isolation`` of a copy of exactly the files
  whose digest is in the tag, into ``<cache>/project/<digest>/``.

Each directory is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from imagebuild import sources, spec, tools
from imagebuild.errors import ImageBuildError

KEY_FILE = "KEY"                  # the set's key / the project digest, checked inside the build
REQUIREMENTS_FILE = "requirements.txt"


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / KEY_FILE).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # someone else published the same content


def prune_dirs(parent: Path, pattern: str, current: Path, keep: int) -> None:
    """Removes the complete cache directories matching ``pattern`` other than ``current`` beyond
    the ``keep`` most recently made (old wheel sets are GBs; old project wheels pile up)."""
    others = [d for d in parent.glob(pattern) if d != current and (d / KEY_FILE).is_file()]
    for d in sorted(others, key=lambda d: -d.stat().st_mtime)[keep:]:
        shutil.rmtree(d, ignore_errors=True)


def ensure_wheelset(ws: spec.WheelSet, cache: Path) -> Path:
    final = cache / "wheels" / ws.dirname
    if (final / KEY_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{ws.dirname}.", dir=final.parent))
    try:
        req = tmp / REQUIREMENTS_FILE
        req.write_text("".join(f"{r}\n" for r in ws.requirements))
        tools.log(f"downloading wheel set {ws.name} ({len(ws.requirements)} requirements) ...")
        if ws.requirements:
            tools.run(spec.pip_download_argv(sys.executable, ws, str(tmp), str(req)),
                      what=f"pip download of wheel set {ws.name}")
        (tmp / KEY_FILE).write_text(ws.key)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_dirs(final.parent, f"{ws.name}-*", final, keep=1)
    size = sum(p.stat().st_size for p in final.iterdir())
    tools.log(f"wheel set {ws.name}: {len(list(final.glob('*.whl')))} wheels, {size / 1e6:.0f} MB in {final}")
    return final


def _readme_stub(version: str) -> str:
    # The wheel's long description: a fixed text, so README edits (which change nothing an image
    # runs) neither change the wheel nor its images.
    return f"# sparsegate {version}\n\nSee {spec.SOURCE_URL}\n"


def ensure_project_wheel(root: Path, files: list[str], digest: str, version: str, cache: Path) -> Path:
    """The wheel built from exactly ``files`` (+ pyproject.toml), cached by their ``digest``."""
    final = cache / "project" / digest[:32]
    if (final / KEY_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.", dir=final.parent))
    try:
        src = tmp / "src"
        for rel in files:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, src / rel)  # follows symlinks
        if sources.files_digest(src, files) != digest:  # edited while we planned: the tag would lie
            raise ImageBuildError("the project's sources changed during the build; run it again")
        (src / "README.md").write_text(_readme_stub(version))
        out = tmp / "out"
        env_epoch = {"SOURCE_DATE_EPOCH": "315532800"}  # zip timestamps: 1980-01-01
        tools.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                   "--wheel-dir", str(out), str(src)], what="pip wheel of the project",
                  cwd=tmp, extra_env=env_epoch)
        wheels = list(out.glob("sparsegate-*.whl"))
        if len(wheels) != 1:
            raise ImageBuildError(f"pip wheel made {[w.name for w in out.iterdir()]}, expected one sparsegate wheel")
        pub = tmp / "publish"
        pub.mkdir()
        shutil.move(str(wheels[0]), pub / wheels[0].name)
        (pub / KEY_FILE).write_text(digest)
        _publish(pub, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_dirs(final.parent, "*", final, keep=8)
    return final
