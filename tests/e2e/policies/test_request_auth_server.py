"""Per-request access on the real local control plane: callers' ServiceAccount tokens (TokenRequest API,
audience sparsegate) verified by the model server with a real TokenReview, the access rules compiled by
the operator's module from RoutingPolicy specs, and the built-in model activating only the allowed group.

Given a model server whose ServiceAccount may create tokenreviews, expert groups a=[0,1] and b=[2,3],
and RoutingPolicies "caller-a may use group a" and "caller-b is denied":
- before the rules arrive every POST is refused (503); without a token 401; a token for another
  audience 401;
- caller-a naming group a: 200, and the response's per-request expert counts touch only experts 0 and 1;
- caller-a naming group b, or no group: 403 naming the reason; caller-b: 403 naming the Deny rule;
- a TokenReview that cannot be made: 503, never served.
"""

from __future__ import annotations

import json
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer
from localcluster.ports import free_port

from sparsegate.domain.policy import rules_from_spec
from sparsegate.domain.request_access import access_document
from sparsegate_contracts.request_access import EXPERT_GROUP_HEADER
from sparsegate_workload.admin import StaticToken
from sparsegate_workload.caller_auth import CachedReviewer, KubeTokenReview
from sparsegate_workload.model import ModelConfig
from sparsegate_workload.server import STATE, create_admin_app, create_app, wait_ready

ADMIN = "admin-token"
GROUPS = {"a": (0, 1), "b": (2, 3)}
TOKENS = {"tokens": [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]}


def _rbac(cluster, ns: str) -> str:
    """The model's ServiceAccount with the one verb it needs: create tokenreviews (cluster-scoped)."""
    name = f"e2e-tokenreview-{ns}"
    cluster.kubectl("create", "serviceaccount", "model-server", "-n", ns)
    cluster.kubectl("create", "clusterrole", name, "--verb=create", "--resource=tokenreviews.authentication.k8s.io")
    cluster.kubectl("create", "clusterrolebinding", name, f"--clusterrole={name}",
                    f"--serviceaccount={ns}:model-server")
    return name


def _token(cluster, ns: str, sa: str, *audience: str) -> str:
    args = ["create", "token", sa, "-n", ns, "--duration=10m"] + [f"--audience={a}" for a in audience]
    return cluster.kubectl(*args).stdout.strip()


def _policies(ns: str) -> list:
    allow_a = {"action": "Allow", "sources": [{"serviceAccount": "caller-a"}],
               "targets": [{"sparseModel": "moe", "expertGroups": ["a"]}]}
    deny_b = {"action": "Deny", "priority": 5, "sources": [{"serviceAccount": "caller-b"}],
              "targets": [{"sparseModel": "moe"}]}
    allow_b = {"action": "Allow", "sources": [{"serviceAccount": "caller-b"}], "targets": [{"sparseModel": "moe"}]}
    rules = []
    for name, spec in (("allow-a", allow_a), ("deny-b", deny_b), ("allow-b", allow_b)):
        rules += rules_from_spec(namespace=ns, name=name, spec=spec)
    return rules


async def _post(client: TestClient, token: str | None = None, group: str | None = None):
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if group is not None:
        headers[EXPERT_GROUP_HEADER] = group
    resp = await client.post("/v1/infer", json=TOKENS, headers=headers)
    return resp.status, await resp.json()


async def test_two_callers_one_scoped_to_a_group_one_denied(cluster, namespace, tmp_path: Path) -> None:
    ns = namespace
    role = _rbac(cluster, ns)
    try:
        for sa in ("caller-a", "caller-b"):
            cluster.kubectl("create", "serviceaccount", sa, "-n", ns)
        own = tmp_path / "token"
        own.write_text(_token(cluster, ns, "model-server"))  # the API server's own audience
        reviewer = CachedReviewer(KubeTokenReview(url=cluster.server, token_file=str(own),
                                                  ca_file=str(cluster.layout.cert("ca"))))
        app = create_app(model_config=ModelConfig(), expert_groups=GROUPS, reviewer=reviewer)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client, \
                TestClient(TestServer(create_admin_app(app, auth=StaticToken(ADMIN)), host="127.0.0.1")) as admin:
            await wait_ready(app)
            token_a = _token(cluster, ns, "caller-a", "sparsegate")
            token_b = _token(cluster, ns, "caller-b", "sparsegate")

            # Rules not received yet: refused, whoever calls.
            status, body = await _post(client, token_a, "a")
            assert status == 503 and "no access rules" in body["error"], body
            assert (await client.get("/healthz")).status == 200  # probes are not guarded

            doc = access_document(_policies(ns), namespace=ns, model="moe", serving_port=8080,
                                  trust_domain="cluster.local")
            resp = await admin.put("/admin/access", json=doc, headers={"Authorization": f"Bearer {ADMIN}"})
            assert resp.status == 200 and (await resp.json())["enforced"] is True
            bad = await admin.put("/admin/access", json={**doc, "rules": [{"id": "x"}]},
                                  headers={"Authorization": f"Bearer {ADMIN}"})
            assert bad.status == 422 and "rules[0].action" in (await bad.json())["error"]
            assert (await admin.put("/admin/access", json=doc)).status == 401

            status, body = await _post(client)
            assert status == 401 and "missing Bearer token" in body["error"], body
            status, body = await _post(client, _token(cluster, ns, "caller-a"), "a")  # API-server audience
            assert status == 401 and "invalid token" in body["error"], body
            status, body = await _post(client, "not-a-token", "a")
            assert status == 401, body

            status, body = await _post(client, token_a, "a")
            assert status == 200, body
            used = {e for layer in body["expertCounts"] for e, n in enumerate(layer) if n > 0}
            assert used and used <= {0, 1}, body["expertCounts"]
            assert body["access"] == {"expertGroup": "a", "rule": f"{ns}/allow-a#s0t0", "allowedExperts": [0, 1]}

            status, body = await _post(client, token_a, "b")
            assert status == 403 and "default deny" in body["error"] and body["caller"] == f"{ns}/caller-a", body
            status, body = await _post(client, token_a)
            assert status == 403 and "scoped to expert groups a" in body["error"], body
            status, body = await _post(client, token_a, "nope")
            assert status == 400 and EXPERT_GROUP_HEADER in body["error"], body

            status, body = await _post(client, token_b, "a")
            assert status == 403 and body["rule"] == f"{ns}/deny-b#s0t0" and "Deny wins" in body["error"], body
            status, body = await _post(client, token_b)
            assert status == 403, body

            # Cached: one TokenReview per distinct token, however many requests.
            before = reviewer.reviews
            for _ in range(3):
                assert (await _post(client, token_a, "a"))[0] == 200
            assert reviewer.reviews == before

            scrape = await (await client.get("/metrics")).text()
            assert 'sparsegate_request_access_total{expert_group="a",result="allowed"} 4.0' in scrape
            assert 'sparsegate_request_access_total{expert_group="",result="forbidden"} 2.0' in scrape
            assert 'sparsegate_request_access_total{expert_group="a",result="unauthenticated"} 2.0' in scrape

            # Fail closed: a reviewer that cannot reach any API server refuses with 503.
            app[STATE].reviewer = CachedReviewer(KubeTokenReview(
                url=f"https://127.0.0.1:{free_port()}", token_file=str(own), ca_file=str(cluster.layout.cert("ca"))))
            status, body = await _post(client, token_a, "a")
            assert status == 503 and "cannot verify the caller" in body["error"], body
            assert token_a not in json.dumps(body)
    finally:
        cluster.kubectl("delete", "clusterrolebinding", role, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "clusterrole", role, "--ignore-not-found", check=False)
