"""The admin channel end to end: gate pushes over TLS to the model's own pods only, and rotation.

Given the dev stack (chart + operator in-cluster under the chart's RBAC, pods' containers run from
their images by the pod runner) and a SparseModel of two pods, when

1. a pod that carries the model's labels but is not owned by the model's ReplicaSet runs beside
   them (an impostor: the model-server image running a recorder that answers /healthz like a model
   server and logs the Authorization header of every request on its TLS "admin" port, with a
   certificate that names the model but a key of its own),
2. the GateConfig changes, then the rollout reaches Succeeded with both real pods on the new
   version, the impostor's log shows no admin request at all (so no token), and the GateConfig
   carries a Warning Event ``AdminTokenWithheld`` naming it;
3. Secret ``<model>-admin`` is replaced with a new token and certificate (what an administrator
   rotating it does), the running pods present the new certificate and accept only the new token
   without restarting, and the next rollout still succeeds.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import time

import aiohttp
import yaml

from localcluster.health import wait_for

from operator_e2e_support import get_json
from sparsegate.clients.admin_credentials import client_context
from sparsegate.domain import admin_tls
from sparsegate.domain.rollout import GateVersion
from sparsegate_contracts import names

MODEL, GATE = "adm", "adm-gate"
READY_S = 300
PARAMS = {"toolGateThreshold": 0.85, "entropyBeta": 0.1, "confidenceThreshold": 0.6, "capacityFactor": 1.25,
          "minExpertsPerToken": 1, "maxExpertsPerToken": 4, "precisionPolicy": "auto"}

# The impostor: /healthz on 8080 as a model server would answer (the stable version), and a TLS
# listener on 8443 that prints every request's Authorization header, then answers like the server.
RECORDER = r'''
import json, os, ssl, sys
from aiohttp import web
ip, version, checksum = os.environ["POD_IP"], os.environ["VERSION"], os.environ["CHECKSUM"]
async def healthz(_):
    return web.json_response({"status": "ok", "gateVersion": version, "checksum": checksum, "uptimeSeconds": 1})
async def record(request):
    print("ADMIN-REQUEST", request.method, request.path, "auth=" + request.headers.get("Authorization", ""), flush=True)
    return web.json_response({"version": version})
async def main():
    plain = web.Application(); plain.router.add_get("/healthz", healthz)
    admin = web.Application(); admin.router.add_route("*", "/{tail:.*}", record)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain("/tls/tls.crt", "/tls/tls.key")
    for app, port, tls in ((plain, 8080, None), (admin, 8443, ctx)):
        runner = web.AppRunner(app); await runner.setup(); await web.TCPSite(runner, ip, port, ssl_context=tls).start()
    print("RECORDER-READY", flush=True)
    import asyncio; await asyncio.Event().wait()
import asyncio; asyncio.run(main())
'''


def gateconfig(params: dict, *, promote: bool = False) -> dict:
    # No load runs here, so analysis would stay inconclusive: the promote annotation sends the new
    # version to every pod at once, through the same pushes. Applied with the manifest it is declared
    # (kubectl's last-applied copy): it acts once per value and stays, so each rollout gets its own.
    value = f"now-{GateVersion.from_params(params).version}"
    meta = {"name": GATE, **({"annotations": {"sparsegate.dev/promote": value}} if promote else {})}
    return {"apiVersion": names.API_VERSION, "kind": "GateConfig", "metadata": meta,
            "spec": {"params": params, "rollout": {"steps": [50, 100], "analysisInterval": "2s",
                                                     "slaP99LatencyMs": 5000, "maxDrift": 1.0, "autoRollback": True}}}


def sparsemodel() -> dict:
    return {"apiVersion": names.API_VERSION, "kind": "SparseModel", "metadata": {"name": MODEL},
            "spec": {"replicas": 2, "model": {"dModel": 64, "experts": 8, "minExpertsPerToken": 1,
                                              "maxExpertsPerToken": 4},
                     "servingPort": 8080, "gateConfigRef": {"name": GATE}}}


def apply(stack, ns: str, *objs: dict) -> None:
    stack.kubectl("apply", "-n", ns, "-f", "-", input="\n---\n".join(yaml.safe_dump(o) for o in objs))


def model_pods(stack, ns: str) -> list[dict]:
    return [p for p in get_json(stack, "pods", "-n", ns, "-l", f"{names.MODEL_LABEL}={MODEL}")["items"]
            if any(r.get("kind") == "ReplicaSet" for r in p["metadata"].get("ownerReferences") or [])]


def healthz_version(pod: dict) -> str | None:
    """The gate version the pod's /healthz reports; None when it does not answer in 3 s."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/healthz", timeout=3) as resp:
            return json.loads(resp.read())["gateVersion"]
    except OSError as e:
        print(f"[admin e2e] /healthz of {pod['metadata']['name']}: {type(e).__name__}: {e}")
        return None


def answered_versions(pods: list[dict], *, patience_s: float = 30.0) -> set[str]:
    """The versions the pods report, each asked until it answers (for up to ``patience_s``): a pod
    that does not answer at all fails here; a wrong version fails the caller's comparison. (Once, in
    the full suite on 2 loaded cores, one pod did not answer a single ask after the rotation.)"""
    versions = set()
    for pod in pods:
        version = wait_for(lambda: healthz_version(pod), what=f"/healthz of {pod['metadata']['name']}",
                           timeout_s=patience_s, interval_s=1.0)
        versions.add(version)
    return versions


def serving(pod: dict) -> bool:
    """/readyz 200: the model is built (/healthz answers before that, admin GET would be 503)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8080/readyz", timeout=3) as resp:
            return resp.status == 200
    except OSError:
        return False


def secret_material(stack, ns: str) -> admin_tls.AdminMaterial:
    return admin_tls.material_from_secret(get_json(stack, "secret", f"{MODEL}-admin", "-n", ns))


def admin_get(pod: dict, *, ns: str, cert_pem: str, token: str) -> int | str:
    """GET /admin/gate the operator's way: TLS trusting only ``cert_pem``, the model's server name.
    Returns the status, or the name of the TLS/connection error."""
    async def call() -> int:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            async with session.get(f"https://{pod['status']['podIP']}:{names.DEFAULT_ADMIN_PORT}/admin/gate",
                                   ssl=client_context(cert_pem),
                                   server_hostname=names.admin_server_name(model=MODEL, namespace=ns),
                                   headers={"Authorization": f"Bearer {token}"},
                                   timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status
    try:
        return asyncio.run(call())
    except (aiohttp.ClientError, OSError) as e:
        return type(e).__name__


def rollout_to(stack, ns: str, params: dict, *, timeout_s: float = 180) -> str:
    version = GateVersion.from_params(params).version
    apply(stack, ns, gateconfig(params, promote=True))

    def done() -> bool:
        ro = (get_json(stack, "gateconfig", GATE, "-n", ns).get("status") or {})
        return ((ro.get("stable") or {}).get("version") == version
                and (ro.get("rollout") or {}).get("phase") == "Succeeded")

    wait_for(done, what=f"rollout to {version} Succeeded", timeout_s=timeout_s, interval_s=1.0)
    return version


def test_pushes_reach_owned_pods_over_tls_never_an_impostor_and_survive_rotation(stack, stack_namespace):
    ns = stack_namespace
    t0 = time.monotonic()
    apply(stack, ns, gateconfig(PARAMS), sparsemodel())
    wait_for(lambda: len(model_pods(stack, ns)) == 2 and all(serving(p) for p in model_pods(stack, ns)),
             what="2 model servers Ready", timeout_s=READY_S, interval_s=1.0)
    pods = model_pods(stack, ns)
    material = secret_material(stack, ns)
    assert admin_tls.certificate_names(material.cert_pem) == [names.admin_server_name(model=MODEL, namespace=ns)]
    # The inference port serves no admin route; the admin port speaks TLS and wants the token for GET.
    import urllib.error
    import urllib.request
    try:
        urllib.request.urlopen(f"http://{pods[0]['status']['podIP']}:8080/admin/gate", timeout=5)
        raise AssertionError("the inference port answered /admin/gate")
    except urllib.error.HTTPError as e:
        assert e.code == 404
    assert admin_get(pods[0], ns=ns, cert_pem=material.cert_pem, token="wrong") == 403
    assert admin_get(pods[0], ns=ns, cert_pem=material.cert_pem, token=material.token) == 200
    print(f"[admin e2e] model serving {time.monotonic() - t0:.1f}s after apply")

    # The impostor: the model's labels, the model's server name in a certificate of its own.
    stable = GateVersion.from_params(PARAMS)
    image = get_json(stack, "deployment", MODEL, "-n", ns)["spec"]["template"]["spec"]["containers"][0]
    cert, key = admin_tls.issue(server_name=names.admin_server_name(model=MODEL, namespace=ns),
                                now=datetime.datetime.now(datetime.timezone.utc))
    impostor_secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "impostor-tls"},
                       "data": {"tls.crt": base64.b64encode(cert.encode()).decode(),
                                "tls.key": base64.b64encode(key.encode()).decode()}}
    impostor = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "impostor", "labels": {names.NAME_LABEL: names.MODEL_SERVER_NAME,
                                                            names.MODEL_LABEL: MODEL}},
                "spec": {"containers": [{
                    "name": "server", "image": image["image"], "imagePullPolicy": image.get("imagePullPolicy", "Never"),
                    "command": ["python", "-c", RECORDER],
                    "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {"name": "VERSION", "value": stable.version},
                            {"name": "CHECKSUM", "value": stable.document()["checksum"]}],
                    "ports": [{"name": "http", "containerPort": 8080}, {"name": "admin", "containerPort": 8443}],
                    "volumeMounts": [{"name": "tls", "mountPath": "/tls", "readOnly": True}]}],
                    "volumes": [{"name": "tls", "secret": {"secretName": "impostor-tls"}}]}}
    apply(stack, ns, impostor_secret, impostor)

    def impostor_log() -> str:
        pod = get_json(stack, "pod", "impostor", "-n", ns)
        return stack.logs(pod, "server", lines=200)

    wait_for(lambda: healthz_version(get_json(stack, "pod", "impostor", "-n", ns)) == stable.version,
             what="the impostor answering /healthz", timeout_s=120, interval_s=1.0)

    # A rollout: both real pods get the new version; the impostor gets nothing.
    v2 = rollout_to(stack, ns, {**PARAMS, "toolGateThreshold": 0.8})
    assert answered_versions(model_pods(stack, ns)) == {v2}
    assert "ADMIN-REQUEST" not in impostor_log()
    # The recorder records (so the absence above means something): a request of our own shows up.
    imp = get_json(stack, "pod", "impostor", "-n", ns)
    assert admin_get(imp, ns=ns, cert_pem=cert, token="probe") == 200
    wait_for(lambda: "auth=Bearer probe" in impostor_log(), what="the impostor's log of our probe", timeout_s=30)
    assert impostor_log().count("ADMIN-REQUEST") == 1 and material.token not in impostor_log()
    events = get_json(stack, "events", "-n", ns, "--field-selector",
                      f"involvedObject.kind=GateConfig,involvedObject.name={GATE}")["items"]
    withheld = [e["message"] for e in events if e["reason"] == "AdminTokenWithheld"]
    assert withheld and "impostor" in withheld[0] and "no controller ReplicaSet" in withheld[0], events

    # Rotation: a new token and certificate in the Secret; the same pods pick them up, no restart.
    before = {p["metadata"]["uid"]: p["status"]["containerStatuses"][0]["restartCount"] for p in model_pods(stack, ns)}
    new = admin_tls.new_material(server_name=names.admin_server_name(model=MODEL, namespace=ns),
                                 now=datetime.datetime.now(datetime.timezone.utc))
    secret = get_json(stack, "secret", f"{MODEL}-admin", "-n", ns)
    secret["data"] = new.secret_data()
    t_rotate = time.monotonic()
    stack.kubectl("replace", "-n", ns, "-f", "-", input=json.dumps(secret))

    def rotated() -> bool:
        return all(admin_get(p, ns=ns, cert_pem=new.cert_pem, token=new.token) == 200 for p in model_pods(stack, ns))

    wait_for(rotated, what="pods presenting the new certificate and accepting the new token", timeout_s=120,
             interval_s=1.0)
    print(f"[admin e2e] rotation visible on every pod {time.monotonic() - t_rotate:.1f}s after the Secret changed")
    for p in model_pods(stack, ns):
        assert admin_get(p, ns=ns, cert_pem=new.cert_pem, token=material.token) == 403  # old token: refused
        assert admin_get(p, ns=ns, cert_pem=material.cert_pem, token=material.token) == "ClientConnectorCertificateError"
    v3 = rollout_to(stack, ns, {**PARAMS, "toolGateThreshold": 0.75})
    after = {p["metadata"]["uid"]: p["status"]["containerStatuses"][0]["restartCount"] for p in model_pods(stack, ns)}
    assert after == before  # same pods, no container restarted
    assert answered_versions(model_pods(stack, ns)) == {v3}
    assert impostor_log().count("ADMIN-REQUEST") == 1  # still only our probe
    stack.kubectl("delete", "pod", "impostor", "-n", ns, "--wait=false")
