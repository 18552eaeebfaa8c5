"""Reading TokenReview answers, and the review cache: TTL, bound, refusals cached, outages not
(the real TokenReview against an API server: tests/e2e/policies/test_request_auth_server.py)."""

from __future__ import annotations

import pytest

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
