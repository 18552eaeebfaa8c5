"""Admin credentials on disk the way a kubelet lays out a Secret volume, for the server tests.

A kubelet writes each version of a Secret into a fresh timestamped directory, points the
``..data`` symlink at it with one atomic rename, and each key is a symlink ``key -> ..data/key``.
:func:`write_secret_volume` does the same, so the server's reload is tested against the real swap.
"""

from __future__ import annotations

import datetime
import os
import uuid
from pathlib import Path

from sparsegate.domain import admin_tls
from sparsegate_contracts import names

SERVER_NAME = names.admin_server_name(model="m", namespace="ns")


def write_secret_volume(root: Path, *, token: str, server_name: str = SERVER_NAME,
                        files: dict[str, str] | None = None) -> str:
    """(Re)write the volume at ``root`` with a fresh certificate for ``server_name`` (or exactly
    ``files``, key -> text); returns the certificate PEM."""
    if files is None:
        cert_pem, key_pem = admin_tls.issue(server_name=server_name,
                                            now=datetime.datetime.now(datetime.timezone.utc))
        files = {names.ADMIN_TOKEN_KEY: token, names.ADMIN_TLS_CERT_KEY: cert_pem,
                 names.ADMIN_TLS_KEY_KEY: key_pem}
    root.mkdir(parents=True, exist_ok=True)
    version = root / f"..{uuid.uuid4().hex}"
    version.mkdir()
    for key, text in files.items():
        (version / key).write_text(text)
    tmp = root / "..data_tmp"
    os.symlink(version.name, tmp)
    os.replace(tmp, root / "..data")  # the atomic swap
    for key in files:
        link = root / key
        if not link.is_symlink():
            os.symlink(f"..data/{key}", link)
    return files.get(names.ADMIN_TLS_CERT_KEY, "")


def paths(root: Path) -> tuple[str, str, str]:
    return (str(root / names.ADMIN_TOKEN_KEY), str(root / names.ADMIN_TLS_CERT_KEY),
            str(root / names.ADMIN_TLS_KEY_KEY))


async def admin_call(method: str, port: int, *, cert_pem: str, token: str | None, body: object = None,
                     server_name: str = SERVER_NAME, host: str = "127.0.0.1") -> tuple[int, object]:
    """One admin request the way the operator makes it: a fresh TLS connection trusting
    ``cert_pem`` alone, ``server_name`` checked; returns (status, JSON body)."""
    import ssl

    import aiohttp

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=cert_pem)
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.request(method, f"https://{host}:{port}/admin/gate", json=body, headers=headers,
                                   ssl=ctx, server_hostname=server_name) as resp:
            return resp.status, await resp.json()
