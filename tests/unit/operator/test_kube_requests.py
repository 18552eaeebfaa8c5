"""The operator's API request counter: verb and resource of each path the client sends."""

from __future__ import annotations

import pytest

from sparsegate.clients.kube import path_for, verb_and_resource


@pytest.mark.parametrize(("method", "path", "expected"), [
    ("GET", path_for("Pod", namespace="ns"), ("list", "pods")),
    ("GET", path_for("Deployment", namespace="ns", name="m"), ("get", "deployments")),
    ("PATCH", path_for("GateConfig", namespace="ns", name="g", subresource="status"), ("patch", "gateconfigs/status")),
    ("POST", path_for("Secret", namespace="ns"), ("create", "secrets")),
    ("PUT", path_for("Secret", namespace="ns", name="m-admin"), ("update", "secrets")),
    ("GET", "/api/v1/nodes", ("list", "nodes")),
    ("GET", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/op?watch=1", ("get", "leases")),
])
def test_each_path_is_named_by_verb_and_resource(method: str, path: str, expected: tuple[str, str]) -> None:
    assert verb_and_resource(method, path) == expected
