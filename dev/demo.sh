#!/usr/bin/env bash
# The demo (README): set-up, local control plane, chart, operator, examples, a visible rollout.
# `./dev/demo.sh down` stops everything it started.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${1:-up}" = "up" ]; then bash "$here/setup.sh"; fi
source "$here/env.sh"
export PYTHONPATH="$SPARSEGATE_ROOT/dev${PYTHONPATH:+:$PYTHONPATH}"
exec python "$here/demo.py" "$@"
