"""The model server's admin channel: ``GET``/``PUT /admin/gate`` and ``/admin/access`` on a TLS
listener of its own.

Why apart from the inference port: the Bearer token must never cross the network in clear, and
the inference port is plain HTTP that anything in the cluster may call (through the Service). The
admin listener (``--admin-port``, 8443 by default) speaks only TLS, with the per-model certificate
the operator issues, and every admin request (GET too) needs the token.

Rotation without restart: the token, certificate and key are files of the Secret volume
``<model>-admin``. A kubelet updates such a volume by swapping a ``..data`` symlink, so each file
path then resolves to a new inode. :class:`AdminFiles` compares the three files' (device, inode,
mtime, size) on every new TLS connection (the context's SNI callback, called for every
ClientHello) and on every admin request, and reloads when any changed: the token check uses the
new token at once, and the new certificate is presented from the next TLS handshake on (the
callback hands the connection a freshly loaded SSLContext). A half-updated set of files (a
certificate whose key has not arrived yet) fails to load; the previous pair stays in use and the
next connection tries again.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import ssl
from typing import Protocol

log = logging.getLogger("sparsegate.workload.admin")


class AdminAuth(Protocol):
    def token(self) -> str | None:
        """The Bearer token admin requests must carry now (None: admin refused)."""


@dataclasses.dataclass(frozen=True)
class StaticToken:
    """A fixed token, for in-process users (tests) that serve the admin app without TLS."""

    value: str | None

    def token(self) -> str | None:
        return self.value


def _signature(paths: tuple[str, ...]) -> tuple[tuple[int, int, int, int], ...]:
    out = []
    for p in paths:
        st = os.stat(p)  # follows the kubelet's symlinks: a swap shows as a new inode
        out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class AdminFiles:
    """Token + TLS certificate/key read from files, reloaded when the files change."""

    def __init__(self, *, token_file: str, cert_file: str, key_file: str) -> None:
        self.paths = (token_file, cert_file, key_file)
        self._sig: tuple[tuple[int, int, int, int], ...] | None = None
        self._failed_sig: tuple[tuple[int, int, int, int], ...] | None = None
        self._token: str | None = None
        self._context: ssl.SSLContext | None = None
        self.reloads = 0  # successful loads, the first included (for tests and logs)
        self.load(strict=True)

    @staticmethod
    def _server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert_file, key_file)
        return ctx

    def load(self, *, strict: bool = False) -> bool:
        """Reload if any file changed; True when new contents are in effect. ``strict``: raise
        instead of keeping the previous contents (at start-up there are none to keep)."""
        token_file, cert_file, key_file = self.paths
        try:
            sig = _signature(self.paths)
            if sig == self._sig:
                return False
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
            context = self._server_context(cert_file, key_file)
            if _signature(self.paths) != sig:
                raise OSError("the files changed while they were read")
            if not token:
                raise ValueError(f"{token_file} is empty")
        except (OSError, ssl.SSLError, ValueError) as e:
            if strict:
                raise
            if _signature_or_none(self.paths) != self._failed_sig:
                self._failed_sig = _signature_or_none(self.paths)
                log.warning("admin credentials not reloaded (keeping the previous ones): %s", e)
            return False
        self._sig, self._token, self._context, self._failed_sig = sig, token, context, None
        self.reloads += 1
        if self.reloads > 1:
            log.info("admin credentials reloaded from %s", ", ".join(self.paths))
        return True

    def token(self) -> str | None:
        self.load()
        return self._token

    def ssl_context(self) -> ssl.SSLContext:
        """The listener's context: each handshake first reloads changed files, then runs under the
        current certificate (the SNI callback swaps the connection's context)."""
        token_file, cert_file, key_file = self.paths
        outer = self._server_context(cert_file, key_file)

        def on_client_hello(conn: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None,
                            _ctx: ssl.SSLContext) -> None:
            self.load()
            if self._context is not None:
                conn.context = self._context

        outer.sni_callback = on_client_hello
        return outer


def _signature_or_none(paths: tuple[str, ...]) -> tuple[tuple[int, int, int, int], ...] | None:
    try:
        return _signature(paths)
    except OSError:
        return None


class AdminDenied(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_bearer(authorization: str, expected: str | None) -> None:
    """Raises :class:`AdminDenied`: 401 without a Bearer token, 403 for a wrong one (compared in
    constant time) or when no token is configured."""
    if not expected:
        raise AdminDenied(403, "admin API disabled: no admin token configured on this server")
    if not authorization.startswith("Bearer "):
        raise AdminDenied(401, "missing Bearer token")
    # surrogateescape: header bytes that are not UTF-8 reach us as lone surrogates; they compare
    # unequal (403) rather than failing to encode (500).
    if not hmac.compare_digest(authorization[len("Bearer "):].encode(errors="surrogateescape"), expected.encode()):
        raise AdminDenied(403, "invalid admin token")
