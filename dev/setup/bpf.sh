#!/usr/bin/env bash
# BCC for the eBPF agent and its tests (run by dev/setup.sh; installing packages needs root).
# Idempotent: installs Debian's BCC and kernel headers once, then makes only the `bcc`
# package importable from the project virtualenv (never PyPI's unrelated `bcc`, and never
# all of Debian's dist-packages, whose versions would shadow the venv's), and points BCC at
# the installed headers when the running kernel has none of its own.
set -euo pipefail
source "$(dirname "$0")/../env.sh"

bash "$(dirname "$0")/debian.sh" python3-bpfcc bpfcc-tools linux-headers-amd64

# Debian's python3-bpfcc is pure Python over libbcc.so.0 (ctypes), so it works from any
# CPython 3; link just that package into the venv (created by python.sh, which may run later).
bcc_src=/usr/lib/python3/dist-packages/bcc
if [ ! -d "$bcc_src" ]; then
  echo "[bpf] $bcc_src missing after install" >&2
  exit 1
fi
# The virtualenv is shared with concurrent set-ups: python.sh's lock.
mkdir -p "$SPARSEGATE_CACHE"
exec 8>"$SPARSEGATE_CACHE/.venv.lock"
flock 8
# setup.sh may run this before python.sh: create the venv the way python.sh does (it then
# sees the venv exists and only installs dependencies), repairing it the same way too.
if ! "$SPARSEGATE_VENV/bin/python" -c '' 2>/dev/null; then
  echo "[bpf] creating virtualenv $SPARSEGATE_VENV"
  "${PYTHON:-python3}" -m venv --clear "$SPARSEGATE_VENV"
elif ! "$SPARSEGATE_VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "[bpf] virtualenv $SPARSEGATE_VENV has no pip (interrupted creation): ensurepip"
  "$SPARSEGATE_VENV/bin/python" -m ensurepip --default-pip
fi
if [ -x "$SPARSEGATE_VENV/bin/python" ]; then
  site=$("$SPARSEGATE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ "$(readlink "$site/bcc" 2>/dev/null)" != "$bcc_src" ]; then
    rm -rf "$site/bcc"
    ln -s "$bcc_src" "$site/bcc"
    echo "[bpf] linked $site/bcc -> $bcc_src"
  fi
else
  echo "[bpf] venv not created yet: run dev/setup.sh again to link bcc into it"
fi

# BCC compiles against /lib/modules/$(uname -r)/build. These VMs boot a kernel with no
# module tree; Debian's generic headers compile XDP programs fine (uapi + helpers only).
kdir="/lib/modules/$(uname -r)"
if [ ! -e "$kdir/build" ]; then
  hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1)
  if [ -z "$hdr" ]; then
    echo "[bpf] no /usr/src/linux-headers-*-amd64 found" >&2
    exit 1
  fi
  mkdir -p "$kdir"
  ln -sfn "$hdr" "$kdir/build"
  echo "[bpf] linked $kdir/build -> $hdr"
fi
# Debian splits arch-specific (build) from common (source) headers; BCC reads both links.
if [ ! -e "$kdir/source" ] && [ -L "$kdir/build" ]; then
  common="$(readlink -f "$kdir/build")"
  common="${common%-amd64}-common"
  if [ -d "$common" ]; then
    ln -sfn "$common" "$kdir/source"
    echo "[bpf] linked $kdir/source -> $common"
  fi
fi
# bpffs for anyone who pins maps; harmless when already mounted.
if ! mountpoint -q /sys/fs/bpf 2>/dev/null; then
  mount -t bpf bpf /sys/fs/bpf 2>/dev/null || true
fi
echo "[bpf] ok"
