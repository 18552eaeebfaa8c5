#!/usr/bin/env bash
# Installs the Debian packages given as arguments that are not installed yet (root).
# Idempotent; refreshes the package lists only when they are missing or an install fails
# (stale lists name versions the mirror no longer serves).
set -euo pipefail
missing=()
check() {
  missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
}
check "$@"
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "[debian] need root to install ${missing[*]}" >&2
  exit 1
fi
# Two set-ups at once on a new machine (demo and tests): apt-get refuses to run beside another
# (dpkg's lock). One installs, the other waits here and then finds the packages installed.
cache="${SPARSEGATE_CACHE:-$HOME/.cache/sparsegate}"
mkdir -p "$cache"
exec 7>"$cache/.apt.lock"
flock 7
check "$@"
[ "${#missing[@]}" -eq 0 ] && exit 0
echo "[debian] apt-get install ${missing[*]}"
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; }
if ! apt-cache show "${missing[0]}" >/dev/null 2>&1; then apt-get update -q; fi
install || { apt-get update -q && install; }
