"""imagebuild.trained's pure parts: the trained-model image's tag and Containerfile (no buildah here)."""

from __future__ import annotations

import re
from pathlib import Path

from imagebuild import trained

OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
BASE = "localhost/sparsegate-model-server:0.1.0-0123456789abcdef"


def test_tag_is_a_valid_oci_tag_and_follows_both_inputs() -> None:
    ref = trained.trained_ref(BASE, Path("/cache/trained/7c91f28063e65381"))
    repo, _, tag = ref.rpartition(":")
    assert repo == trained.REPOSITORY and OCI_TAG.match(tag), ref
    assert ref == trained.trained_ref(BASE, Path("/elsewhere/7c91f28063e65381"))  # the key, not the path
    assert ref != trained.trained_ref(BASE, Path("/cache/trained/0000000000000000"))
    assert ref != trained.trained_ref(BASE.replace("0123", "9999"), Path("/cache/trained/7c91f28063e65381"))


def test_containerfile_copies_the_checkpoint_where_the_model_source_points() -> None:
    assert trained.containerfile(BASE).splitlines() == [f"FROM {BASE}", f"COPY checkpoint {trained.CHECKPOINT_DIR}"]
