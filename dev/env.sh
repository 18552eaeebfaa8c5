# Sourced by every dev script: one place for where things live.
# Binaries, the virtualenv and control-plane state are per machine, not per clone,
# so a fresh clone (CI) reuses what an earlier run built.
export SPARSEGATE_ROOT="${SPARSEGATE_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
export SPARSEGATE_CACHE="${SPARSEGATE_CACHE:-$HOME/.cache/sparsegate}"
export SPARSEGATE_BIN="$SPARSEGATE_CACHE/bin"
export SPARSEGATE_VENV="$SPARSEGATE_CACHE/venv"
export SPARSEGATE_STATE="${SPARSEGATE_STATE:-$SPARSEGATE_CACHE/cluster}"
export KUBECONFIG="${KUBECONFIG_OVERRIDE:-$SPARSEGATE_STATE/kubeconfig}"
export PATH="$SPARSEGATE_VENV/bin:$SPARSEGATE_BIN:$PATH"
export GOFLAGS="${GOFLAGS:--mod=mod}"
# podman/buildah read their settings from the project's own file (runc, no default ulimits).
export CONTAINERS_CONF="${CONTAINERS_CONF:-$SPARSEGATE_ROOT/dev/containers/containers.conf}"
