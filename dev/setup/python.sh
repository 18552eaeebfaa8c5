#!/usr/bin/env bash
# Creates the per-machine virtualenv and installs the project with its extras.
# Idempotent: dependencies are reinstalled only when pyproject.toml's dependency
# lists change (stamp = hash of them); the project itself is re-linked (editable)
# every time because each clone lives in its own folder.
set -euo pipefail
source "$(dirname "$0")/../env.sh"
py="${PYTHON:-python3}"
# One set-up of the shared virtualenv at a time (a demo started while a test run sets up): two
# `pip install -e` at once fail on each other's files. The lock lives outside the venv (--clear).
# bpf.sh, which may create the venv too, takes the same lock.
mkdir -p "$SPARSEGATE_CACHE"
exec 8>"$SPARSEGATE_CACHE/.venv.lock"
flock 8
# No interpreter (first run, or a dangling bin/python after the base Python was rebuilt): start
# over (--clear also drops the dependency stamp, which lives inside). An interpreter without pip (a
# `python -m venv` killed during ensurepip): finish its ensurepip, keeping what is installed.
if ! "$SPARSEGATE_VENV/bin/python" -c '' 2>/dev/null; then
  echo "[setup] creating virtualenv $SPARSEGATE_VENV"
  "$py" -m venv --clear "$SPARSEGATE_VENV"
elif ! "$SPARSEGATE_VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "[setup] virtualenv $SPARSEGATE_VENV has no pip (interrupted creation): ensurepip"
  "$SPARSEGATE_VENV/bin/python" -m ensurepip --default-pip
fi
stamp="$SPARSEGATE_VENV/.deps-stamp"
want=$("$SPARSEGATE_VENV/bin/python" - "$SPARSEGATE_ROOT/pyproject.toml" <<'PY'
import hashlib, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(hashlib.sha256(repr((p["dependencies"], p["optional-dependencies"])).encode()).hexdigest())
PY
)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing Python dependencies (torch is large: first run only)"
  "$SPARSEGATE_VENV/bin/pip" install -q --upgrade pip setuptools wheel
  "$SPARSEGATE_VENV/bin/pip" install -q -e "$SPARSEGATE_ROOT[workload,dev]"
  echo "$want" > "$stamp"
fi
# Re-point the editable install at this clone (cheap, no dependency resolution).
"$SPARSEGATE_VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$SPARSEGATE_ROOT"
