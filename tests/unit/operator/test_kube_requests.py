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


class _Answer:
    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.reason, self._body = status, "", body

    def read(self) -> bytes:
        return self._body


class _Transport:
    """Stands in for kubernetes.client.ApiClient's two calls Kube makes (no HTTP)."""

    def __init__(self, answer: _Answer) -> None:
        self.answer = answer

    def param_serialize(self, **kwargs):
        return (kwargs["method"], kwargs["resource_path"])

    def call_api(self, *params, _request_timeout=None):
        return self.answer


def test_each_request_is_counted_by_code_and_timed_by_verb_and_resource() -> None:
    from prometheus_client import REGISTRY

    from sparsegate.clients.kube import Kube

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    timed = {"verb": "get", "resource": "secrets"}
    count0 = sample("sparsegate_operator_kube_request_duration_seconds_count", **timed)
    missing0 = sample("sparsegate_operator_kube_requests_total", code="404", **timed)
    kube = Kube(_Transport(_Answer(404, b'{"message": "not found"}')))
    assert kube.get("Secret", namespace="ns", name="m-admin") is None
    kube._api = _Transport(_Answer(200, b'{"metadata": {"name": "m-admin"}}'))
    assert kube.get("Secret", namespace="ns", name="m-admin")["metadata"]["name"] == "m-admin"
    assert sample("sparsegate_operator_kube_request_duration_seconds_count", **timed) == count0 + 2
    assert sample("sparsegate_operator_kube_requests_total", code="404", **timed) == missing0 + 1
