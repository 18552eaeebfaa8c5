"""The operator's side of the admin channel's credentials: Secret ``<model>-admin`` → what a push needs.

The rollout controller and the access sync GET a model's Secret just before they send something
to its pods (``RolloutLoop.credentials``: one small GET per model and send) and hand the body to
:meth:`AdminCredentialStore.update`; only a changed ``resourceVersion`` (or uid) builds new
credentials, so the TLS context is not rebuilt each time, and nothing outlives the Secret it came
from: a rotated or deleted Secret takes effect at the next send.

Each :class:`~sparsegate.clients.podadmin.AdminCredentials` trusts exactly one certificate (the
model's ``tls.crt``; no system CAs) and names the model's server name, so a pod that does not hold
the model's private key fails the TLS handshake before the token is sent.

Rotation lag: a kubelet updates a running pod's Secret volume up to a minute or so after the
Secret changed. Meanwhile a pod still presents the previous certificate; for :data:`ROTATION_GRACE_S`
the store keeps the previous credentials, which :class:`~sparsegate.clients.podadmin.PodAdmin`
uses only when the current certificate is refused — so the previous token still goes only to a
server holding the previous key.
"""

from __future__ import annotations

import dataclasses
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any

from sparsegate.clients.podadmin import AdminCredentials
from sparsegate.domain.admin_tls import SecretError, material_from_secret

ROTATION_GRACE_S = 300.0


def client_context(cert_pem: str) -> ssl.SSLContext:
    """A TLS client context that trusts ``cert_pem`` alone (CERT_REQUIRED, host name checked)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verify_mode CERT_REQUIRED, check_hostname on
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=cert_pem)
    return ctx


def credentials_from_secret(secret: Mapping[str, Any], *, server_name: str) -> AdminCredentials:
    """Raises :class:`SecretError` (incomplete Secret) or ``ssl.SSLError`` (unreadable certificate)."""
    material = material_from_secret(secret)
    meta = secret.get("metadata") or {}
    return AdminCredentials(token=material.token, server_name=server_name,
                            ssl=client_context(material.cert_pem),
                            source=f"Secret {meta.get('name')} resourceVersion {meta.get('resourceVersion')}")


@dataclasses.dataclass(frozen=True)
class ModelCredentials:
    current: AdminCredentials | None
    previous: AdminCredentials | None = None  # within the rotation grace period only
    error: str | None = None  # why ``current`` is None


@dataclasses.dataclass
class _Entry:
    key: tuple[str | None, str | None]  # (uid, resourceVersion) of the Secret read
    creds: ModelCredentials
    previous: AdminCredentials | None = None
    superseded_at: float = 0.0


class AdminCredentialStore:
    """Credentials per (namespace, model), rebuilt when the model's Secret changes."""

    def __init__(self, *, grace_s: float = ROTATION_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._grace_s = grace_s
        self._clock = clock

    def update(self, secret: Mapping[str, Any] | None, *, namespace: str, model: str,
               server_name: str) -> ModelCredentials:
        """The model's credentials given its Secret as just read (None: not found)."""
        meta = (secret or {}).get("metadata") or {}
        key = (meta.get("uid"), meta.get("resourceVersion"))
        entry = self._entries.get((namespace, model))
        now = self._clock()
        if entry is None or entry.key != key or secret is None:
            if secret is None:
                creds = ModelCredentials(current=None, error=f"Secret of model {model} not found")
            else:
                try:
                    creds = ModelCredentials(current=credentials_from_secret(secret, server_name=server_name))
                except (SecretError, ssl.SSLError, ValueError) as e:
                    creds = ModelCredentials(current=None, error=f"Secret {meta.get('name')}: {e}")
            previous = entry.creds.current if entry is not None and entry.creds.current else (
                entry.previous if entry is not None else None)
            superseded = now if entry is not None and entry.creds.current else (
                entry.superseded_at if entry is not None else 0.0)
            entry = _Entry(key=key, creds=creds, previous=previous, superseded_at=superseded)
            self._entries[(namespace, model)] = entry
        previous = entry.previous if entry.previous is not None and now - entry.superseded_at < self._grace_s else None
        return dataclasses.replace(entry.creds, previous=previous)

    def forget(self, *, namespace: str, model: str) -> None:
        self._entries.pop((namespace, model), None)
