"""The pod runner gives each Running model pod a real process on its loopback pod IP, and takes
it away with the pod. The process here is ``python -m http.server`` (the runner's command is a
template), serving the runner's per-pod directory, so the gate file it wrote is fetchable."""

from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from localcluster.health import wait_for

pytestmark = pytest.mark.e2e

HTTP_SERVER = "{python} -m http.server --bind {host} {port}"



def model_objects(model: str, *, replicas: int, gate: dict, token: str, args: list[str] | None = None) -> str:
    """The objects the operator makes for a SparseModel (dev/CONTRACTS.md), written by hand;
    ``args`` are the container's args (the operator renders the server flags there)."""
    labels = {"app.kubernetes.io/name": "sparsegate-model", "sparsegate.dev/model": model}
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{model}-gate"}, "data": {"gate.json": json.dumps(gate)}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{model}-admin"}, "stringData": {"token": token}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": model, "labels": labels}, "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "containers": [{
                    "name": "server", "image": "sparsegate/model:dev",
                    "ports": [{"name": "http", "containerPort": 18080}],
                    "env": [{"name": "SPARSEGATE_ADMIN_TOKEN",
                             "valueFrom": {"secretKeyRef": {"name": f"{model}-admin", "key": "token"}}}],
                    "volumeMounts": [{"name": "gate", "mountPath": "/etc/sparsegate", "readOnly": True}],
                    **({"args": args} if args is not None else {}),
                }],
                "volumes": [{"name": "gate", "configMap": {"name": f"{model}-gate"}}],
            }},
        }},
    ]})


def pod_ips(kubectl, namespace: str, model: str) -> list[str]:
    pods = json.loads(kubectl("get", "pods", "-n", namespace, "-l", f"sparsegate.dev/model={model}", "-o", "json").stdout)["items"]
    return sorted(p["status"].get("podIP", "") for p in pods if p["status"].get("phase") == "Running")


def fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.read().decode()
    except OSError:
        return None


def environ_of(pid_file: Path) -> dict[str, str]:
    pid = int(pid_file.read_text().split()[0])
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_runner_starts_a_process_per_pod_and_stops_it_with_the_pod(cluster, kubectl, namespace, pod_runner) -> None:
    gate = {"version": "g-000000000001", "checksum": "sha256:00", "params": {"toolGateThreshold": 0.85}}
    kubectl("apply", "-n", namespace, "-f", "-", input=model_objects("m1", replicas=2, gate=gate, token="t0ken"))
    kubectl("rollout", "status", "-n", namespace, "deployment/m1", "--timeout=90s", timeout=120)
    ips = pod_ips(kubectl, namespace, "m1")
    assert len(ips) == 2 and all(ipaddress.ip_address(ip) in ipaddress.ip_network(cluster.pod_cidr) for ip in ips)

    work = pod_runner(command=HTTP_SERVER)

    # Then each pod IP answers on the container port, serving the gate file the runner wrote.
    for ip in ips:
        body = wait_for(lambda ip=ip: fetch(f"http://{ip}:18080/gate.json"), what=f"process on {ip}:18080")
        assert json.loads(body) == gate
    # and the admin token was resolved from the Secret into the process environment.
    pid_files = sorted(work.glob(f"{namespace}_m1-*/process.pid"))
    assert len(pid_files) == 2
    assert all(environ_of(p)["SPARSEGATE_ADMIN_TOKEN"] == "t0ken" for p in pid_files)

    # When the gate ConfigMap changes, the file is refreshed in place (as a kubelet would).
    gate2 = {**gate, "version": "g-000000000002"}
    kubectl("apply", "-n", namespace, "-f", "-", input=model_objects("m1", replicas=2, gate=gate2, token="t0ken"))
    wait_for(lambda: all(json.loads(fetch(f"http://{ip}:18080/gate.json") or "{}").get("version") == "g-000000000002"
                         for ip in ips), what="refreshed gate file")

    # When the Deployment scales to zero, the processes stop and the addresses go quiet.
    kubectl("scale", "-n", namespace, "deployment/m1", "--replicas=0")
    wait_for(lambda: not pod_ips(kubectl, namespace, "m1"), what="pods gone")
    wait_for(lambda: all(fetch(f"http://{ip}:18080/gate.json") is None for ip in ips), what="processes stopped")
    wait_for(lambda: not list(work.glob(f"{namespace}_m1-*/process.pid")), what="pid files removed")


def request(url: str, *, method: str = "GET", body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, {}


def cmdline_of(pid_file: Path) -> list[str]:
    pid = int(pid_file.read_text().split()[0])
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


def test_runner_runs_the_real_model_server_with_gate_and_admin_token(kubectl, namespace, pod_runner) -> None:
    from sparsegate.domain import render
    from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document

    # Given a SparseModel whose shape is not the server's default, the container args the
    # operator renders for it (--host=$(POD_IP) --port 18080 --gate-config ... + shape flags).
    sparse_model = {"metadata": {"name": "m2", "namespace": namespace, "uid": "u"},
                    "spec": {"image": "sparsegate/model:dev", "servingPort": 18080,
                             "model": {"dModel": 96, "experts": 6, "minExpertsPerToken": 1, "maxExpertsPerToken": 3}}}
    doc = make_document({**DEFAULT_PARAMS, "toolGateThreshold": 0.8})
    (container,) = render.render_deployment(sparse_model, doc)["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "--d-model" in args and "--host=$(POD_IP)" in args
    doc = doc.to_json()
    kubectl("apply", "-n", namespace, "-f", "-", input=model_objects("m2", replicas=1, gate=doc, token="adm1n", args=args))
    kubectl("rollout", "status", "-n", namespace, "deployment/m2", "--timeout=90s", timeout=120)
    (ip,) = pod_ips(kubectl, namespace, "m2")

    work = pod_runner()  # default command: python -m sparsegate_workload.server ... {pod_args}

    def probe(path: str) -> dict | None:
        try:
            status, body = request(f"http://{ip}:18080{path}")
        except OSError:
            return None
        return body if status == 200 else None

    # The model loads after the port opens: wait for /readyz, not just /healthz.
    ready = wait_for(lambda: probe("/readyz"), what=f"model server ready on {ip}:18080", timeout_s=120)
    assert ready["gateVersion"] == doc["version"]
    health = probe("/healthz")
    assert health["gateVersion"] == doc["version"]
    # Then the server built the SparseModel's shape, from the pod's args ...
    spec_shape = sparse_model["spec"]["model"]
    assert {k: health["model"][k] for k in spec_shape} == spec_shape
    assert probe("/v1/model")["model"] == health["model"]
    # ... run as the pod said, except the flags the runner owns: bound to the pod IP it was given.
    (pid_file,) = work.glob(f"{namespace}_m2-*/process.pid")
    cmd = cmdline_of(pid_file)
    assert cmd[cmd.index("--host") + 1] == ip and "0.0.0.0" not in cmd
    assert cmd[cmd.index("--d-model") + 1] == "96" and cmd[cmd.index("--experts") + 1] == "6"
    # A gate asking for more experts than the model's 6 is refused and not applied.
    too_many = make_document({**DEFAULT_PARAMS, "maxExpertsPerToken": 8}).to_json()
    assert request(f"http://{ip}:18080/admin/gate", method="PUT", body=too_many, token="adm1n")[0] == 422
    assert probe("/healthz")["gateVersion"] == doc["version"]
    # The admin token came from the Secret: a PUT without it is refused, with it accepted.
    new_doc = make_document({**DEFAULT_PARAMS, "toolGateThreshold": 0.7}).to_json()
    assert request(f"http://{ip}:18080/admin/gate", method="PUT", body=new_doc)[0] in (401, 403)
    assert request(f"http://{ip}:18080/admin/gate", method="PUT", body=new_doc, token="adm1n")[0] == 200
    assert (probe("/healthz") or {}).get("gateVersion") == new_doc["version"]

    kubectl("delete", "-n", namespace, "deployment/m2")
    wait_for(lambda: probe("/healthz") is None, what="model server stopped with its pod")
