"""Container images of sparsegate, built locally with buildah and cached per machine.

Four images, each from the ``Containerfile`` beside its component:

=============  ==============================  =====================================================
name           repository                      what
=============  ==============================  =====================================================
operator       localhost/sparsegate-operator      ``sparsegate run`` (project wheel, no torch)
model-server   localhost/sparsegate-model-server  ``python -m sparsegate_workload.server`` (torch)
agent          localhost/sparsegate-agent         ``python -m sparsegate_ebpf.agent`` (Debian's BCC)
opa            localhost/sparsegate-opa           the static ``opa`` from ``$SPARSEGATE_BIN``
=============  ==============================  =====================================================

No registry is reachable: bases come from Debian's packages (mmdebstrap → podman import), Python
wheels are resolved on the host and installed offline. Tags are content digests of every input, so
an unchanged checkout on a warm machine builds nothing. Use::

    PYTHONPATH=dev python -m imagebuild build [NAME...]   # build what is missing, print timings
    PYTHONPATH=dev python -m imagebuild refs [NAME...]    # name=ref lines, builds nothing

or ``imagebuild.ensure_images(["operator", ...]) -> {"operator": "localhost/...:<tag>", ...}``.
"""

from imagebuild.build import ensure_images, refs
from imagebuild.errors import ImageBuildError
from imagebuild.spec import IMAGE_NAMES

__all__ = ["IMAGE_NAMES", "ImageBuildError", "ensure_images", "refs"]
