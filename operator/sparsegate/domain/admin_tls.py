"""The admin channel's credentials: a per-model self-signed certificate and a random token.

Why a certificate per model, self-signed: the operator is the only client of a model server's
admin listener, and it already reads the model's Secret ``<model>-admin`` to get the token. Putting
the certificate and key in the same Secret lets the operator pin exactly that certificate (its
TLS context trusts nothing else), so the token only ever goes to a server holding the model's
private key. No CA, no issuer to run or rotate: rotating is replacing the Secret.

Pure: builds and inspects PEM text and Secret bodies; reading or writing the Secret is the
callers' business (``handlers.modelsync``, ``clients.admin_credentials``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime
import secrets
from collections.abc import Mapping
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from sparsegate_contracts.names import (ADMIN_SECRET_KEYS, ADMIN_TLS_CERT_KEY, ADMIN_TLS_KEY_KEY,
                                        ADMIN_TOKEN_KEY)

# A year, renewed by the operator 30 days before it ends (see :func:`secret_problem`).
CERT_VALIDITY = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=30)
# Backdated a little: a node whose clock lags the operator's must not see a "not yet valid" cert.
CLOCK_SKEW = datetime.timedelta(minutes=5)


@dataclasses.dataclass(frozen=True)
class AdminMaterial:
    """What Secret ``<model>-admin`` holds (text values)."""

    token: str
    cert_pem: str
    key_pem: str

    def secret_data(self) -> dict[str, str]:
        """The Secret's ``data`` (base64), keys exactly ``names.ADMIN_SECRET_KEYS``."""
        values = {ADMIN_TOKEN_KEY: self.token, ADMIN_TLS_CERT_KEY: self.cert_pem,
                  ADMIN_TLS_KEY_KEY: self.key_pem}
        return {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}


def new_token() -> str:
    return secrets.token_urlsafe(32)


def issue(*, server_name: str, now: datetime.datetime,
          validity: datetime.timedelta = CERT_VALIDITY) -> tuple[str, str]:
    """A fresh ECDSA P-256 key and a self-signed certificate for ``server_name`` (a DNS SAN):
    ``(cert_pem, key_pem)``. Not a CA (it signs nothing else); usable for TLS server auth only."""
    key = ec.generate_private_key(ec.SECP256R1())
    # The subject is informational (hostname checks read the SAN only); a CN is capped at 64
    # characters, which a long model + namespace name can exceed.
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sparsegate"),
                         x509.NameAttribute(NameOID.COMMON_NAME, server_name[:64])])
    public = key.public_key()
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + validity)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(server_name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    return cert_pem, key_pem


def new_material(*, server_name: str, now: datetime.datetime) -> AdminMaterial:
    cert_pem, key_pem = issue(server_name=server_name, now=now)
    return AdminMaterial(token=new_token(), cert_pem=cert_pem, key_pem=key_pem)


class SecretError(ValueError):
    """Secret ``<model>-admin`` cannot authenticate the admin channel (the message says why)."""


def material_from_secret(secret: Mapping[str, Any]) -> AdminMaterial:
    """The token, certificate and key of a Secret body as the API server returns it (``data``,
    base64); raises :class:`SecretError` naming what is missing or malformed."""
    data = secret.get("data") or {}
    missing = [k for k in ADMIN_SECRET_KEYS if not data.get(k)]
    if missing:
        raise SecretError(f"missing key(s) {', '.join(missing)}")
    try:
        values = {k: base64.b64decode(data[k], validate=True).decode() for k in ADMIN_SECRET_KEYS}
    except (binascii.Error, UnicodeDecodeError) as e:
        raise SecretError(f"a value is not base64 text: {e}") from None
    token = values[ADMIN_TOKEN_KEY].strip()
    if not token:
        raise SecretError(f"key {ADMIN_TOKEN_KEY} is empty")
    return AdminMaterial(token=token, cert_pem=values[ADMIN_TLS_CERT_KEY], key_pem=values[ADMIN_TLS_KEY_KEY])


def certificate_names(cert_pem: str) -> list[str]:
    """The DNS names in the certificate's subjectAltName (raises ValueError if it is not a PEM cert)."""
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return san.get_values_for_type(x509.DNSName)


_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def secret_problem(secret: Mapping[str, Any], *, server_name: str, now: datetime.datetime) -> str | None:
    """Why the operator must replace this Secret (None: it is fine as it is): keys missing (made by
    an operator before the TLS admin channel), a certificate that does not name this model, that
    cannot be read, whose key is not the Secret's key, that ends within :data:`RENEW_BEFORE` or that
    is not valid yet."""
    try:
        material = material_from_secret(secret)
        cert = x509.load_pem_x509_certificate(material.cert_pem.encode())
        key = serialization.load_pem_private_key(material.key_pem.encode(), password=None)
    except (SecretError, ValueError, TypeError) as e:
        return str(e)
    # A key of another pair (a hand edit that changed one file): the server cannot load the pair,
    # so a new pod exits at start and a running one keeps its old files.
    if key.public_key().public_bytes(*_SPKI) != cert.public_key().public_bytes(*_SPKI):
        return f"{ADMIN_TLS_KEY_KEY} is not the key of {ADMIN_TLS_CERT_KEY}"
    if server_name not in certificate_names(material.cert_pem):
        return f"certificate does not name {server_name}"
    if cert.not_valid_after_utc - now < RENEW_BEFORE:
        return f"certificate ends {cert.not_valid_after_utc.isoformat()}"
    # Issued by a replica whose clock ran ahead (past CLOCK_SKEW): TLS refuses it until then, so
    # every admin call to the model's pods would fail meanwhile.
    if cert.not_valid_before_utc > now:
        return f"certificate is not valid before {cert.not_valid_before_utc.isoformat()}"
    return None
