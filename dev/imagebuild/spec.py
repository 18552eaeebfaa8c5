"""What the images are made of, as data, and the pure functions over it (tags, build arguments).

Nothing here touches the disk, git, the network or podman: the unit tests exercise it directly.
An image's tag is a content hash of every input that decides its bytes (never a timestamp), so a
machine that already holds ``<repository>:<tag>`` has nothing to build.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence

# Bump when the way images are assembled changes in a way the hashed inputs below do not show
# (e.g. a new step in build.py); every image is then rebuilt once.
RECIPE_VERSION = "1"

REGISTRY = "localhost"
SOURCE_URL = "https://github.com/sparsegate/sparsegate"  # as charts/sparsegate/Chart.yaml `home`

# The target interpreter and libc: Debian bookworm's python3 (3.11) and glibc (2.36). Wheels are
# resolved on the host for this target, never for the host's own interpreter.
PYTHON_VERSION = "3.11"
PYTHON_ABI = "cp311"
GLIBC_MINOR = 36
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def wheel_platforms(glibc_minor: int = GLIBC_MINOR) -> tuple[str, ...]:
    """Every manylinux tag a glibc 2.<minor> x86_64 system accepts, newest first (pip does not
    expand an explicit ``--platform manylinux_2_36_x86_64`` to older ones by itself)."""
    modern = tuple(f"manylinux_2_{m}_x86_64" for m in range(glibc_minor, 4, -1))
    return modern + ("manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def digest_of(value: object) -> str:
    """sha256 of a JSON-able value in canonical form (sorted keys): equal values, equal digests."""
    return sha256_text(json.dumps(value, sort_keys=True, separators=(",", ":")))


# -- base images (Debian rootfs from mmdebstrap, imported into podman) --------------------------

DEBIAN_MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# No docs, man pages or translations in the images (copyright files stay).
DPKG_OPTS = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
)
APT_OPTS = ('APT::Install-Recommends "false"',)


@dataclasses.dataclass(frozen=True)
class BaseSpec:
    flavor: str
    packages: tuple[str, ...]
    suite: str = "bookworm"
    variant: str = "minbase"
    mirrors: tuple[str, ...] = DEBIAN_MIRRORS
    dpkg_opts: tuple[str, ...] = DPKG_OPTS
    apt_opts: tuple[str, ...] = APT_OPTS
    env_path: str = STD_PATH

    @property
    def tag(self) -> str:
        return f"{self.flavor}-{digest_of(dataclasses.asdict(self))[:16]}"

    @property
    def ref(self) -> str:
        return f"{REGISTRY}/sparsegate-base:{self.tag}"


PYTHON_PACKAGES = ("python3", "python3-venv", "ca-certificates")
BASES: dict[str, BaseSpec] = {
    "python": BaseSpec("python", PYTHON_PACKAGES),
    # The node agent: Debian's BCC 0.26 (python3-bpfcc over libbcc, NOT PyPI's unrelated `bcc`),
    # its tools, and `ip`. No kernel headers: the DaemonSet mounts the host's /lib/modules, /usr/src.
    "bpf": BaseSpec("bpf", PYTHON_PACKAGES + ("python3-bpfcc", "bpfcc-tools", "iproute2")),
}


def mmdebstrap_argv(base: BaseSpec, target: str) -> list[str]:
    """The mmdebstrap command writing ``base`` as a tarball to ``target`` (mirrors given
    explicitly: without them mmdebstrap would read a sources.list from stdin)."""
    argv = ["mmdebstrap", "--mode=root", f"--variant={base.variant}", "--include=" + ",".join(base.packages)]
    argv += [f"--aptopt={o}" for o in base.apt_opts]
    argv += [f"--dpkgopt={o}" for o in base.dpkg_opts]
    return argv + [base.suite, target, *base.mirrors]


def import_argv(base: BaseSpec, tarball: str) -> list[str]:
    return ["podman", "import", "--quiet", "--change", f"ENV PATH={base.env_path}", tarball, base.ref]


# -- Python wheel sets (resolved on the host, installed offline inside the build) ----------------

@dataclasses.dataclass(frozen=True)
class WheelSet:
    """One group of requirements installed in one image layer, downloaded once per machine."""

    name: str
    requirements: tuple[str, ...]

    @property
    def key(self) -> str:
        target = {"python": PYTHON_VERSION, "abi": PYTHON_ABI, "platforms": wheel_platforms()}
        return digest_of({"requirements": list(self.requirements), "target": target})[:16]

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.key}"


def wheel_sets(pyproject: Mapping[str, object]) -> dict[str, WheelSet]:
    """``core``: the project's dependencies (operator, agent, model server); ``workload``: the
    ``workload`` extra alone (torch and numpy, the big layer the model server installs first)."""
    project = pyproject["project"]
    assert isinstance(project, Mapping)
    extras = project.get("optional-dependencies") or {}
    assert isinstance(extras, Mapping)
    return {
        "core": WheelSet("core", tuple(project.get("dependencies") or ())),
        "workload": WheelSet("workload", tuple(extras.get("workload") or ())),
    }


def pip_download_argv(python: str, wheelset: WheelSet, dest: str, requirements_file: str) -> list[str]:
    argv = [python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--dest", dest,
            "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
            "--abi", PYTHON_ABI]
    for platform in wheel_platforms():
        argv += ["--platform", platform]
    return argv + ["-r", requirements_file]


# -- the images -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ImageSpec:
    name: str                       # what callers ask for: operator, model-server, agent, opa
    containerfile: str              # relative to the repository root
    title: str
    base: str | None = None         # key of BASES; None: FROM scratch
    wheels: tuple[str, ...] = ()    # wheel sets, installed in this order (one layer each)
    project_wheel: bool = False     # the sparsegate wheel built from this checkout
    opa: bool = False               # the static opa binary from $SPARSEGATE_BIN

    @property
    def repository(self) -> str:
        return f"{REGISTRY}/sparsegate-{self.name}"


IMAGES: dict[str, ImageSpec] = {
    "operator": ImageSpec("operator", "operator/Containerfile", "sparsegate-operator",
                          base="python", wheels=("core",), project_wheel=True),
    "model-server": ImageSpec("model-server", "workloads/Containerfile", "sparsegate-model-server",
                              base="python", wheels=("workload", "core"), project_wheel=True),
    "agent": ImageSpec("agent", "ebpf/Containerfile", "sparsegate-agent",
                       base="bpf", wheels=("core",), project_wheel=True),
    "opa": ImageSpec("opa", "policies/Containerfile", "sparsegate-opa", opa=True),
}
IMAGE_NAMES: tuple[str, ...] = tuple(IMAGES)

# Where the project's Python sources live (setuptools' packages.find `where`).
PACKAGE_DIRS = ("operator", "workloads", "ebpf")


def select(names: Sequence[str] | None) -> list[ImageSpec]:
    if not names:
        return list(IMAGES.values())
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        raise ValueError(f"unknown image(s) {unknown}; known: {', '.join(IMAGE_NAMES)}")
    return [IMAGES[n] for n in dict.fromkeys(names)]


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Everything one image is built from, already reduced to digests and strings."""

    containerfile: str                       # sha256 of the Containerfile
    version: str                             # org.opencontainers.image.version
    revision: str                            # org.opencontainers.image.revision
    base_ref: str = "scratch"
    wheelsets: Mapping[str, str] = dataclasses.field(default_factory=dict)  # name -> key
    project: str = ""                        # digest of the wheel's source files
    opa: str = ""                            # sha256 of the opa binary

    def as_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["wheelsets"] = dict(self.wheelsets)
        return d


_TAG_BAD = re.compile(r"[^A-Za-z0-9_.-]")


def image_tag(spec: ImageSpec, inputs: Inputs) -> str:
    """``<version>-<16 hex>``: the version for people, the digest of every input for machines."""
    digest = digest_of({"recipe": RECIPE_VERSION, "image": dataclasses.asdict(spec), "inputs": inputs.as_dict()})
    version = _TAG_BAD.sub("-", inputs.version).strip(".-") or "0"
    return f"{version[:100]}-{digest[:16]}"


def image_ref(spec: ImageSpec, inputs: Inputs) -> str:
    return f"{spec.repository}:{image_tag(spec, inputs)}"


def build_args(spec: ImageSpec, inputs: Inputs) -> dict[str, str]:
    """``--build-arg``s. The Containerfiles declare each one right before the step that uses it, so
    a changed revision re-runs only the label step and a changed wheel set only its layer onward."""
    args = {"VERSION": inputs.version, "REVISION": inputs.revision, "SOURCE": SOURCE_URL}
    if spec.base:
        args["BASE"] = inputs.base_ref
    for name, key in inputs.wheelsets.items():
        args[f"WHEELS_{name.upper()}"] = key
    if spec.project_wheel:
        args["PROJECT_DIGEST"] = inputs.project
    if spec.opa:
        args["OPA_SHA256"] = inputs.opa
    return args


def buildah_argv(spec: ImageSpec, inputs: Inputs, containerfile: str, context: str) -> list[str]:
    argv = ["buildah", "bud", "--isolation", "chroot", "--layers", "--pull=never", "--format", "oci",
            "-f", containerfile, "-t", image_ref(spec, inputs),
            "--label", f"io.sparsegate.image-inputs={digest_of(inputs.as_dict())}"]
    for key, value in sorted(build_args(spec, inputs).items()):
        argv += ["--build-arg", f"{key}={value}"]
    return argv + [context]


# -- pruning ----------------------------------------------------------------------------------------

KEEP_OLD_TAGS = 2  # per repository (per flavor for bases): other checkouts on this machine may use them


def stale_refs(existing: Mapping[str, float], prefix: str, current: str, keep: int = KEEP_OLD_TAGS) -> list[str]:
    """Of ``existing`` (ref → creation time), the refs starting with ``prefix`` other than
    ``current`` and older than the ``keep`` newest such: what a prune removes."""
    others = sorted((r for r in existing if r.startswith(prefix) and r != current), key=lambda r: -existing[r])
    return others[keep:]
