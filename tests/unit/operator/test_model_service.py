"""The model's Service: ClusterIP by default, headless with spec.service.headless (pure render;
tests/e2e/operator/test_sparsemodel_lifecycle.py checks the API server's side: the address, the
schema default, and that the field cannot change)."""

from __future__ import annotations

from sparsegate.domain import render


def model(**spec: object) -> dict:
    return {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel",
            "metadata": {"name": "moe", "namespace": "ml", "uid": "u-1"},
            "spec": {"model": {"dModel": 64, "experts": 8}, **spec}}


def test_default_service_asks_the_api_server_for_an_address() -> None:
    for spec in ({}, {"service": {}}, {"service": {"headless": False}}):
        svc = render.render_service(model(**spec))
        assert svc["spec"]["type"] == "ClusterIP" and "clusterIP" not in svc["spec"]


def test_headless_service_asks_for_none() -> None:
    plain = render.render_service(model())
    svc = render.render_service(model(service={"headless": True}))
    assert svc["spec"]["clusterIP"] == render.HEADLESS == "None"
    # Everything else is the same Service: selector, port, owner, labels.
    del svc["spec"]["clusterIP"]
    assert svc == plain

