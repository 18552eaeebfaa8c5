#!/usr/bin/env bash
# The project's container images (operator, model server, node agent, OPA), built with buildah from
# Debian's packages and cached per machine by content digest (dev/imagebuild): a warm machine with
# an unchanged checkout builds nothing. Runs after binaries.sh (the OPA image holds its `opa`) and
# python.sh (imagebuild runs on the venv's python and builds the project wheel with its pip).
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/env.sh"

# podman + buildah (runc: crun refuses these machines' hybrid cgroups), mmdebstrap for the Debian
# bases (no registry is reachable), uidmap for podman's user namespaces.
bash "$SPARSEGATE_ROOT/dev/setup/debian.sh" podman buildah runc mmdebstrap uidmap

PYTHONPATH="$SPARSEGATE_ROOT/dev" "$SPARSEGATE_VENV/bin/python" -m imagebuild build
