"""imagebuild's pure parts: content tags, base/wheel-set keys, the commands it would run, and how
it reads a checkout (files, digests, revision). No podman, buildah or network here."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

import pytest
from imagebuild import build, sources, spec, wheels
from imagebuild.errors import ImageBuildError

ROOT = Path(__file__).resolve().parents[3]
OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")

INPUTS = spec.Inputs(containerfile="c" * 64, version="0.1.0", revision="abc", base_ref="localhost/sparsegate-base:python-1",
                     wheelsets={"core": "k1"}, project="p" * 64)
OPERATOR = spec.IMAGES["operator"]


# -- tags ---------------------------------------------------------------------------------------

def test_tag_is_stable_and_a_valid_oci_tag() -> None:
    tag = spec.image_tag(OPERATOR, INPUTS)
    assert tag == spec.image_tag(OPERATOR, dataclasses.replace(INPUTS))
    assert OCI_TAG.match(tag) and tag.startswith("0.1.0-")
    assert spec.image_ref(OPERATOR, INPUTS) == f"localhost/sparsegate-operator:{tag}"


@pytest.mark.parametrize("change", [
    {"containerfile": "d" * 64}, {"version": "0.2.0"}, {"revision": "def"}, {"base_ref": "localhost/sparsegate-base:python-2"},
    {"wheelsets": {"core": "k2"}}, {"wheelsets": {"core": "k1", "workload": "w"}}, {"project": "q" * 64}, {"opa": "o"},
])
def test_tag_changes_with_every_input(change: dict) -> None:
    assert spec.image_tag(OPERATOR, dataclasses.replace(INPUTS, **change)) != spec.image_tag(OPERATOR, INPUTS)


def test_tag_differs_per_image_and_survives_odd_versions() -> None:
    assert spec.image_tag(spec.IMAGES["agent"], INPUTS) != spec.image_tag(OPERATOR, INPUTS)
    odd = spec.image_tag(OPERATOR, dataclasses.replace(INPUTS, version="1.0.0+local/build"))
    assert OCI_TAG.match(odd) and odd.startswith("1.0.0-local-build-")


def test_base_tag_follows_its_recipe_only() -> None:
    a = spec.BaseSpec("python", ("python3",))
    assert a.tag == spec.BaseSpec("python", ("python3",)).tag
    assert a.tag != spec.BaseSpec("python", ("python3", "curl")).tag
    assert a.tag != dataclasses.replace(a, suite="trixie").tag
    assert a.ref == f"localhost/sparsegate-base:{a.tag}" and a.tag.startswith("python-")
    bpf = spec.BASES["bpf"]
    assert {"python3-bpfcc", "bpfcc-tools", "iproute2", "python3", "python3-venv", "ca-certificates"} <= set(bpf.packages)
    assert "bcc" not in bpf.packages  # never PyPI's unrelated `bcc`


def test_wheel_sets_are_keyed_by_their_requirement_lists() -> None:
    pyproject = {"project": {"dependencies": ["kopf>=1.37"], "optional-dependencies": {"workload": ["torch>=2.9"], "dev": ["pytest"]}}}
    sets = spec.wheel_sets(pyproject)
    assert sets["core"].requirements == ("kopf>=1.37",) and sets["workload"].requirements == ("torch>=2.9",)
    dev_changed = {"project": {**pyproject["project"], "optional-dependencies": {"workload": ["torch>=2.9"], "dev": ["x"]}}}
    assert spec.wheel_sets(dev_changed) == sets  # the dev extra is in no image
    core_changed = {"project": {**pyproject["project"], "dependencies": ["kopf>=1.38"]}}
    assert spec.wheel_sets(core_changed)["core"].key != sets["core"].key
    assert spec.wheel_sets(core_changed)["workload"].key == sets["workload"].key
    assert sets["core"].dirname == f"core-{sets['core'].key}"


def test_project_pyproject_gives_both_wheel_sets() -> None:
    sets = spec.wheel_sets(sources.pyproject(ROOT))
    assert any(r.startswith("kopf") for r in sets["core"].requirements)
    assert any(r.startswith("torch") for r in sets["workload"].requirements)
    assert not any(r.startswith("torch") for r in sets["core"].requirements)


# -- commands -----------------------------------------------------------------------------------

def test_wheel_platforms_cover_bookworm_glibc() -> None:
    p = spec.wheel_platforms()
    assert p[0] == "manylinux_2_36_x86_64" and "manylinux_2_28_x86_64" in p and "manylinux2014_x86_64" in p
    assert "manylinux_2_37_x86_64" not in p


def test_pip_download_resolves_for_the_image_not_the_host() -> None:
    ws = spec.WheelSet("core", ("kopf",))
    argv = spec.pip_download_argv("/py", ws, "/d", "/d/requirements.txt")
    assert argv[:4] == ["/py", "-m", "pip", "download"]
    assert "--only-binary=:all:" in argv and argv[argv.index("--python-version") + 1] == "3.11"
    assert argv[argv.index("--abi") + 1] == "cp311" and argv.count("--platform") == len(spec.wheel_platforms())
    assert argv[-2:] == ["-r", "/d/requirements.txt"]


def test_mmdebstrap_gets_explicit_mirrors_and_minbase() -> None:
    base = spec.BASES["python"]
    argv = spec.mmdebstrap_argv(base, "/t.tar")
    assert argv[:3] == ["mmdebstrap", "--mode=root", "--variant=minbase"]
    assert "--include=python3,python3-venv,ca-certificates" in argv
    # Mirrors on the command line: without them mmdebstrap reads a sources.list from stdin.
    assert argv[-len(spec.DEBIAN_MIRRORS) - 2:] == ["bookworm", "/t.tar", *spec.DEBIAN_MIRRORS]
    assert spec.import_argv(base, "/t.tar")[-1] == base.ref


def test_buildah_argv_has_layers_the_ref_and_every_build_arg() -> None:
    argv = spec.buildah_argv(OPERATOR, INPUTS, "/repo/operator/Containerfile", "/ctx")
    assert argv[:2] == ["buildah", "bud"] and "--layers" in argv and argv[-1] == "/ctx"
    assert argv[argv.index("-t") + 1] == spec.image_ref(OPERATOR, INPUTS)
    args = dict(a.split("=", 1) for a in argv[1:] if "=" in a and argv[argv.index(a) - 1] == "--build-arg")
    assert args == spec.build_args(OPERATOR, INPUTS)
    assert args["PROJECT_DIGEST"] == INPUTS.project and args["WHEELS_CORE"] == "k1" and args["BASE"] == INPUTS.base_ref


def test_opa_build_args_have_no_base_or_wheels() -> None:
    inputs = spec.Inputs(containerfile="c", version="1.22.4", revision="r", opa="s" * 64)
    args = spec.build_args(spec.IMAGES["opa"], inputs)
    assert set(args) == {"VERSION", "REVISION", "SOURCE", "OPA_SHA256"}


def test_select_keeps_order_and_rejects_unknown_names() -> None:
    assert [s.name for s in spec.select(None)] == list(spec.IMAGE_NAMES) == ["operator", "model-server", "agent", "opa"]
    assert [s.name for s in spec.select(["opa", "operator", "opa"])] == ["opa", "operator"]
    with pytest.raises(ValueError, match="nope"):
        spec.select(["nope"])


# -- the Containerfiles agree with the build arguments, and layers go slowest-changing first -------

def _containerfile_lines(s: spec.ImageSpec) -> list[str]:
    text = (ROOT / s.containerfile).read_text().replace("\\\n", " ")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


@pytest.mark.parametrize("name", spec.IMAGE_NAMES)
def test_containerfile_declares_exactly_the_build_args(name: str) -> None:
    s = spec.IMAGES[name]
    inputs = spec.Inputs(containerfile="c", version="v", revision="r", base_ref="b",
                         wheelsets={w: "k" for w in s.wheels}, project="p", opa="o")
    declared = {ln.split()[1].split("=")[0] for ln in _containerfile_lines(s) if ln.startswith("ARG ")}
    assert declared == set(spec.build_args(s, inputs))


@pytest.mark.parametrize("name", spec.IMAGE_NAMES)
def test_labels_come_after_every_build_step(name: str) -> None:
    lines = _containerfile_lines(spec.IMAGES[name])
    first_label_arg = min(i for i, ln in enumerate(lines) if ln.startswith(("ARG VERSION", "ARG REVISION")))
    assert not [ln for ln in lines[first_label_arg:] if ln.startswith(("RUN", "COPY", "ADD"))], \
        "a RUN/COPY after the label ARGs would be redone for every new revision"
    labels = " ".join(ln for ln in lines if ln.startswith("LABEL"))
    for key in ("title", "version", "revision", "source", "licenses", "description"):
        assert f"org.opencontainers.image.{key}=" in labels


def test_model_server_installs_torch_before_the_project() -> None:
    runs = [ln for ln in _containerfile_lines(spec.IMAGES["model-server"]) if ln.startswith("RUN")]
    order = [next(k for k in ("wheels/workload", "wheels/core", "source=project", "venv") if k in ln) for ln in runs]
    assert order == ["venv", "wheels/workload", "wheels/core", "source=project"]


@pytest.mark.parametrize("name,user", [("operator", "65532:65532"), ("model-server", "65532:65532"), ("opa", "65532:65532"),
                                       ("agent", None)])
def test_image_users(name: str, user: str | None) -> None:
    users = [ln.split()[1] for ln in _containerfile_lines(spec.IMAGES[name]) if ln.startswith("USER ")]
    assert users == ([user] if user else [])


# -- reading a checkout ------------------------------------------------------------------------

def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}).stdout.strip()


def _tree(root: Path) -> None:
    """A miniature checkout: the three package dirs, pyproject, Containerfiles, a README, tests."""
    files = {
        "pyproject.toml": '[project]\nname = "sparsegate"\nversion = "0.1.0"\ndependencies = ["kopf"]\n'
                          '[project.optional-dependencies]\nworkload = ["torch"]\n',
        "README.md": "readme\n",
        "operator/sparsegate/__init__.py": "x = 1\n",
        "workloads/sparsegate_workload/__init__.py": "",
        "ebpf/sparsegate_ebpf/__init__.py": "",
        "ebpf/sparsegate_ebpf/xdp.bpf.c": "int x;\n",
        "policies/routing/src.rego": "package a\n",
        "tests/test_x.py": "",
        "dev/go/opa/go.mod": "module m\n\nrequire github.com/open-policy-agent/opa v1.22.4\n",
        ".gitignore": "__pycache__/\n*.egg-info/\n",
    }
    for s in spec.IMAGES.values():
        files[s.containerfile] = f"# {s.name}\n"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "operator/sparsegate/routing.rego").symlink_to("../../policies/routing/src.rego")
    (root / "operator/sparsegate/__pycache__").mkdir()
    (root / "operator/sparsegate/__pycache__/x.cpython-311.pyc").write_bytes(b"\0")


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> build.Checkout:
    _tree(tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "init")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "opa").write_bytes(b"opa-1")
    monkeypatch.setenv("SPARSEGATE_BIN", str(bindir))
    return build.Checkout(tmp_path)


def _refs(root: Path) -> dict[str, str]:
    return {p.spec.name: p.ref for p in build.plan(None, build.Checkout(root))}


def test_package_files_tracked_and_new_not_ignored(checkout: build.Checkout) -> None:
    root = checkout.root
    (root / "ebpf/sparsegate_ebpf/new.py").write_text("")
    (root / "operator/sparsegate.egg-info").mkdir()
    (root / "operator/sparsegate.egg-info/PKG-INFO").write_text("")
    files = sources.package_files(root, spec.PACKAGE_DIRS)
    assert "ebpf/sparsegate_ebpf/new.py" in files and "operator/sparsegate/routing.rego" in files
    assert not [f for f in files if "__pycache__" in f or "egg-info" in f]
    (root / "operator/sparsegate/__init__.py").unlink()  # deleted, still in the index
    assert "operator/sparsegate/__init__.py" not in sources.package_files(root, spec.PACKAGE_DIRS)


def test_package_files_without_git_walks_the_dirs(tmp_path: Path) -> None:
    _tree(tmp_path)
    files = sources.package_files(tmp_path, spec.PACKAGE_DIRS)
    assert "ebpf/sparsegate_ebpf/xdp.bpf.c" in files and not [f for f in files if f.endswith(".pyc")]


def test_unchanged_checkout_same_refs(checkout: build.Checkout) -> None:
    assert _refs(checkout.root) == _refs(checkout.root)


def test_source_change_changes_python_images_not_opa(checkout: build.Checkout) -> None:
    before = _refs(checkout.root)
    (checkout.root / "workloads/sparsegate_workload/__init__.py").write_text("# changed\n")
    after = _refs(checkout.root)
    assert [n for n in before if before[n] != after[n]] == ["operator", "model-server", "agent"]


def test_symlinked_rego_change_changes_python_images(checkout: build.Checkout) -> None:
    before = _refs(checkout.root)
    (checkout.root / "policies/routing/src.rego").write_text("package b\n")
    after = _refs(checkout.root)
    assert before["operator"] != after["operator"] and before["opa"] == after["opa"]


def test_readme_tests_and_unrelated_commits_change_nothing(checkout: build.Checkout) -> None:
    root = checkout.root
    before = _refs(root)
    (root / "README.md").write_text("another readme\n")
    (root / "tests/test_x.py").write_text("assert 1\n")
    _git(root, "commit", "-qam", "docs and tests")
    assert _refs(root) == before


def test_containerfile_change_changes_only_its_image(checkout: build.Checkout) -> None:
    before = _refs(checkout.root)
    (checkout.root / "ebpf/Containerfile").write_text("# agent, changed\n")
    after = _refs(checkout.root)
    assert [n for n in before if before[n] != after[n]] == ["agent"]


def test_opa_binary_change_changes_only_opa(checkout: build.Checkout) -> None:
    before = _refs(checkout.root)
    (checkout.root / "bin/opa").write_bytes(b"opa-2")
    after = _refs(checkout.root)
    assert [n for n in before if before[n] != after[n]] == ["opa"]
    assert after["opa"].startswith("localhost/sparsegate-opa:1.22.4-")


def test_dependency_change_changes_the_images_that_install_it(checkout: build.Checkout) -> None:
    before = _refs(checkout.root)
    pp = checkout.root / "pyproject.toml"
    pp.write_text(pp.read_text().replace('workload = ["torch"]', 'workload = ["torch>=2"]'))
    after = _refs(checkout.root)
    # pyproject.toml goes into the project wheel too: every Python image changes, OPA does not.
    assert [n for n in before if before[n] != after[n]] == ["operator", "model-server", "agent"]
    assert build.Checkout(checkout.root).wheelsets["core"] == checkout.wheelsets["core"]


def test_revision_is_the_last_commit_of_the_inputs_and_dirty_when_changed(checkout: build.Checkout) -> None:
    root = checkout.root
    first = _git(root, "rev-parse", "HEAD")
    (root / "tests/test_x.py").write_text("assert 2\n")
    _git(root, "commit", "-qam", "tests only")
    assert sources.revision(root, ["operator", "pyproject.toml"]) == first
    (root / "operator/sparsegate/__init__.py").write_text("x = 2\n")
    assert sources.revision(root, ["operator"]) == f"{first}-dirty"
    _git(root, "commit", "-qam", "code")
    assert sources.revision(root, ["operator"]) == _git(root, "rev-parse", "HEAD")


def test_outside_git_revision_is_unknown(tmp_path: Path) -> None:
    _tree(tmp_path)
    assert sources.revision(tmp_path, ["operator"]) == "unknown"


def test_files_digest_reads_through_symlinks_and_rejects_broken_ones(tmp_path: Path) -> None:
    _tree(tmp_path)
    rels = ["operator/sparsegate/routing.rego"]
    d1 = sources.files_digest(tmp_path, rels)
    (tmp_path / "policies/routing/src.rego").write_text("package c\n")
    assert sources.files_digest(tmp_path, rels) != d1
    (tmp_path / "policies/routing/src.rego").unlink()
    with pytest.raises(ImageBuildError, match="broken symlink"):
        sources.files_digest(tmp_path, rels)


def test_missing_opa_binary_names_the_setup_command(checkout: build.Checkout) -> None:
    (checkout.root / "bin/opa").unlink()
    with pytest.raises(ImageBuildError, match="binaries.sh opa"):
        build.plan(["opa"], build.Checkout(checkout.root))
    assert [p.spec.name for p in build.plan(["operator"], build.Checkout(checkout.root))] == ["operator"]


def test_go_module_version() -> None:
    assert sources.go_module_version(ROOT / "dev/go/opa/go.mod", "github.com/open-policy-agent/opa").count(".") == 2


def test_stale_refs_keep_the_current_and_the_newest_others() -> None:
    existing = {"r:cur": 1.0, "r:a": 5.0, "r:b": 4.0, "r:c": 3.0, "r:d": 2.0, "other:x": 0.0}
    assert spec.stale_refs(existing, "r:", "r:cur", keep=2) == ["r:c", "r:d"]
    assert spec.stale_refs(existing, "r:", "r:cur", keep=10) == []
    bases = {"b:python-1": 1.0, "b:python-2": 2.0, "b:bpf-1": 0.0}
    assert spec.stale_refs(bases, "b:python-", "b:python-2", keep=0) == ["b:python-1"]


def test_prune_dirs_keeps_current_newest_and_incomplete(tmp_path: Path) -> None:
    for i, name in enumerate(["core-a", "core-b", "core-c", "core-d", "workload-x"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / wheels.KEY_FILE).write_text(name)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    (tmp_path / "core-partial").mkdir()  # no KEY: being written by someone, never removed
    wheels.prune_dirs(tmp_path, "core-*", tmp_path / "core-a", keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["core-a", "core-d", "core-partial", "workload-x"]


def test_a_transient_runc_failure_is_built_again_and_a_real_failure_is_not(
        checkout: build.Checkout, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (planned,) = [p for p in build.plan(["operator"], checkout)]
    monkeypatch.setattr(build.tools, "require", lambda *names: None)
    monkeypatch.setattr(build.bases, "ensure_base", lambda *a, **k: None)
    monkeypatch.setattr(build, "_stage_context", lambda p, co, cache: tmp_path / "ctx")
    outcomes: list[str] = []

    def fake_run(argv, *, what, **kw):
        outcome = outcomes.pop(0)
        if outcome != "ok":
            raise build.ImageBuildError(f"{what} failed (1): {outcome}")

    monkeypatch.setattr(build.tools, "run", fake_run)
    outcomes[:] = ["Error: Close_Fd sealing memfd copy: Device or resource busy", "ok"]
    build._build(planned, checkout, tmp_path)
    assert outcomes == []  # built again, once
    outcomes[:] = ["STEP 7/16: pip check: sparsegate 0.1.0 requires torch", "ok"]
    with pytest.raises(build.ImageBuildError, match="pip check"):
        build._build(planned, checkout, tmp_path)
    assert outcomes == ["ok"]  # a step's own failure is not retried
    outcomes[:] = ["sealing memfd"] * build.TRANSIENT_ATTEMPTS
    with pytest.raises(build.ImageBuildError, match="sealing memfd"):
        build._build(planned, checkout, tmp_path)
    assert outcomes == []


def test_a_build_removes_what_killed_builds_left_and_keeps_the_complete_cache(
        checkout: build.Checkout, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A build killed by SIGTERM or SIGKILL (a cancelled CI job) never runs its ``finally``: its
    build context, its half-downloaded wheel set (a dot-named temporary directory, up to the whole
    3 GB workload set), its half-built project wheel and its mmdebstrap tarball stay. The next build,
    holding the cache's lock, removes them; complete wheel sets and project wheels stay."""
    cache = tmp_path / "cache" / "images"
    left = [cache / "ctx" / "operator-4242", cache / "wheels" / ".workload-0123456789abcdef.k2j3h4",
            cache / "project" / ".0123456789abcdef.x8y9z0"]
    for d in left:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "torch.whl").write_bytes(b"partial")
    tarball = cache / "bases" / "python-0123456789abcdef.4242.tar"
    tarball.parent.mkdir()
    tarball.write_bytes(b"partial")
    complete = [cache / "wheels" / "core-0123456789abcdef", cache / "project" / ("ab" * 16)]
    for d in complete:
        d.mkdir(parents=True)
        (d / wheels.KEY_FILE).write_text("k")
    monkeypatch.setenv("SPARSEGATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build.tools, "require", lambda *names: None)
    monkeypatch.setattr(build.tools, "image_exists", lambda ref: False)
    monkeypatch.setattr(build, "Checkout", lambda: checkout)
    built: list[str] = []
    monkeypatch.setattr(build, "_build", lambda p, co, cache_: built.append(p.spec.name))
    monkeypatch.setattr(build, "_prune", lambda prefix, current: None)
    build.ensure_images(["opa"])
    assert built == ["opa"]
    assert [p for p in [*left, tarball] if p.exists()] == []
    assert all((d / wheels.KEY_FILE).is_file() for d in complete)
