"""Certificates and service-account keys for the local cluster, made with the openssl CLI.

Rendering (subjects, extension files) is pure and unit-tested; ``ensure_*`` run openssl and keep
existing files, so a restarted cluster keeps the keys its stored tokens were signed with.
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import subprocess
from pathlib import Path

DAYS = 3650


class PkiError(RuntimeError):
    """openssl failed or is missing."""


@dataclasses.dataclass(frozen=True)
class CertSpec:
    """One leaf certificate signed by the cluster CA."""

    name: str  # file stem: <name>.crt / <name>.key
    common_name: str
    organizations: tuple[str, ...] = ()
    server: bool = False
    client: bool = False
    dns_names: tuple[str, ...] = ()
    ip_addresses: tuple[str, ...] = ()


def subject(*, common_name: str, organizations: tuple[str, ...] = ()) -> str:
    """openssl ``-subj`` string; Kubernetes reads O as groups and CN as the user name."""
    parts = [f"/O={o}" for o in organizations] + [f"/CN={common_name}"]
    return "".join(parts)


def extensions(spec: CertSpec) -> str:
    """Contents of the ``-extfile`` for ``openssl x509 -req``."""
    usages = []
    if spec.server:
        usages.append("serverAuth")
    if spec.client:
        usages.append("clientAuth")
    if not usages:
        raise ValueError(f"certificate {spec.name} must be for server and/or client use")
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={','.join(usages)}",
    ]
    sans = [f"DNS:{d}" for d in spec.dns_names] + [f"IP:{ip}" for ip in spec.ip_addresses]
    if sans:
        lines.append(f"subjectAltName={','.join(sans)}")
    return "\n".join(lines) + "\n"


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise PkiError("openssl not found on PATH (apt-get install openssl)")
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PkiError(f"openssl {' '.join(args[:2])} failed: {proc.stderr.strip()}")


def ensure_ca(directory: Path, *, common_name: str = "sparsegate-local-ca") -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    crt, key = directory / "ca.crt", directory / "ca.key"
    if not (crt.exists() and key.exists()):
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key.name, "-out", crt.name, "-days", str(DAYS), "-subj", f"/CN={common_name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
            cwd=directory,
        )
    return crt, key


def ensure_cert(directory: Path, spec: CertSpec) -> tuple[Path, Path]:
    """Signs ``spec`` with the CA in ``directory`` (created by :func:`ensure_ca`)."""
    crt, key = directory / f"{spec.name}.crt", directory / f"{spec.name}.key"
    if crt.exists() and key.exists():
        return crt, key
    csr, ext = directory / f"{spec.name}.csr", directory / f"{spec.name}.ext"
    ext.write_text(extensions(spec))
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key.name, "-out", csr.name,
        "-subj", subject(common_name=spec.common_name, organizations=spec.organizations),
        cwd=directory,
    )
    _openssl(
        "x509", "-req", "-in", csr.name, "-CA", "ca.crt", "-CAkey", "ca.key",
        "-set_serial", "0x" + secrets.token_hex(16), "-days", str(DAYS),
        "-extfile", ext.name, "-out", crt.name,
        cwd=directory,
    )
    csr.unlink()
    ext.unlink()
    return crt, key


def ensure_service_account_keys(directory: Path) -> tuple[Path, Path]:
    """RSA key pair the API server verifies and the controller-manager signs tokens with."""
    directory.mkdir(parents=True, exist_ok=True)
    key, pub = directory / "sa.key", directory / "sa.pub"
    if not key.exists():
        _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", key.name, cwd=directory)
    if not pub.exists():
        _openssl("pkey", "-in", key.name, "-pubout", "-out", pub.name, cwd=directory)
    return key, pub
