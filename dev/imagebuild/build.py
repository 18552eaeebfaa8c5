"""Plans (pure digests of the checkout) and builds (buildah) the project's images.

``refs()`` computes every image's reference without building anything; ``ensure_images()`` builds
the ones this machine lacks, under one per-machine lock, and returns the references.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from imagebuild import bases, sources, spec, tools, wheels
from imagebuild.errors import ImageBuildError

OPA_GO_MOD = "dev/go/opa/go.mod"
OPA_MODULE = "github.com/open-policy-agent/opa"


@dataclasses.dataclass(frozen=True)
class Planned:
    spec: spec.ImageSpec
    inputs: spec.Inputs

    @property
    def ref(self) -> str:
        return spec.image_ref(self.spec, self.inputs)


class Checkout:
    """The digests of one checkout, each computed once."""

    def __init__(self, root: Path = tools.REPO) -> None:
        self.root = root

    @functools.cached_property
    def pyproject(self) -> dict:
        return sources.pyproject(self.root)

    @functools.cached_property
    def version(self) -> str:
        return str(self.pyproject["project"]["version"])

    @functools.cached_property
    def wheelsets(self) -> dict[str, spec.WheelSet]:
        return spec.wheel_sets(self.pyproject)

    @functools.cached_property
    def project_files(self) -> list[str]:
        return sources.package_files(self.root, spec.PACKAGE_DIRS) + ["pyproject.toml"]

    @functools.cached_property
    def project_digest(self) -> str:
        return sources.files_digest(self.root, self.project_files)

    @functools.cached_property
    def project_paths(self) -> list[str]:
        """What the project wheel's revision is read from: its package directories, pyproject.toml
        and the targets of symlinks in them (the Rego source)."""
        packages = {"/".join(r.split("/")[:2]) for r in self.project_files if r.count("/") >= 2}
        targets = {os.path.relpath((self.root / r).resolve(), self.root)
                   for r in self.project_files if (self.root / r).is_symlink()}
        return sorted(packages | {t for t in targets if not t.startswith("..")}) + ["pyproject.toml"]

    @functools.cached_property
    def opa_binary(self) -> Path:
        path = tools.bin_dir() / "opa"
        if not path.is_file():
            raise ImageBuildError(f"{path} is missing: build it with `bash dev/setup/binaries.sh opa` (or dev/setup.sh)")
        return path

    @functools.cached_property
    def opa_sha256(self) -> str:
        return sources.sha256_file(self.opa_binary)

    def containerfile(self, s: spec.ImageSpec) -> Path:
        path = self.root / s.containerfile
        if not path.is_file():
            raise ImageBuildError(f"{path} is missing")
        return path

    def inputs(self, s: spec.ImageSpec) -> spec.Inputs:
        cf = self.containerfile(s)
        paths = [s.containerfile]
        if s.project_wheel:
            paths += self.project_paths
        if s.opa:
            paths.append(OPA_GO_MOD)
        version = sources.go_module_version(self.root / OPA_GO_MOD, OPA_MODULE) if s.opa else self.version
        return spec.Inputs(
            containerfile=sources.sha256_file(cf),
            version=version,
            revision=sources.revision(self.root, paths),
            base_ref=spec.BASES[s.base].ref if s.base else "scratch",
            wheelsets={w: self.wheelsets[w].key for w in s.wheels},
            project=self.project_digest if s.project_wheel else "",
            opa=self.opa_sha256 if s.opa else "",
        )


def plan(names: Sequence[str] | None = None, checkout: Checkout | None = None) -> list[Planned]:
    co = checkout or Checkout()
    return [Planned(s, co.inputs(s)) for s in spec.select(names)]


def refs(names: Sequence[str] | None = None) -> dict[str, str]:
    """name → ``localhost/sparsegate-<name>:<tag>`` for this checkout; builds nothing."""
    return {p.spec.name: p.ref for p in plan(names)}


def _stage_context(p: Planned, co: Checkout, cache: Path) -> Path:
    """A build context of hard links: wheels/<set>/, project/, opa (bind-mounted or copied by the
    Containerfile). Its KEY files let the build check it matches the ARGs."""
    ctx = cache / "ctx" / f"{p.spec.name}-{os.getpid()}"
    shutil.rmtree(ctx, ignore_errors=True)
    ctx.mkdir(parents=True)
    for name in p.spec.wheels:
        src = wheels.ensure_wheelset(co.wheelsets[name], cache)
        for f in src.iterdir():
            tools.link_or_copy(f, ctx / "wheels" / name / f.name)
    if p.spec.project_wheel:
        src = wheels.ensure_project_wheel(co.root, co.project_files, co.project_digest, co.version, cache)
        for f in src.iterdir():
            tools.link_or_copy(f, ctx / "project" / f.name)
    if p.spec.opa:
        tools.link_or_copy(co.opa_binary, ctx / "opa")
    return ctx


# runc failing to start a RUN step's process, not the step's own command failing: seen once on
# these machines ("Close_Fd sealing memfd copy: Device or resource busy" from runc's re-exec).
TRANSIENT_RUNC_ERRORS = ("sealing memfd",)
TRANSIENT_ATTEMPTS = 3


def _build(p: Planned, co: Checkout, cache: Path) -> None:
    tools.require("buildah", "podman")
    if p.spec.base:
        bases.ensure_base(spec.BASES[p.spec.base], cache)
    ctx = _stage_context(p, co, cache)
    try:
        argv = spec.buildah_argv(p.spec, p.inputs, str(co.containerfile(p.spec)), str(ctx))
        for attempt in range(1, TRANSIENT_ATTEMPTS + 1):
            try:
                tools.run(argv, what=f"buildah bud of {p.ref}", timeout=3600)
                break
            except ImageBuildError as exc:
                if attempt == TRANSIENT_ATTEMPTS or not any(t in str(exc) for t in TRANSIENT_RUNC_ERRORS):
                    raise
                tools.log(f"{p.ref}: transient runc failure in a RUN step, building again "
                          f"(attempt {attempt + 1} of {TRANSIENT_ATTEMPTS}; finished layers are cached)")
    finally:
        shutil.rmtree(ctx, ignore_errors=True)


def ensure_images(names: Sequence[str] | None = None) -> dict[str, str]:
    """Builds the images (default: all) this machine lacks; returns name → reference.

    Unchanged inputs on a warm machine: no build at all (``podman image exists``). Several
    callers at once: one builds, the others wait on the lock and then find the images.
    """
    tools.require("podman")
    co = Checkout()
    planned = plan(names, co)
    result = {p.spec.name: p.ref for p in planned}
    missing = [p for p in planned if not tools.image_exists(p.ref)]
    for p in planned:
        if p not in missing:
            tools.log(f"{p.spec.name}: {p.ref} up to date")
    if not missing:
        return result
    cache = tools.cache_dir()
    with tools.locked(cache / ".lock"):
        for left in sweep_leftovers(cache):
            tools.log(f"removed {left}, left by a build that was killed")
        for p in missing:
            if tools.image_exists(p.ref):  # built by whoever held the lock before us
                tools.log(f"{p.spec.name}: {p.ref} built meanwhile by another process")
                continue
            t0 = time.monotonic()
            tools.log(f"{p.spec.name}: building {p.ref} ...")
            _build(p, co, cache)
            tools.log(f"{p.spec.name}: built {p.ref} in {time.monotonic() - t0:.1f}s")
            _prune(f"{p.spec.repository}:", p.ref)
            if p.spec.base:
                base = spec.BASES[p.spec.base]
                _prune(base.ref.rsplit("-", 1)[0] + "-", base.ref)
    return result


def sweep_leftovers(cache: Path) -> list[Path]:
    """Removes what builds killed before their ``finally`` ran (SIGTERM, SIGKILL: a cancelled CI
    job) left in ``cache``: build contexts, the dot-named temporary directories of a wheel set
    download (up to the whole 3 GB workload set) or a project wheel, mmdebstrap tarballs. Only
    called holding the cache's lock, which every builder holds while it writes them: none is in use."""
    found = sorted([*cache.glob("ctx/*"), *cache.glob("wheels/.*"), *cache.glob("project/.*"),
                    *cache.glob("bases/*.tar")])
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def _prune(prefix: str, current: str) -> None:
    """Removes older tags of one repository (or base flavor) beyond the newest few; podman then
    drops their now unused layers. Failures (in use, has children) leave the image alone."""
    existing = tools.local_images(prefix.rstrip(":-").split(":")[0])
    for ref in spec.stale_refs(existing, prefix, current):
        if tools.remove_image(ref):
            tools.log(f"removed old image {ref}")
