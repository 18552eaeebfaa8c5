"""Reading TokenReview answers, and the review cache: TTL, bound, refusals cached, outages not
(the real TokenReview against an API server: tests/e2e/policies/test_request_auth_server.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_workload.caller_auth import (CachedReviewer, Caller, KubeTokenReview, ReviewUnavailable,
                                             caller_from_review)
from sparsegate_workload.server import main

OK = {"authenticated": True, "audiences": ["sparsegate"], "user": {"username": "system:serviceaccount:web:a"}}


@pytest.mark.parametrize("status, expected", [
    (OK, Caller("web", "a")),
    ({**OK, "authenticated": False}, None),
    ({**OK, "audiences": ["https://kubernetes.default.svc"]}, None),
    ({**OK, "audiences": None}, None),
    ({**OK, "user": {"username": "alice"}}, None),
    ({**OK, "user": {"username": "system:serviceaccount:web"}}, None),
    ({**OK, "user": {"username": "system:serviceaccount:web:a:b"}}, None),
    ({**OK, "user": {"username": "system:node:worker-1"}}, None),
    ({**OK, "audiences": "not-sparsegate-at-all"}, None),  # a string: no substring match
    ({**OK, "user": "system:serviceaccount:web:a"}, None),  # malformed: refused, not a 500
    (None, None),
])
def test_only_a_service_account_authenticated_for_our_audience(status, expected):
    assert caller_from_review(status) == expected


class Reviews:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.down = False

    async def review(self, token: str) -> Caller | None:
        self.calls.append(token)
        if self.down:
            raise ReviewUnavailable("down")
        return Caller("web", token) if token.startswith("good") else None


async def test_cache_reuses_answers_for_the_ttl_and_stays_bounded():
    now = [0.0]
    inner = Reviews()
    cache = CachedReviewer(inner, ttl_s=30, max_entries=2, clock=lambda: now[0])
    assert await cache.review("good1") == Caller("web", "good1")
    assert await cache.review("bad") is None
    assert await cache.review("good1") == Caller("web", "good1") and await cache.review("bad") is None
    assert inner.calls == ["good1", "bad"]  # refusals are cached too
    now[0] = 31
    await cache.review("good1")
    assert inner.calls == ["good1", "bad", "good1"]
    await cache.review("good2")
    await cache.review("good3")  # evicts the least recently used ("good1")
    await cache.review("good1")
    assert inner.calls[-1] == "good1" and len(cache._cache) == 2


async def test_header_bytes_that_are_not_utf8_refuse_and_never_crash():
    """aiohttp hands non-UTF-8 header bytes over as lone surrogates: encoding them raised
    UnicodeEncodeError (500). A caller's such token cannot be a ServiceAccount JWT (401, no
    TokenReview); an admin's compares unequal (403)."""
    from sparsegate_workload.admin import AdminDenied, check_bearer

    token = b"\xff\xfe".decode(errors="surrogateescape")
    inner = Reviews()
    assert await CachedReviewer(inner).review(token) is None and inner.calls == []
    with pytest.raises(AdminDenied) as denied:
        check_bearer("Bearer " + token, "admin-token")
    assert denied.value.status == 403


async def test_outage_is_not_cached():
    inner = Reviews()
    cache = CachedReviewer(inner)
    inner.down = True
    with pytest.raises(ReviewUnavailable):
        await cache.review("good1")
    inner.down = False
    assert await cache.review("good1") == Caller("web", "good1")


def test_in_cluster_needs_the_pod_environment(capsys):
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        KubeTokenReview.in_cluster(env={})
    review = KubeTokenReview.in_cluster(env={"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"})
    assert review.url == "https://[fd00::1]:6443/apis/authentication.k8s.io/v1/tokenreviews"


def test_server_flags(monkeypatch, capsys):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(SystemExit):
        main(["--request-auth", "in-cluster"])
    assert "--request-auth in-cluster: KUBERNETES_SERVICE_HOST is not set" in capsys.readouterr().err
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with pytest.raises(SystemExit):
        main(["--request-auth", "in-cluster"])
    assert "needs the admin channel" in capsys.readouterr().err


def _jwt(exp: float | None) -> str:
    """A token shaped like a ServiceAccount JWT (unsigned: the fake reviewer decides)."""
    def part(obj: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()
    claims = {"sub": "system:serviceaccount:web:a"} | ({"exp": exp} if exp is not None else {})
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


class JwtReviews(Reviews):
    async def review(self, token: str) -> Caller | None:
        self.calls.append(token)
        return Caller("web", "a")


async def test_an_accepted_token_is_not_cached_past_its_own_exp():
    """TokenReview's answer has no expiry; with the TTL alone (up to 3600 s from
    spec.access.tokenCacheSeconds) a token expiring in 5 s was admitted for the whole TTL."""
    mono = [100.0]
    inner = JwtReviews()
    cache = CachedReviewer(inner, ttl_s=3600, clock=lambda: mono[0])  # exp is read on the wall clock
    token = _jwt(exp=time.time() + 5)
    assert await cache.review(token) == Caller("web", "a")
    mono[0] += 2
    await cache.review(token)
    assert len(inner.calls) == 1  # still valid: cached
    mono[0] += 10
    await cache.review(token)
    assert len(inner.calls) == 2  # expired: asked again (the API server now refuses it)
    # Already expired (clock skew): not cached at all; no exp claim: the TTL alone.
    await cache.review(_jwt(exp=time.time() - 1))
    await cache.review(_jwt(exp=time.time() - 1))
    assert len(inner.calls) == 4
    await cache.review(_jwt(exp=None))
    mono[0] += 3000
    await cache.review(_jwt(exp=None))
    assert len(inner.calls) == 5


async def test_concurrent_reviews_of_one_token_share_one_tokenreview():
    """Before an answer is cached, N concurrent requests with one token cost N TokenReviews
    (the guard runs before --max-inflight): one flood of a bad token amplified onto the API
    server. Now they await one review; its outage reaches every waiter and is not cached."""
    gate = asyncio.Event()

    class Slow(Reviews):
        async def review(self, token: str) -> Caller | None:
            await gate.wait()
            return await super().review(token)

    inner = Slow()
    cache = CachedReviewer(inner)
    waiters = [asyncio.ensure_future(cache.review("bad")) for _ in range(50)]
    await asyncio.sleep(0.01)
    waiters[0].cancel()  # one caller gone: the others still get the answer
    gate.set()
    results = await asyncio.gather(*waiters[1:])
    assert inner.calls == ["bad"] and results == [None] * 49
    inner.down, gate = True, asyncio.Event()
    waiters = [asyncio.ensure_future(cache.review("good1")) for _ in range(5)]
    await asyncio.sleep(0.01)
    gate.set()
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(o, ReviewUnavailable) for o in outcomes) and inner.calls == ["bad", "good1"]
    inner.down = False
    assert await cache.review("good1") == Caller("web", "good1") and inner.calls[-1] == "good1"


async def _fake_api_server(handler) -> tuple[TestServer, str]:
    app = web.Application()
    app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


async def test_kube_token_review_against_a_fake_api_server(tmp_path):
    """The review asks for audience sparsegate with the pod's own token; a 2xx that is not a
    TokenReview is an outage (503), not a cached refusal; a slow API server times out into
    ReviewUnavailable without holding the event loop."""
    own = tmp_path / "token"
    own.write_text("own-sa-token\n")
    seen: list[tuple[str, dict]] = []
    mode = ["ok"]

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.headers["Authorization"], await request.json()))
        if mode[0] == "empty":
            return web.json_response({}, status=200)
        if mode[0] == "slow":
            await asyncio.sleep(5)
        return web.json_response({"kind": "TokenReview", "status": OK}, status=201)

    server, url = await _fake_api_server(handler)
    try:
        review = KubeTokenReview(url=url, token_file=str(own), ca_file=None, timeout_s=0.5)
        assert await review.review("caller-token") == Caller("web", "a")
        auth, body = seen[-1]
        assert auth == "Bearer own-sa-token"
        assert body["spec"] == {"token": "caller-token", "audiences": ["sparsegate"]}
        mode[0] = "empty"
        with pytest.raises(ReviewUnavailable):
            await review.review("caller-token")
        mode[0] = "slow"
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        start = time.monotonic()
        with pytest.raises(ReviewUnavailable):
            await review.review("caller-token")
        t.cancel()
        assert time.monotonic() - start < 2 and ticks >= 5
    finally:
        await server.close()


@pytest.mark.parametrize("header, token", [
    ("Bearer abc", "abc"), ("bearer abc", "abc"), ("BEARER  abc ", "abc"),
    ("Bearer ", None), ("Basic abc", None), ("Bearerabc", None), ("", None),
])
def test_bearer_scheme_is_case_insensitive(header, token):
    from sparsegate_workload.caller_auth import bearer_token

    assert bearer_token(header) == token


async def test_the_guard_accepts_a_lowercase_bearer_scheme():
    """RFC 9110: the auth scheme is case-insensitive (the API server takes "bearer"); the guard
    answered such a caller 401."""
    from sparsegate.domain.policy import rules_from_spec
    from sparsegate.domain.request_access import access_document
    from sparsegate_workload.admin import StaticToken
    from sparsegate_workload.server import create_admin_app, create_app, wait_ready

    class One(Reviews):
        async def review(self, token: str) -> Caller | None:
            return Caller("ns", "caller-a") if token == "token-a" else None

    app = create_app(reviewer=One())
    rules = rules_from_spec(namespace="ns", name="allow", spec={
        "action": "Allow", "sources": [{"serviceAccount": "caller-a"}], "targets": [{"sparseModel": "moe"}]})
    doc = access_document(rules, namespace="ns", model="moe", serving_port=8080, trust_domain="cluster.local")
    async with TestClient(TestServer(app, host="127.0.0.1")) as client, \
            TestClient(TestServer(create_admin_app(app, auth=StaticToken("adm")), host="127.0.0.1")) as admin:
        await wait_ready(app)
        assert (await admin.put("/admin/access", json=doc, headers={"Authorization": "Bearer adm"})).status == 200
        for header, status in (("bearer token-a", 200), ("Bearer token-a", 200), ("bearer other", 401)):
            resp = await client.post("/v1/infer", json={"tokens": [[1, 2, 3]]}, headers={"Authorization": header})
            assert resp.status == status, (header, await resp.text())


async def test_readyz_is_503_until_the_first_access_document():
    """With --request-auth every POST is refused (503) until the operator's first PUT /admin/access;
    /readyz answered 200 meanwhile, so a Service routed callers to a pod that refused them all. The
    operator pushes to pods with an IP, Ready or not, so holding readiness back cannot deadlock."""
    from sparsegate.domain.request_access import access_document
    from sparsegate_workload.admin import StaticToken
    from sparsegate_workload.server import create_admin_app, create_app, wait_ready

    app = create_app(reviewer=Reviews())
    doc = access_document([], namespace="ns", model="moe", serving_port=8080, trust_domain="cluster.local")
    async with TestClient(TestServer(app, host="127.0.0.1")) as client, \
            TestClient(TestServer(create_admin_app(app, auth=StaticToken("adm")), host="127.0.0.1")) as admin:
        await wait_ready(app)
        resp = await client.get("/readyz")
        assert resp.status == 503 and "no access rules" in (await resp.json())["reason"]
        assert (await client.post("/v1/infer", json={"tokens": [[1, 2, 3]]})).status == 503
        assert (await admin.put("/admin/access", json=doc, headers={"Authorization": "Bearer adm"})).status == 200
        resp = await client.get("/readyz")
        assert resp.status == 200, await resp.text()
        assert (await client.post("/v1/infer", json={"tokens": [[1, 2, 3]]})).status == 200
    unguarded = create_app()  # without --request-auth no rules are awaited
    async with TestClient(TestServer(unguarded, host="127.0.0.1")) as client:
        await wait_ready(unguarded)
        assert (await client.get("/readyz")).status == 200


def test_token_cache_ttl_must_be_finite_and_positive(monkeypatch, capsys):
    """float() parses "inf" and "nan": inf cached every refusal forever, nan cached nothing."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    for ttl in ("inf", "nan", "0", "-5"):
        with pytest.raises(SystemExit):
            main(["--request-auth", "in-cluster", "--token-cache-ttl", ttl])
        assert "--token-cache-ttl must be in (0, 86400]" in capsys.readouterr().err


async def test_a_late_access_push_never_replaces_a_newer_one():
    """A PUT compiled against sequence n that arrives after another PUT moved the pod past n (its
    sender timed out, the next round pushed newer rules) is refused with 409: the pod keeps the newer
    rules. Before, the last PUT to arrive won, whatever its age."""
    from sparsegate.domain.policy import rules_from_spec
    from sparsegate.domain.request_access import access_document
    from sparsegate_workload.admin import StaticToken
    from sparsegate_workload.server import create_admin_app, create_app

    def doc(action):
        rules = rules_from_spec(namespace="ns", name="p", spec={
            "action": action, "sources": [{"serviceAccount": "caller-a"}], "targets": [{"sparseModel": "moe"}]})
        return access_document(rules, namespace="ns", model="moe", serving_port=8080, trust_domain="cluster.local")

    app = create_app(reviewer=Reviews())
    auth = {"Authorization": "Bearer adm"}
    async with TestClient(TestServer(create_admin_app(app, auth=StaticToken("adm")), host="127.0.0.1")) as admin:
        assert (await (await admin.get("/admin/access", headers=auth)).json())["sequence"] == 0
        old, new = doc("Allow"), doc("Deny")
        resp = await admin.put("/admin/access", json={**new, "ifSequence": 0}, headers=auth)
        assert resp.status == 200 and (await resp.json())["sequence"] == 1
        late = await admin.put("/admin/access", json={**old, "ifSequence": 0}, headers=auth)
        assert late.status == 409, await late.text()
        held = await (await admin.get("/admin/access", headers=auth)).json()
        assert held["revision"] == new["revision"] and held["sequence"] == 1
        bad = await admin.put("/admin/access", json={**old, "ifSequence": "0"}, headers=auth)
        assert bad.status == 422
