"""The admin channel's credentials and the owner check, as pure functions (no cluster, no network):
the per-model certificate and Secret builders, reading a Secret back, when the operator must
replace it, the credential store's caching by resourceVersion, and the pod → ReplicaSet →
Deployment → SparseModel chain."""

from __future__ import annotations

import base64
import datetime
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from sparsegate.clients.admin_credentials import AdminCredentialStore
from sparsegate.domain import admin_tls
from sparsegate.domain.pod_ownership import ownership_problem
from sparsegate_contracts import names

NOW = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)
NAME = names.admin_server_name(model="m", namespace="ns")


def test_server_name_names_model_and_namespace() -> None:
    assert NAME == "m.ns.admin.sparsegate.dev"


def test_certificate_is_a_p256_self_signed_server_cert_for_the_model(tmp_path) -> None:
    cert_pem, key_pem = admin_tls.issue(server_name=NAME, now=NOW)
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    assert cert.issuer == cert.subject
    assert admin_tls.certificate_names(cert_pem) == [NAME]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert cert.not_valid_after_utc - NOW == datetime.timedelta(days=365)
    assert cert.not_valid_before_utc < NOW  # backdated for clock skew
    assert "BEGIN PRIVATE KEY" in key_pem
    # A usable pair: a TLS server context loads it.
    (tmp_path / "c").write_text(cert_pem)
    (tmp_path / "k").write_text(key_pem)
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(tmp_path / "c", tmp_path / "k")


def test_two_issues_never_share_a_key() -> None:
    (_, k1), (_, k2) = admin_tls.issue(server_name=NAME, now=NOW), admin_tls.issue(server_name=NAME, now=NOW)
    assert k1 != k2


def secret_of(material: admin_tls.AdminMaterial, rv: str = "1", uid: str = "s-uid") -> dict:
    return {"metadata": {"name": "m-admin", "namespace": "ns", "resourceVersion": rv, "uid": uid},
            "data": material.secret_data()}


def test_secret_round_trip_and_problems() -> None:
    material = admin_tls.new_material(server_name=NAME, now=NOW)
    assert len(material.token) >= 40
    secret = secret_of(material)
    assert sorted(secret["data"]) == sorted(names.ADMIN_SECRET_KEYS)
    assert admin_tls.material_from_secret(secret) == material
    assert admin_tls.secret_problem(secret, server_name=NAME, now=NOW) is None
    assert "does not name" in admin_tls.secret_problem(secret, server_name="x.ns.admin.sparsegate.dev", now=NOW)
    assert "ends" in admin_tls.secret_problem(secret, server_name=NAME, now=NOW + datetime.timedelta(days=340))
    token_only = {"data": {"token": base64.b64encode(b"t").decode()}}
    assert admin_tls.secret_problem(token_only, server_name=NAME, now=NOW) == "missing key(s) tls.crt, tls.key"
    garbage = {"data": {**secret["data"], "tls.crt": base64.b64encode(b"not a cert").decode()}}
    assert admin_tls.secret_problem(garbage, server_name=NAME, now=NOW) is not None
    with pytest.raises(admin_tls.SecretError, match="base64"):
        admin_tls.material_from_secret({"data": {**secret["data"], "token": "***"}})


def test_a_key_of_another_pair_is_a_problem(tmp_path) -> None:
    """A hand edit that replaced tls.crt or tls.key alone: each file reads, but the server cannot
    load the pair (a new pod exits at start), so the operator must replace the Secret."""
    mine, other = admin_tls.new_material(server_name=NAME, now=NOW), admin_tls.new_material(server_name=NAME, now=NOW)
    mixed = secret_of(admin_tls.AdminMaterial(token=mine.token, cert_pem=mine.cert_pem, key_pem=other.key_pem))
    (tmp_path / "c").write_text(mine.cert_pem)
    (tmp_path / "k").write_text(other.key_pem)
    with pytest.raises(ssl.SSLError, match="KEY_VALUES_MISMATCH"):
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(tmp_path / "c", tmp_path / "k")
    assert admin_tls.secret_problem(mixed, server_name=NAME, now=NOW) == "tls.key is not the key of tls.crt"


def test_store_rebuilds_only_on_a_new_resource_version_and_keeps_the_previous_for_the_grace() -> None:
    clock = [0.0]
    store = AdminCredentialStore(grace_s=60, clock=lambda: clock[0])
    first = admin_tls.new_material(server_name=NAME, now=NOW)
    a = store.update(secret_of(first, rv="1"), namespace="ns", model="m", server_name=NAME)
    assert a.current is not None and a.current.token == first.token and a.previous is None
    assert a.current.server_name == NAME and a.current.ssl.verify_mode == ssl.CERT_REQUIRED
    assert a.current.ssl.check_hostname
    again = store.update(secret_of(first, rv="1"), namespace="ns", model="m", server_name=NAME)
    assert again.current is a.current  # same resourceVersion: same context, not rebuilt
    second = admin_tls.new_material(server_name=NAME, now=NOW)
    clock[0] = 10
    b = store.update(secret_of(second, rv="2"), namespace="ns", model="m", server_name=NAME)
    assert b.current.token == second.token and b.previous is a.current
    clock[0] = 71
    assert store.update(secret_of(second, rv="2"), namespace="ns", model="m", server_name=NAME).previous is None
    # Deleted: no credentials at all (the previous ones are not used as current).
    gone = store.update(None, namespace="ns", model="m", server_name=NAME)
    assert gone.current is None and "not found" in gone.error
    broken = store.update({"metadata": {"name": "m-admin", "resourceVersion": "9"},
                           "data": {"token": base64.b64encode(b"t").decode()}},
                          namespace="ns", model="m", server_name=NAME)
    assert broken.current is None and "missing key(s) tls.crt, tls.key" in broken.error
    # Models are kept apart.
    other = store.update(secret_of(first, rv="1"), namespace="ns", model="other", server_name=NAME)
    assert other.current.token == first.token and other.previous is None


# ------------------------------------------------------------------ owner chain

MODEL = {"metadata": {"name": "m", "namespace": "ns", "uid": "model-uid"}}


def ref(kind: str, name: str, uid: str, api: str, *, controller: bool = True) -> dict:
    return {"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": controller}


DEPLOYMENT = {"metadata": {"name": "m", "uid": "dep-uid",
                           "ownerReferences": [ref("SparseModel", "m", "model-uid", names.API_VERSION)]}}
RS = {"metadata": {"name": "m-abc", "uid": "rs-uid",
                   "ownerReferences": [ref("Deployment", "m", "dep-uid", "apps/v1")]}}


def pod(*owners: dict) -> dict:
    return {"metadata": {"name": "p", "labels": {names.MODEL_LABEL: "m"}, "ownerReferences": list(owners)}}


OWNED = pod(ref("ReplicaSet", "m-abc", "rs-uid", "apps/v1"))


def check(p: dict, *, replicasets: dict | None = None, deployment: dict | None = DEPLOYMENT,
          model: dict = MODEL) -> str | None:
    return ownership_problem(p, replicasets={"rs-uid": RS} if replicasets is None else replicasets,
                             deployment=deployment, model=model)


def test_a_pod_of_the_models_replicaset_is_the_models() -> None:
    assert check(OWNED) is None


@pytest.mark.parametrize("case, expected", [
    ("labels only", "no controller ReplicaSet"),
    ("owner not controller", "no controller ReplicaSet"),
    ("unknown replicaset uid", "not found"),
    ("replicaset of another deployment", "is not controlled by Deployment m"),
    ("deployment of another model", "is not controlled by SparseModel m"),
    ("model re-created (new uid)", "is not controlled by SparseModel m"),
    ("no deployment", "Deployment m not found"),
    ("owned by a Job", "no controller ReplicaSet"),
])
def test_anything_else_is_refused_with_the_reason(case: str, expected: str) -> None:
    kwargs: dict = {}
    p = OWNED
    if case == "labels only":
        p = pod()
    elif case == "owner not controller":
        p = pod(ref("ReplicaSet", "m-abc", "rs-uid", "apps/v1", controller=False))
    elif case == "unknown replicaset uid":
        p = pod(ref("ReplicaSet", "m-abc", "forged-uid", "apps/v1"))
    elif case == "replicaset of another deployment":
        kwargs["replicasets"] = {"rs-uid": {"metadata": {"name": "m-abc", "uid": "rs-uid", "ownerReferences": [
            ref("Deployment", "m", "other-dep-uid", "apps/v1")]}}}
    elif case == "deployment of another model":
        kwargs["deployment"] = {"metadata": {"name": "m", "uid": "dep-uid", "ownerReferences": [
            ref("SparseModel", "x", "x-uid", names.API_VERSION)]}}
    elif case == "model re-created (new uid)":
        kwargs["model"] = {"metadata": {"name": "m", "namespace": "ns", "uid": "new-uid"}}
    elif case == "no deployment":
        kwargs["deployment"] = None
    elif case == "owned by a Job":
        p = pod(ref("Job", "j", "rs-uid", "batch/v1"))
    problem = check(p, **kwargs)
    assert problem is not None and expected in problem


def test_a_certificate_not_valid_yet_is_a_problem(tmp_path) -> None:
    """Issued by a replica whose clock ran an hour ahead: TLS refuses it (not yet valid) for that
    hour, so every push to the model's pods failed while the Secret read as fine."""
    ahead = admin_tls.new_material(server_name=NAME, now=NOW + datetime.timedelta(hours=1))
    problem = admin_tls.secret_problem(secret_of(ahead), server_name=NAME, now=NOW)
    assert problem is not None and "not valid before" in problem
    # Within the backdating (a clock up to CLOCK_SKEW ahead) it is fine, as TLS finds it.
    slightly = admin_tls.new_material(server_name=NAME, now=NOW + datetime.timedelta(minutes=4))
    assert admin_tls.secret_problem(secret_of(slightly), server_name=NAME, now=NOW) is None
