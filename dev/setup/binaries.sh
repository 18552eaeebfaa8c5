#!/usr/bin/env bash
# Builds the Go binaries the project runs for real (control plane, kwok, opa, helm, prometheus) from the
# small pinned modules under dev/go/<group>/ into $SPARSEGATE_BIN.
#
# Usage: dev/setup/binaries.sh [name...]   (default: all, opa and helm first)
#
# Idempotent: each binary has a stamp (sha256 of its module's go.mod/go.sum, package, flags and
# the Go version); a binary is rebuilt only when that changes. GOCACHE/GOMODCACHE stay at Go's
# defaults so the build cache persists per machine.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/env.sh"

GO_DIR="$SPARSEGATE_ROOT/dev/go"
STAMPS="$SPARSEGATE_BIN/.stamps"
mkdir -p "$SPARSEGATE_BIN" "$STAMPS"
# Several test runs may call this at once: one builds, the others wait and then find it done.
exec 9>"$SPARSEGATE_BIN/.lock"
flock 9
# Holding the lock, no build runs: a <name>.tmp.<pid> here is what a killed one left (~100 MB each).
rm -f "$SPARSEGATE_BIN"/*.tmp.*

command -v go >/dev/null || { echo "binaries.sh: 'go' not found on PATH (need Go >= 1.26)" >&2; exit 1; }

K8S_VERSION=v1.37.2
K8S_MAJOR=1
K8S_MINOR=37
# kube binaries report this version (helm's kubeVersion checks and `kubectl version` read it).
k8s_ldflags() {
  local f=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    f+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$K8S_MAJOR -X $pkg.gitMinor=$K8S_MINOR"
    f+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  echo "$f"
}

HELM_LDFLAGS="-X helm.sh/helm/v3/internal/version.version=v3.21.4 -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
# helm's default Capabilities.KubeVersion (used by `helm template`/lint) follows its k8s modules.
for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  HELM_LDFLAGS+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=36"
done

# name | module dir | package | extra ldflags
TOOLS=(
  "opa|opa|github.com/open-policy-agent/opa|"
  "helm|helm|helm.sh/helm/v3/cmd/helm|$HELM_LDFLAGS"
  "etcd|etcd|go.etcd.io/etcd/server/v3|"
  "kwok|kwok|sigs.k8s.io/kwok/cmd/kwok|-X sigs.k8s.io/kwok/pkg/consts.Version=0.8.0 -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${K8S_VERSION#v}"
  "kube-apiserver|kubernetes|k8s.io/kubernetes/cmd/kube-apiserver|$(k8s_ldflags)"
  "kube-controller-manager|kubernetes|k8s.io/kubernetes/cmd/kube-controller-manager|$(k8s_ldflags)"
  "kube-scheduler|kubernetes|k8s.io/kubernetes/cmd/kube-scheduler|$(k8s_ldflags)"
  "kubectl|kubernetes|k8s.io/kubernetes/cmd/kubectl|$(k8s_ldflags)"
  # Go module v0.316.0 is Prometheus 3.16.0; no builtinassets tag (the HTTP API is all tests use).
  "prometheus|prometheus|github.com/prometheus/prometheus/cmd/prometheus|-X github.com/prometheus/common/version.Version=3.16.0"
)

GO_VERSION="$(go env GOVERSION)"

build_one() {
  local name=$1 dir=$2 pkg=$3 extra=$4
  local mod="$GO_DIR/$dir" out="$SPARSEGATE_BIN/$name"
  local ldflags="-s -w $extra"
  local stamp
  stamp="$(cat "$mod/go.mod" "$mod/go.sum" | sha256sum | cut -d' ' -f1)-$(printf '%s\n' "$pkg" "$ldflags" "$GO_VERSION" | sha256sum | cut -d' ' -f1)"
  if [[ -x "$out" && -f "$STAMPS/$name" && "$(cat "$STAMPS/$name")" == "$stamp" ]]; then
    echo "binaries.sh: $name up to date"
    return 0
  fi
  echo "binaries.sh: building $name ($pkg) ..."
  local start=$SECONDS
  # -mod=readonly: the committed go.sum is the whole truth; CGO off like upstream release builds.
  if ! (cd "$mod" && CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "$ldflags" -o "$out.tmp.$$" "$pkg"); then
    rm -f "$out.tmp.$$"
    echo "binaries.sh: FAILED to build $name from $pkg (module dev/go/$dir)" >&2
    return 1
  fi
  mv -f "$out.tmp.$$" "$out"
  echo "$stamp" > "$STAMPS/$name"
  echo "binaries.sh: built $name in $((SECONDS - start))s"
}

wanted=("$@")
failed=()
for entry in "${TOOLS[@]}"; do
  IFS='|' read -r name dir pkg extra <<<"$entry"
  if ((${#wanted[@]})) && [[ ! " ${wanted[*]} " == *" $name "* ]]; then
    continue
  fi
  build_one "$name" "$dir" "$pkg" "$extra" || failed+=("$name")
done

if ((${#failed[@]})); then
  echo "binaries.sh: failed: ${failed[*]}" >&2
  exit 1
fi
