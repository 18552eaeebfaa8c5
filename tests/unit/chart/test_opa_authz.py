"""The chart's OPA sidecar, for real: its authz policy under `opa test`, then OPA 1.22 started with
exactly the args, env and policy file the chart renders, driven by the operator's OPA client.

The second half is the operator ↔ OPA contract end to end, without a cluster. The pod IP is a
loopback address and the port is free, as in the local cluster, and `$(POD_IP)` is expanded the way
the kubelet does it. Needs the real opa and helm binaries (fails, never skips, without them).
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from localcluster.binaries import find_binary
from localcluster.ports import free_port
from test_helm_chart import CHART, containers, env_of, render

from sparsegate.clients.opa import OpaUnavailable, RoutingOpa
from sparsegate.domain.policy import DEFAULT_TRUST_DOMAIN, build_opa_data
from sparsegate_contracts import rego

FILES = CHART / "files"
POD_IP = "127.0.0.1"


def _opa() -> str:
    return str(find_binary("opa"))  # a missing binary errors with the command that builds it


@pytest.mark.opa
def test_authz_policy_tests_pass_and_cover_it() -> None:
    run = subprocess.run([_opa(), "test", str(FILES), "-v"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    passed = re.search(r"PASS: (\d+)/(\d+)", run.stdout)
    assert passed and passed.group(1) == passed.group(2) and int(passed.group(1)) >= 7, run.stdout
    cov = subprocess.run([_opa(), "test", str(FILES), "--coverage", "--format", "json"],
                         capture_output=True, text=True, timeout=120)
    report = json.loads(cov.stdout)
    (authz,) = [v for k, v in report["files"].items() if k.endswith("opa-authz.rego")]
    assert authz["coverage"] == 100, authz.get("not_covered")


@pytest.mark.opa
def test_authz_policy_is_formatted_and_v1() -> None:
    fmt = subprocess.run([_opa(), "fmt", "--list", "--fail", str(FILES)], capture_output=True, text=True)
    assert fmt.returncode == 0, f"not `opa fmt`-clean: {fmt.stdout}{fmt.stderr}"
    check = subprocess.run([_opa(), "check", "--strict", str(FILES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


@pytest.fixture
def sidecar(tmp_path):
    """OPA run from the chart's rendered sidecar: (operator env as the kubelet would set it, token)."""
    port = free_port(host=POD_IP)
    docs = render(None, "--set", f"opa.port={port}", "--set", "opa.logLevel=error")
    byname = containers(docs, "Deployment")
    opa, operator = byname["opa"], byname["operator"]
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    token = base64.b64decode(secret["data"]["token"]).decode()
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    # The ConfigMap's files where the volume mounts them (the chart mounts /policies).
    (mount,) = opa["volumeMounts"]
    for key, text in cm["data"].items():
        (tmp_path / key).write_text(text)
    values = {"POD_IP": POD_IP, "SPARSEGATE_OPA_TOKEN": token}
    # The sidecar's whole env: these two and its Go collector settings (run with them here too).
    values.update({e["name"]: e["value"] for e in opa["env"] if e["name"] in ("GOGC", "GOMEMLIMIT")})
    assert set(env_of(opa)) == set(values) == {"POD_IP", "SPARSEGATE_OPA_TOKEN", "GOGC", "GOMEMLIMIT"}
    args = [_expand(a, values).replace(mount["mountPath"], str(tmp_path)) for a in opa["args"]]
    proc = subprocess.Popen([_opa(), *args], env={**values, "PATH": os.environ.get("PATH", "")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://{POD_IP}:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=0.5) as r:  # the readiness probe
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "OPA sidecar not healthy"
                time.sleep(0.05)
        operator_env = {"POD_IP": POD_IP}
        for e in operator["env"]:
            if "value" in e:
                operator_env[e["name"]] = _expand(e["value"], operator_env)
        operator_env["SPARSEGATE_OPA_TOKEN"] = token  # the same secretKeyRef (test_helm_chart checks)
        yield operator_env, token
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _status(url: str, *, token: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.opa
async def test_operator_and_sidecar_agree_on_address_and_token(sidecar) -> None:
    env, token = sidecar
    url = env["SPARSEGATE_OPA_URL"]
    assert url.startswith(f"http://{POD_IP}:")
    # probes need no token; anything else does
    assert _status(f"{url}/health") == 200
    assert _status(f"{url}/v1/data") == 401 and _status(f"{url}/v1/policies") == 401
    assert _status(f"{url}/v1/data", token="wrong") == 401
    assert _status(f"{url}/v1/data", token=token) == 200

    rego_text = rego.routing_policy()
    data, _ = build_opa_data(sources=[], trust_domain=DEFAULT_TRUST_DOMAIN, rego=rego_text)
    opa = RoutingOpa(url=url, token=env["SPARSEGATE_OPA_TOKEN"])
    try:
        assert await opa.revision() is None  # fresh OPA: nothing loaded
        await opa.push(rego=rego_text, data=data)
        assert await opa.revision() == data["revision"]
        source = {"namespace": "ml", "serviceAccount": "client"}
        target = {"namespace": "ml", "sparseModel": "moe-small", "port": 8080}
        (answer,) = await opa.decide_many([{"source": source, "target": target}])
        assert answer["allow"] is False  # default deny, decided by the real policy
    finally:
        opa.close()

    stranger = RoutingOpa(url=url, retries=0)
    try:
        with pytest.raises(OpaUnavailable, match="token"):
            await stranger.revision()
        with pytest.raises(OpaUnavailable, match="token"):
            await stranger.push(rego="package sparsegate.routing\n\ndata_revision := \"forged\"\n", data={})
    finally:
        stranger.close()
