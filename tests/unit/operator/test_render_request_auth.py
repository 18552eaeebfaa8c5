"""SparseModel spec.access rendered into the model server: Enforce runs it with
``--request-auth in-cluster`` as the ServiceAccount the chart binds to ``create tokenreviews``;
Off (the default) runs it as the namespace's default ServiceAccount. The server's own parser accepts the rendered flags."""

from __future__ import annotations

from pathlib import Path

import yaml

from sparsegate.domain import render
from sparsegate_contracts import names
from sparsegate_workload import gateparams
from sparsegate_workload.server import build_parser

ROOT = Path(__file__).resolve().parents[3]
DOC = gateparams.make_document(gateparams.DEFAULT_PARAMS)


def _model(**spec):
    body = yaml.safe_load((ROOT / "examples" / "sparsemodel.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="0b7c1f6e-1111-2222-3333-444455556666", generation=1)
    body["spec"].update(spec)
    return body


def _pod(model) -> dict:
    return render.render_deployment(model, DOC)["spec"]["template"]["spec"]


def test_enforce_renders_in_cluster_auth_and_the_tokenreview_service_account():
    pod = _pod(_model(access={"requestAuth": "Enforce", "tokenCacheSeconds": 5}))
    (container,) = pod["containers"]
    parsed = build_parser().parse_args(container["args"][1:])  # past --host=$(POD_IP), which needs expansion
    assert parsed.request_auth == "in-cluster" and parsed.token_cache_ttl == 5.0
    assert pod["serviceAccountName"] == names.MODEL_SERVICE_ACCOUNT == "sparsegate-model-server"
    assert pod["automountServiceAccountToken"] is True


def test_enforce_without_ttl_keeps_the_server_default():
    args = _pod(_model(access={"requestAuth": "Enforce"}))["containers"][0]["args"]
    assert args[args.index("--request-auth") + 1] == "in-cluster"
    assert "--token-cache-ttl" not in args
    assert build_parser().parse_args(args[1:]).token_cache_ttl == 30.0


def test_off_or_absent_leaves_the_pod_unchanged():
    plain = _pod(_model())
    for access in ({"requestAuth": "Off"}, {}):
        pod = _pod(_model(access=access))
        assert pod == plain
        assert "--request-auth" not in pod["containers"][0]["args"]
        assert "automountServiceAccountToken" not in pod


def test_off_clears_both_service_account_fields_so_leaving_enforce_takes_effect():
    # The API server mirrors serviceAccountName into the deprecated serviceAccount, which no
    # apply owns: omitting the fields after Enforce left the pods on sparsegate-model-server
    # (tests/e2e/operator/test_sparsemodel_render_apply.py shows it on a real API server).
    # Both explicitly empty: the namespace's default ServiceAccount.
    for access in ({"requestAuth": "Off"}, {}):
        pod = _pod(_model(access=access))
        assert pod["serviceAccountName"] == "" and pod["serviceAccount"] == ""
