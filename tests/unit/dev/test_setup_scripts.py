"""dev/setup/*.sh: what happens when two set-ups run at once (a demo started while a test run sets up).

The scripts run for real against a throwaway ``SPARSEGATE_CACHE``; only the virtualenv's ``pip`` is a
stand-in that records whether two of it ever ran at the same time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PYTHON_SH = ROOT / "dev" / "setup" / "python.sh"

# A pip that takes a while and notes an overlap with another pip run in the same venv: two real
# `pip install -e` at once fail ("No such file or directory: .../bin/kubectl-sparsegate").
FAKE_PIP = """#!/usr/bin/env bash
inflight="$(dirname "$0")/../pip-inflight"
if ! mkdir "$inflight" 2>/dev/null; then echo overlap >> "$(dirname "$0")/../pip-overlaps"; fi
sleep 0.5
echo "$*" >> "$(dirname "$0")/../pip-calls"
rmdir "$inflight" 2>/dev/null || true
"""


def _deps_stamp() -> str:
    p = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return hashlib.sha256(repr((p["dependencies"], p["optional-dependencies"])).encode()).hexdigest()


def _fake_venv(cache: Path) -> Path:
    venv = cache / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # has pip: `-m pip --version` passes
    pip = venv / "bin" / "pip"
    pip.write_text(FAKE_PIP)
    pip.chmod(0o755)
    (venv / ".deps-stamp").write_text(_deps_stamp() + "\n")  # dependencies up to date
    return venv


def test_two_python_setups_at_once_never_run_pip_together(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    venv = _fake_venv(cache)
    env = {**os.environ, "SPARSEGATE_CACHE": str(cache)}
    env.pop("SPARSEGATE_BIN", None)
    env.pop("SPARSEGATE_VENV", None)
    procs = [subprocess.Popen(["bash", str(PYTHON_SH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    calls = (venv / "pip-calls").read_text().splitlines()
    assert len(calls) == 3 and all("--no-deps" in c and "-e" in c for c in calls), calls
    assert not (venv / "pip-overlaps").exists(), "two `pip install -e` ran in the same virtualenv at once"


DEBIAN_SH = ROOT / "dev" / "setup" / "debian.sh"

# Stand-ins for root's id, dpkg-query, apt-cache and apt-get: "installed" packages are files under
# $FAKE_DPKG; apt-get install takes a while and notes an overlap with another apt-get, which the
# real one refuses ("Could not get lock /var/lib/dpkg/lock-frontend").
FAKE_TOOLS = {
    "id": '#!/usr/bin/env bash\necho 0\n',
    "dpkg-query": '#!/usr/bin/env bash\nfor p; do :; done\n'
                  '[ -e "$FAKE_DPKG/installed/$p" ] && printf "install ok installed"; exit 0\n',
    "apt-cache": '#!/usr/bin/env bash\nexit 0\n',
    "apt-get": """#!/usr/bin/env bash
[ "$1" = update ] && exit 0
if ! mkdir "$FAKE_DPKG/inflight" 2>/dev/null; then echo overlap >> "$FAKE_DPKG/overlaps"; exit 100; fi
sleep 0.5
for p; do case "$p" in -*|install) ;; *) touch "$FAKE_DPKG/installed/$p";; esac; done
echo "$*" >> "$FAKE_DPKG/installs"
rmdir "$FAKE_DPKG/inflight"
""",
}


def test_two_debian_installs_at_once_install_once_and_both_succeed(tmp_path: Path) -> None:
    fake_bin, dpkg = tmp_path / "bin", tmp_path / "dpkg"
    fake_bin.mkdir()
    (dpkg / "installed").mkdir(parents=True)
    for name, text in FAKE_TOOLS.items():
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_DPKG": str(dpkg),
           "SPARSEGATE_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen(["bash", str(DEBIAN_SH), "podman", "buildah"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert not (dpkg / "overlaps").exists(), f"apt-get ran twice at once: {outs}"
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len((dpkg / "installs").read_text().splitlines()) == 1


BINARIES_SH = ROOT / "dev" / "setup" / "binaries.sh"

# A `go` that "builds" by writing a small file where -o says.
FAKE_GO = """#!/usr/bin/env bash
if [ "$1" = env ]; then echo go1.26.0; exit 0; fi
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then printf '#!/bin/sh\\n' > "$2"; chmod +x "$2"; fi; shift; done
"""


def test_a_killed_build_s_partial_binary_is_removed_by_the_next_set_up(tmp_path: Path) -> None:
    fake_bin = tmp_path / "fakebin"
    fake_bin.mkdir()
    (fake_bin / "go").write_text(FAKE_GO)
    (fake_bin / "go").chmod(0o755)
    cache = tmp_path / "cache"
    bins = cache / "bin"
    bins.mkdir(parents=True)
    # What `go build -o opa.tmp.<pid>` killed half-way leaves (the real ones are ~100 MB each).
    (bins / "opa.tmp.4242").write_bytes(b"\x7fELF partial")
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "SPARSEGATE_CACHE": str(cache)}
    env.pop("SPARSEGATE_BIN", None)
    proc = subprocess.run(["bash", str(BINARIES_SH), "opa"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (bins / "opa").is_file()
    assert sorted(p.name for p in bins.iterdir() if not p.name.startswith(".")) == ["opa"]
