"""PodAdmin.access / push_access against a real model server's TLS admin listener.

One real ``python -m sparsegate_workload.server`` process on loopback ports (certificate from the
operator's own builder), given an access document compiled by the operator's module: the pod
reports no rules, then the pushed revision; a wrong token, a malformed document and a certificate
for another model are refused with the reason and leave the held rules as they were.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterator

import pytest
from admin_model_server import admin_model_server

from sparsegate.clients.admin_credentials import client_context
from sparsegate.clients.podadmin import AdminCredentials, PodAdmin, PodTarget
from sparsegate.domain import access_sync, admin_tls
from sparsegate.domain.policy import PolicySource
from sparsegate_contracts import names

TOKEN = "access-admin-token"
SERVER_NAME = names.admin_server_name(model="moe", namespace="ml")
NOW = datetime.datetime.now(datetime.timezone.utc)
MODEL = {"metadata": {"namespace": "ml", "name": "moe"}, "spec": {"model": {"dModel": 64, "experts": 8}}}


def credentials(cert_pem: str, *, token: str = TOKEN, server_name: str = SERVER_NAME) -> AdminCredentials:
    return AdminCredentials(token=token, server_name=server_name, ssl=client_context(cert_pem), source="test")


def document(*callers: str) -> dict:
    sources = [PolicySource(namespace="ml", name=f"allow-{c}", generation=1,
                            spec={"action": "Allow", "sources": [{"serviceAccount": c}],
                                  "targets": [{"sparseModel": "moe"}]}) for c in callers]
    return access_sync.model_document(MODEL, sources, trust_domain="cluster.local")


@pytest.fixture(scope="module")
def cert_pem() -> tuple[str, str]:
    return admin_tls.issue(server_name=SERVER_NAME, now=NOW)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, cert_pem: tuple[str, str]) -> Iterator[PodTarget]:
    d = tmp_path_factory.mktemp("access-admin")
    with admin_model_server(d, token=TOKEN, cert=cert_pem[0], key=cert_pem[1]) as (port, admin_port):
        yield PodTarget(name="pod-a", ip="127.0.0.1", port=port, admin_port=admin_port,
                        admin=credentials(cert_pem[0]))


async def test_push_then_read_back_the_revision(server: PodTarget, cert_pem: tuple[str, str]) -> None:
    admin = PodAdmin(timeout_s=5)
    before = (await admin.access([server]))["pod-a"]
    assert before.error is None and before.revision is None  # a fresh pod holds no rules
    doc = document("caller-a")
    pushed = (await admin.push_access([(server, doc)]))["pod-a"]
    assert pushed.error is None and pushed.revision == doc["revision"]
    assert (await admin.access([server]))["pod-a"].revision == doc["revision"]

    # Refusals name the reason; the held rules stay.
    wrong_token = dataclasses.replace(server, admin=credentials(cert_pem[0], token="wrong"))
    refused = (await admin.push_access([(wrong_token, document("caller-b"))]))["pod-a"]
    assert refused.revision is None and "403" in refused.error
    malformed = {**document("caller-b"), "rules": [{"id": "x", "action": "maybe"}]}
    invalid = (await admin.push_access([(server, malformed)]))["pod-a"]
    assert invalid.revision is None and "422" in invalid.error and "rules" in invalid.error
    other = names.admin_server_name(model="other", namespace="ml")
    other_cert, _ = admin_tls.issue(server_name=other, now=NOW)
    pinned = dataclasses.replace(server, admin=credentials(other_cert, server_name=other))
    cert_refused = (await admin.push_access([(pinned, document("caller-b"))]))["pod-a"]
    assert cert_refused.revision is None and "certificate" in cert_refused.error
    assert (await admin.access([server]))["pod-a"].revision == doc["revision"]

    # A pod without credentials or admin port is not called at all.
    no_token = dataclasses.replace(server, admin=None, refusal="owner check failed")
    assert "owner check failed" in (await admin.access([no_token]))["pod-a"].error


async def test_previous_credentials_are_used_mid_rotation(server: PodTarget, cert_pem: tuple[str, str]) -> None:
    new_cert, _ = admin_tls.issue(server_name=SERVER_NAME, now=NOW)  # the pod still serves the old one
    rotating = dataclasses.replace(server, admin=credentials(new_cert), previous_admin=credentials(cert_pem[0]))
    doc = document("caller-a", "caller-c")
    answer = (await PodAdmin(timeout_s=5).push_access([(rotating, doc)]))["pod-a"]
    assert answer.error is None and answer.revision == doc["revision"]
