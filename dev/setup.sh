#!/usr/bin/env bash
# One-time (then cached) set-up of everything the demo and the tests need on this machine:
# Debian packages (openssl, iproute2, BCC, kernel headers), the Python virtualenv, and the Go-built
# binaries (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, opa, helm,
# prometheus),
# and the container images (operator, model server, node agent, OPA; podman/buildah, dev/imagebuild).
# Safe to run again: the Go binaries and images are stamped and skipped when up to date; the apt and
# BCC steps check what is installed; the virtualenv re-runs its (quick) editable install.
set -euo pipefail
# One function, called on the last line: bash reads a script as it runs, so an edit to this file
# during a long first run (the Go builds) must not change what the running copy executes.
main() {
  here="$(cd "$(dirname "$0")" && pwd)"
  source "$here/env.sh"
  mkdir -p "$SPARSEGATE_CACHE" "$SPARSEGATE_BIN"
  step() { local name=$1 t0=$SECONDS; shift; echo "[setup] $name"; "$@"; echo "[setup] $name done in $((SECONDS - t0))s"; }
  # openssl: the local control plane's certificates; iproute2: network namespaces in the eBPF tests;
  # busybox-static: the tiny image the container pod runner's tests run.
  step debian bash "$here/setup/debian.sh" openssl iproute2 ca-certificates busybox-static
  step bpf bash "$here/setup/bpf.sh"
  step python bash "$here/setup/python.sh"
  step binaries bash "$here/setup/binaries.sh"
  # After binaries: the OPA image holds the built `opa`.
  step images bash "$here/setup/images.sh"
}
main "$@"
