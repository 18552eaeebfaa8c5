"""Who is calling: a projected ServiceAccount token verified by a TokenReview, cached.

Callers send ``Authorization: Bearer <token>`` with a token for audience ``sparsegate``
(``kubectl create token SA --audience sparsegate``, or a projected volume). The server asks the API
server (``POST /apis/authentication.k8s.io/v1/tokenreviews`` with its own ServiceAccount, which
needs ``create tokenreviews``) whether the token is valid for that audience and whose it is.

Why TokenReview rather than checking signatures against the issuer's JWKS here: the API server also
knows about revoked bound tokens (a deleted pod or Secret), which a local signature check cannot.
The cost is one API round trip per new token; answers are cached by the token's SHA-256 (never the
token itself) for ``ttl_s`` (never past an accepted token's own ``exp``) in a bounded LRU, so a
caller reusing its token costs a dict lookup; a revoked token is thus still admitted until its entry
expires.

Fail closed: a review that cannot be made (API server unreachable, 5xx, malformed answer) raises
:class:`ReviewUnavailable` and is not cached; the server then answers 503, never serves the request.
Tokens are never logged.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import hashlib
import json
import math
import os
import ssl
import time
from collections.abc import Callable
from typing import Protocol

import aiohttp

from sparsegate_contracts.request_access import TOKEN_AUDIENCE

IN_CLUSTER_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_SA_PREFIX = "system:serviceaccount:"


class ReviewUnavailable(Exception):
    """The token could not be reviewed (not: the token is bad)."""


@dataclasses.dataclass(frozen=True)
class Caller:
    namespace: str
    service_account: str


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None: no such token). The scheme
    is case-insensitive (RFC 9110 11.1), as the API server's own Bearer parsing is."""
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class TokenReviewer(Protocol):
    async def review(self, token: str) -> Caller | None:
        """The ServiceAccount the token authenticates for audience ``sparsegate`` (None: it does
        not). Raises :class:`ReviewUnavailable` when no answer could be had."""


def caller_from_review(status: object, *, audience: str = TOKEN_AUDIENCE) -> Caller | None:
    """A TokenReview ``status`` → the ServiceAccount, or None unless authenticated for
    ``audience`` as a ServiceAccount."""
    if not isinstance(status, dict) or status.get("authenticated") is not True:
        return None
    audiences = status.get("audiences")
    # A list only: ``in`` on a string would accept any audience containing ours as a substring.
    if not isinstance(audiences, list) or audience not in audiences:
        return None
    user = status.get("user")
    username = user.get("username", "") if isinstance(user, dict) else ""
    if not isinstance(username, str) or not username.startswith(_SA_PREFIX):
        return None
    parts = username[len(_SA_PREFIX):].split(":")
    if len(parts) != 2 or not all(parts):
        return None
    return Caller(namespace=parts[0], service_account=parts[1])


class KubeTokenReview:
    """TokenReviews through the API server at ``url`` with this pod's own ServiceAccount token."""

    def __init__(self, *, url: str, token_file: str, ca_file: str | None, timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/") + "/apis/authentication.k8s.io/v1/tokenreviews"
        self.token_file = token_file
        self.ca_file = ca_file
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    @classmethod
    def in_cluster(cls, *, directory: str = IN_CLUSTER_DIR, env: dict[str, str] | None = None) -> KubeTokenReview:
        env = dict(os.environ if env is None else env)
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("KUBERNETES_SERVICE_HOST is not set: not running in a pod")
        host = f"[{host}]" if ":" in host else host
        return cls(url=f"https://{host}:{port}", token_file=f"{directory}/token", ca_file=f"{directory}/ca.crt")

    async def review(self, token: str) -> Caller | None:
        try:
            # Both re-read per review (a cache miss): the kubelet rotates the projected token, and
            # a CA bundle may be replaced.
            with open(self.token_file, encoding="utf-8") as f:
                own = f.read().strip()
            context = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None
            body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                    "spec": {"token": token, "audiences": [TOKEN_AUDIENCE]}}
            async with aiohttp.ClientSession(timeout=self.timeout) as session:
                async with session.post(self.url, json=body, ssl=context,
                                        headers={"Authorization": f"Bearer {own}"}) as resp:
                    if resp.status != 201 and resp.status != 200:
                        raise ReviewUnavailable(f"TokenReview answered HTTP {resp.status}")
                    answer = await resp.json()
        except (OSError, ssl.SSLError, aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise ReviewUnavailable(f"TokenReview failed: {type(e).__name__}") from None
        status = answer.get("status") if isinstance(answer, dict) else None
        if not isinstance(status, dict):
            # Not a TokenReview (a proxy's page, a truncated body): no answer, so not a cached refusal.
            raise ReviewUnavailable("TokenReview answer has no status")
        return caller_from_review(status)


def token_expiry(token: str) -> float | None:
    """The ``exp`` claim (Unix seconds) of a JWT, read without verifying it (None: none readable).

    Only ever used to shorten how long a review is cached: for an authenticated token the API
    server has just verified the signature, so this ``exp`` is the one it checked."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, TypeError, RecursionError):
        return None
    exp = payload.get("exp") if isinstance(payload, dict) else None
    if isinstance(exp, bool) or not isinstance(exp, (int, float)) or not math.isfinite(exp):
        return None
    return float(exp)


class CachedReviewer:
    """Reviews cached by token digest for ``ttl_s``, at most ``max_entries`` (least recently used
    evicted). Refusals are cached too (a flood of one bad token costs one review per TTL), and
    concurrent reviews of one token share one TokenReview. An accepted token is never cached past
    its own ``exp``: TokenReview's answer carries no expiry, and the TTL may be up to an hour."""

    def __init__(self, inner: TokenReviewer, *, ttl_s: float = 30.0, max_entries: int = 4096,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.inner, self.ttl_s, self.max_entries, self.clock = inner, ttl_s, max_entries, clock
        self.wall_clock = wall_clock
        self._cache: collections.OrderedDict[bytes, tuple[float, Caller | None]] = collections.OrderedDict()
        self._pending: dict[bytes, asyncio.Task[Caller | None]] = {}
        self.reviews = 0  # calls to the API server (for tests and metrics)

    async def review(self, token: str) -> Caller | None:
        if not token.isascii():
            return None  # a ServiceAccount token (a JWT) is ASCII: this one cannot authenticate
        key = hashlib.sha256(token.encode()).digest()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > self.clock():
            self._cache.move_to_end(key)
            return hit[1]
        task = self._pending.get(key)
        if task is None:
            # One review per token at a time: without it N concurrent requests bearing one token
            # (before any answer is cached) cost N TokenReviews, none bounded by --max-inflight.
            task = asyncio.ensure_future(self._review(key, token))
            # Its outage is read here too, so one whose every waiter left is not logged as unread.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._pending[key] = task
        # shield: a waiter cancelled (client gone) must not cancel the review the others await.
        return await asyncio.shield(task)

    async def _review(self, key: bytes, token: str) -> Caller | None:
        try:
            self.reviews += 1
            caller = await self.inner.review(token)  # ReviewUnavailable propagates, nothing cached
        finally:
            del self._pending[key]
        now = self.clock()
        until = now + self.ttl_s
        if caller is not None:
            exp = token_expiry(token)
            if exp is not None:
                until = min(until, now + (exp - self.wall_clock()))
        if until > now:
            self._cache[key] = (until, caller)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return caller
