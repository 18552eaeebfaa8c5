"""Talk to model-server pods directly: heartbeat + version check, and gate pushes.

``GET /healthz`` is the heartbeat and reports ``gateVersion`` and ``checksum``; a pod counts
as running a version only when both agree (the version is the content address of the params,
so the checksum must begin with the version's hex digits) — the double check of issue 6. A pod
holding a request-level canary also reports ``canary {version, checksum, weight}`` (checked the
same way); what it serves is then the set key ``g-stable+g-canary@weight``
(``sparsegate_contracts.canary``), which is what ``PodHealth.served`` holds and pushes verify.
``PUT /admin/gate`` hot-swaps the gate without a restart; the server answers 422 for a document it
rejects. It goes to the pod's admin port over TLS, with a context that trusts only the model's
certificate and checks the model's server name (:class:`AdminCredentials`, built from Secret
``<model>-admin`` by ``clients.admin_credentials``), so the Bearer token is sent only after the pod
has proved it holds the model's private key. Health and metrics stay on the plain inference port:
they carry no secret.

All calls are bounded (timeout per request, a concurrency cap, a cap on every body read) so a
fleet of 1,000 pods is one short round, a dead pod costs one timeout, never a stuck reconcile, and
a misbehaving pod cannot make the operator buffer an unbounded answer.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any

import aiohttp

from sparsegate_contracts.canary import document_key, reported_key
from sparsegate_contracts.gate import version_matches_checksum

__all__ = ["AdminCredentials", "PodTarget", "PodHealth", "PushResult", "AccessAnswer", "PodAdmin", "BodyTooLarge",
           "read_capped"]

JSON_BODY_LIMIT = 64 * 1024  # /healthz and /admin/gate answers are a few hundred bytes
METRICS_BODY_LIMIT = 4 * 1024 * 1024  # a model server's /metrics is tens of KiB


class BodyTooLarge(ValueError):
    """A pod answered more bytes than the operator reads from it."""


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or :class:`BodyTooLarge` as soon as it exceeds ``limit`` bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        raise BodyTooLarge(f"body of {resp.content_length} bytes exceeds {limit}")
    chunks, size = [], 0
    while chunk := await resp.content.read(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _json(resp: aiohttp.ClientResponse) -> Any:
    return json.loads(await read_capped(resp, JSON_BODY_LIMIT))


@dataclass(frozen=True)
class AdminCredentials:
    """What a push to one model's pods needs: the token, and the TLS context that admits only a
    server presenting the model's certificate for ``server_name``."""

    token: str = dataclasses.field(repr=False)
    server_name: str
    ssl: ssl.SSLContext = dataclasses.field(repr=False)
    source: str = ""  # where it came from, for error messages (never the token)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


@dataclass(frozen=True)
class PodTarget:
    name: str
    ip: str
    port: int  # inference port: /healthz, /metrics (plain HTTP, no secret)
    admin_port: int | None = None  # the pod's TLS admin port (None: it declares none)
    admin: AdminCredentials | None = None  # None: no token goes to this pod (see ``refusal``)
    previous_admin: AdminCredentials | None = None  # during a rotation, if ``admin``'s cert is refused
    refusal: str | None = None  # why ``admin`` is None

    @property
    def base(self) -> str:
        return f"http://{_host(self.ip)}:{self.port}"

    @property
    def admin_base(self) -> str:
        return f"https://{_host(self.ip)}:{self.admin_port}"


@dataclass(frozen=True)
class PodHealth:
    name: str
    version: str | None  # None: unreachable, unhealthy or inconsistent
    checksum: str | None = None
    uptime_s: float | None = None
    error: str | None = None
    served: str | None = None  # the set key: ``version`` alone, or with the canary it holds and its weight

    @property
    def reachable(self) -> bool:
        return self.version is not None

    @property
    def serving(self) -> str | None:
        """What the pod serves as one comparable key (``served``; ``version`` when not given)."""
        return self.served if self.served is not None else self.version


# Answers of ``PUT /admin/gate`` that refuse the document itself (400 not JSON, 413 too large, 415
# not sent as JSON, 422 a document the contract rejects: a checksum that is not its params' hash,
# params this model cannot take): the same document is refused again, so it is not pushed again at
# once (``controllers.rollout``). The server answers no 409 there (``ifSequence`` is /admin/access').
DOCUMENT_REFUSALS = frozenset({400, 413, 415, 422})


@dataclass(frozen=True)
class PushResult:
    name: str
    ok: bool
    version: str | None = None
    error: str | None = None
    certificate_refused: bool = False  # the pod's TLS certificate is not the model's
    status: int | None = None  # the pod's HTTP answer when it was not 200
    detail: str | None = None  # the pod's own message for it (its JSON body's "error")

    @property
    def refused(self) -> bool:
        """The pod refused the document (:data:`DOCUMENT_REFUSALS`), not a moment's trouble."""
        return not self.ok and self.status in DOCUMENT_REFUSALS


@dataclass(frozen=True)
class AccessAnswer:
    """A pod's answer on ``/admin/access``: the revision of the access rules it holds (None: none)."""

    name: str
    revision: str | None = None
    error: str | None = None
    sequence: int | None = None  # how many PUTs the pod has applied (a push's ``ifSequence``)


class PodAdmin:
    def __init__(self, *, timeout_s: float = 2.0, concurrency: int = 64) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._concurrency = concurrency

    async def _each(self, targets: Iterable[PodTarget], call: Any) -> list[Any]:
        sem = asyncio.Semaphore(self._concurrency)
        # No connection reuse across pods: each pod is its own host; keep-alive would only
        # hold sockets open to pods we may not talk to again for minutes.
        connector = aiohttp.TCPConnector(limit=self._concurrency, force_close=True)
        async with aiohttp.ClientSession(timeout=self._timeout, connector=connector) as session:

            async def bounded(t: PodTarget) -> Any:
                async with sem:
                    return await call(session, t)

            return await asyncio.gather(*(bounded(t) for t in targets))

    async def health(self, targets: Iterable[PodTarget]) -> dict[str, PodHealth]:
        """Heartbeat + version of every target (never raises for a pod's failure)."""

        async def one(session: aiohttp.ClientSession, t: PodTarget) -> PodHealth:
            try:
                async with session.get(f"{t.base}/healthz") as resp:
                    if resp.status != 200:
                        return PodHealth(name=t.name, version=None, error=f"/healthz {resp.status}")
                    body = await _json(resp)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
                return PodHealth(name=t.name, version=None, error=f"/healthz: {type(e).__name__} {e}".strip())
            if not isinstance(body, dict):
                return PodHealth(name=t.name, version=None, error=f"/healthz answered {type(body).__name__}, not an object")
            version, checksum = body.get("gateVersion"), body.get("checksum")
            canary = body.get("canary")
            served = reported_key(body, version_field="gateVersion")
            if body.get("status") != "ok" or not version_matches_checksum(version, checksum) or served is None \
                    or (canary is not None and not version_matches_checksum(canary.get("version"),
                                                                           canary.get("checksum"))):
                return PodHealth(name=t.name, version=None, error=f"/healthz inconsistent: {str(body)[:512]}")
            return PodHealth(name=t.name, version=version, checksum=checksum, uptime_s=body.get("uptimeSeconds"),
                             served=served)

        results = await self._each(targets, one)
        return {h.name: h for h in results}

    async def push(self, pushes: list[tuple[PodTarget, Mapping[str, Any]]]) -> dict[str, PushResult]:
        """PUT each (pod, gate document); the response must name the document's version."""
        docs = {t.name: doc for t, doc in pushes}
        targets = [t for t, _ in pushes]

        async def put(session: aiohttp.ClientSession, t: PodTarget, creds: AdminCredentials,
                      doc: Mapping[str, Any]) -> PushResult:
            try:
                # ssl= pins the model's certificate; server_hostname= is the name checked against
                # it (the URL holds an IP). The token is written only after the handshake passed.
                async with session.put(
                    f"{t.admin_base}/admin/gate", json=dict(doc), ssl=creds.ssl, server_hostname=creds.server_name,
                    headers={"Authorization": f"Bearer {creds.token}"}
                ) as resp:
                    body = await _json(resp)
                    if resp.status != 200:
                        detail = body.get("error") if isinstance(body, dict) else None
                        return PushResult(name=t.name, ok=False, error=f"PUT /admin/gate {resp.status}: {body}",
                                          status=resp.status, detail=str(detail)[:512] if detail else None)
            except aiohttp.ClientConnectorCertificateError as e:
                return PushResult(name=t.name, ok=False, certificate_refused=True,
                                  error=f"PUT /admin/gate: the pod's certificate is not {creds.server_name}'s "
                                        f"({creds.source}): {e.certificate_error}")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
                return PushResult(name=t.name, ok=False, error=f"PUT /admin/gate: {type(e).__name__} {e}".strip())
            served = reported_key(body, version_field="version") if isinstance(body, dict) else None
            wanted = document_key(doc)
            return PushResult(name=t.name, ok=served == wanted, version=served,
                              error=None if served == wanted else f"pod answered version {served}")

        async def one(session: aiohttp.ClientSession, t: PodTarget) -> PushResult:
            doc = docs[t.name]
            if t.admin is None:
                return PushResult(name=t.name, ok=False, error=f"no admin token sent: {t.refusal or 'no credentials'}")
            if t.admin_port is None:
                return PushResult(name=t.name, ok=False,
                                  error="the pod declares no admin port (it predates the TLS admin channel)")
            result = await put(session, t, t.admin, doc)
            if result.certificate_refused and t.previous_admin is not None:
                # Mid-rotation: this pod's Secret volume may not show the new files yet.
                result = await put(session, t, t.previous_admin, doc)
            return result

        results = await self._each(targets, one)
        return {r.name: r for r in results}

    async def _admin_json(self, session: aiohttp.ClientSession, t: PodTarget, method: str, path: str,
                          doc: Mapping[str, Any] | None) -> tuple[int, Any]:
        """One call on the pod's TLS admin port, pinned as :meth:`push` pins it (with the previous
        credentials mid-rotation); (status, JSON body). Raises what aiohttp raises, ValueError for
        a refusal to send the token."""
        if t.admin is None:
            raise ValueError(f"no admin token sent: {t.refusal or 'no credentials'}")
        if t.admin_port is None:
            raise ValueError("the pod declares no admin port (it predates the TLS admin channel)")

        async def call(creds: AdminCredentials) -> tuple[int, Any]:
            async with session.request(
                method, f"{t.admin_base}{path}", json=dict(doc) if doc is not None else None, ssl=creds.ssl,
                server_hostname=creds.server_name, headers={"Authorization": f"Bearer {creds.token}"}
            ) as resp:
                return resp.status, await _json(resp)

        try:
            return await call(t.admin)
        except aiohttp.ClientConnectorCertificateError:
            if t.previous_admin is None:
                raise
            return await call(t.previous_admin)

    async def _access(self, pairs: list[tuple[PodTarget, Mapping[str, Any] | None]]) -> dict[str, AccessAnswer]:
        docs = {t.name: doc for t, doc in pairs}

        async def one(session: aiohttp.ClientSession, t: PodTarget) -> AccessAnswer:
            doc = docs[t.name]
            method = "GET" if doc is None else "PUT"
            try:
                status, body = await self._admin_json(session, t, method, "/admin/access", doc)
            except aiohttp.ClientConnectorCertificateError as e:
                return AccessAnswer(name=t.name, error=f"{method} /admin/access: the pod's certificate is not "
                                                       f"the model's: {e.certificate_error}")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
                return AccessAnswer(name=t.name, error=f"{method} /admin/access: {type(e).__name__} {e}".strip())
            if status != 200 or not isinstance(body, dict):
                return AccessAnswer(name=t.name, error=f"{method} /admin/access {status}: {str(body)[:512]}")
            revision, sequence = body.get("revision"), body.get("sequence")
            return AccessAnswer(name=t.name, revision=revision if isinstance(revision, str) else None,
                                sequence=sequence if isinstance(sequence, int) and not isinstance(sequence, bool)
                                else None)

        results = await self._each([t for t, _ in pairs], one)
        return {r.name: r for r in results}

    async def access(self, targets: Iterable[PodTarget]) -> dict[str, AccessAnswer]:
        """``GET /admin/access`` of every target: the access rules' revision each holds (never raises
        for a pod's failure)."""
        return await self._access([(t, None) for t in targets])

    async def push_access(self, pushes: list[tuple[PodTarget, Mapping[str, Any]]]) -> dict[str, AccessAnswer]:
        """``PUT /admin/access`` of each (pod, access document); the answer's revision is what the
        pod holds now. A refused push (a 422 keeps the pod's old rules) answers the error and no
        revision: the pod is asked again (GET) before it counts as holding anything."""
        return await self._access([(t, doc) for t, doc in pushes])

    async def scrape(self, targets: Iterable[PodTarget], *, names: Sequence[str] = ()) -> dict[str, str]:
        """``/metrics`` text of every target that answered (absent: unreachable). ``names``: ask
        for these samples only (``name[]`` parameters, prometheus_client's restricted registry;
        a server that ignores them answers everything)."""
        params = [("name[]", n) for n in names]

        async def one(session: aiohttp.ClientSession, t: PodTarget) -> tuple[str, str | None]:
            try:
                async with session.get(f"{t.base}/metrics", params=params) as resp:
                    if resp.status != 200:
                        return t.name, None
                    return t.name, (await read_capped(resp, METRICS_BODY_LIMIT)).decode(errors="replace")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, BodyTooLarge):
                return t.name, None

        results = await self._each(targets, one)
        return {name: text for name, text in results if text is not None}
