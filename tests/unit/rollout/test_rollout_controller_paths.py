"""The rollout controller builds every API path with ``clients.kube.path_for`` (issue 13 item 5)."""

from __future__ import annotations

import inspect
import re

from sparsegate.clients.kube import path_for
from sparsegate.controllers import rollout as controller


def test_the_kinds_the_controller_lists_and_patches() -> None:
    assert path_for("Pod", namespace="ns") == "/api/v1/namespaces/ns/pods"
    assert path_for("ReplicaSet", namespace="ns") == "/apis/apps/v1/namespaces/ns/replicasets"
    assert path_for("GateConfig", namespace="ns", name="g", subresource="status") \
        == "/apis/sparsegate.dev/v1alpha1/namespaces/ns/gateconfigs/g/status"
    assert path_for("GateConfig", namespace="a b", name="g") \
        == "/apis/sparsegate.dev/v1alpha1/namespaces/a%20b/gateconfigs/g"


def test_no_hand_built_api_path_in_the_controller() -> None:
    source = inspect.getsource(controller)
    assert not re.search(r"[\"']/apis?/", source), "build API paths with clients.kube.path_for"
    assert "path_for(" in source
