#!/usr/bin/env bash
# The whole test suite: set-up (cached), architecture lint, unit tests, Rego tests and the
# end-to-end tests against a real local control plane, OPA, helm and XDP.
# Extra arguments go to pytest (e.g. `dev/test.sh tests/unit -x`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bash "$here/setup.sh"
source "$here/env.sh"
cd "$SPARSEGATE_ROOT"
echo "[test] import layering (import-linter)"
lint-imports --no-cache
echo "[test] pytest"
exec python -m pytest "${@:-tests}"
