"""The model server's admin listener for real: TLS with a certificate the operator's builder issued,
the Bearer token on GET and PUT, and rotation by rewriting the Secret volume's files the way a
kubelet does (``..data`` symlink swap) while the server runs.

In-process aiohttp (the inference app on one port, its admin listener on another); every admin
call opens a fresh TLS connection that trusts exactly one certificate, as the operator's do.
"""

from __future__ import annotations

import aiohttp
import pytest
from admin_files import admin_call, paths, write_secret_volume
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_contracts import names
from sparsegate_workload.admin import AdminFiles
from sparsegate_workload.gateparams import DEFAULT_DOCUMENT, DEFAULT_PARAMS, make_document
from sparsegate_workload.server import AdminListener, create_app, wait_ready
from localcluster.ports import free_port

V1 = make_document({**DEFAULT_PARAMS, "toolGateThreshold": 0.7}).to_json()
V2 = make_document({**DEFAULT_PARAMS, "toolGateThreshold": 0.6}).to_json()


@pytest.fixture
async def served(tmp_path):
    """(inference client, admin port, volume dir, AdminFiles, first certificate PEM)."""
    volume = tmp_path / "admin"
    cert = write_secret_volume(volume, token="token-1")
    token_file, cert_file, key_file = paths(volume)
    files = AdminFiles(token_file=token_file, cert_file=cert_file, key_file=key_file)
    port = free_port()
    app = create_app(admin=AdminListener(host="127.0.0.1", port=port, files=files))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        await wait_ready(app)
        yield client, port, volume, files, cert


async def test_get_and_put_need_the_token_over_tls(served) -> None:
    client, port, _, _, cert = served
    assert (await admin_call("GET", port, cert_pem=cert, token=None))[0] == 401
    status, body = await admin_call("GET", port, cert_pem=cert, token="wrong")
    assert status == 403 and "invalid admin token" in body["error"]
    assert (await admin_call("PUT", port, cert_pem=cert, token="wrong", body=V1))[0] == 403
    status, body = await admin_call("GET", port, cert_pem=cert, token="token-1")
    assert status == 200 and body["version"] == DEFAULT_DOCUMENT.version
    status, body = await admin_call("PUT", port, cert_pem=cert, token="token-1", body=V1)
    assert status == 200 and body["version"] == V1["version"] and body["applied"]
    assert (await (await client.get("/healthz")).json())["gateVersion"] == V1["version"]
    # The inference port knows no admin route.
    assert (await client.get("/admin/gate", headers={"Authorization": "Bearer token-1"})).status == 404


async def test_plain_http_on_the_admin_port_gets_nothing(served) -> None:
    _, port, _, _, _ = served
    async with aiohttp.ClientSession() as session:
        # The TLS listener drops a plain-HTTP client during the handshake: no answer at all.
        with pytest.raises(aiohttp.ClientError):
            async with session.get(f"http://127.0.0.1:{port}/admin/gate",
                                   headers={"Authorization": "Bearer token-1"}):
                pass


async def test_another_models_certificate_or_name_is_refused_by_the_client(served, tmp_path) -> None:
    _, port, _, _, cert = served
    other = write_secret_volume(tmp_path / "other", token="x",
                                server_name=names.admin_server_name(model="other", namespace="ns"))
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await admin_call("GET", port, cert_pem=other, token="token-1",
                         server_name=names.admin_server_name(model="other", namespace="ns"))
    # The right certificate but checked for another model's name: refused as well.
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await admin_call("GET", port, cert_pem=cert, token="token-1",
                         server_name=names.admin_server_name(model="other", namespace="ns"))


async def test_rotating_the_files_rotates_token_and_certificate_without_restart(served) -> None:
    client, port, volume, files, old_cert = served
    started = (await (await client.get("/healthz")).json())["uptimeSeconds"]
    new_cert = write_secret_volume(volume, token="token-2")
    # The next TLS connection presents the new certificate: one trusting only the old is refused.
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await admin_call("GET", port, cert_pem=old_cert, token="token-1")
    assert (await admin_call("GET", port, cert_pem=new_cert, token="token-1"))[0] == 403
    status, body = await admin_call("PUT", port, cert_pem=new_cert, token="token-2", body=V2)
    assert status == 200 and body["version"] == V2["version"]
    assert files.reloads == 2
    # Same process all along.
    assert (await (await client.get("/healthz")).json())["uptimeSeconds"] >= started


async def test_a_half_written_update_keeps_the_previous_pair(served, tmp_path) -> None:
    """A certificate whose key has not arrived yet cannot load: the server keeps serving the
    previous pair and token, and loads the complete set once it is there."""
    _, port, volume, files, old_cert = served
    token_file, cert_file, key_file = paths(volume)
    other = write_secret_volume(tmp_path / "next", token="token-3")
    with open(key_file) as f:
        old_key = f.read()
    write_secret_volume(volume, token="", files={names.ADMIN_TOKEN_KEY: "token-3",
                                                 names.ADMIN_TLS_CERT_KEY: other,
                                                 names.ADMIN_TLS_KEY_KEY: old_key})
    status, _ = await admin_call("GET", port, cert_pem=old_cert, token="token-1")
    assert status == 200 and files.reloads == 1
    with open(paths(tmp_path / "next")[2]) as f:
        new_key = f.read()
    write_secret_volume(volume, token="", files={names.ADMIN_TOKEN_KEY: "token-3",
                                                 names.ADMIN_TLS_CERT_KEY: other,
                                                 names.ADMIN_TLS_KEY_KEY: new_key})
    assert (await admin_call("GET", port, cert_pem=other, token="token-3"))[0] == 200
    assert files.reloads == 2
