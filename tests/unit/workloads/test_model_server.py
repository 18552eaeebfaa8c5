"""Model server endpoints (in-process aiohttp server on 127.0.0.1), hot reload under load,
bad input, admin auth, fault injection, metrics; plus the real `python -m` entry point."""

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.inference import run_batch
from sparsegate_workload.model import build_model
from sparsegate_workload.admin import StaticToken
from sparsegate_workload.server import STATE, create_admin_app, create_app, wait_ready
from localcluster.ports import free_port

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

# Two versions whose effect is visible in every response: A routes each token to exactly one
# expert and fires the tool gate everywhere; B routes to exactly three and never fires it.
# capacityFactor 8 makes the cap (ceil(8 * A / 8) = A) unable to drop anything.
VERSION_A = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 1,
                           "capacityFactor": 8, "toolGateThreshold": 0.0})
VERSION_B = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 3, "maxExpertsPerToken": 3,
                           "capacityFactor": 8, "toolGateThreshold": 1.0})


@pytest.fixture
async def client():
    app = create_app(gate_doc=VERSION_A)
    async with TestClient(TestServer(app, host="127.0.0.1"),
                          connector=aiohttp.TCPConnector(limit=0)) as c:
        await wait_ready(app)
        yield c


@pytest.fixture
async def admin(client):
    """The admin app over the same state, served in-process without TLS (the TLS listener and
    token files are tested in test_admin_listener.py)."""
    async with TestClient(TestServer(create_admin_app(client.server.app, auth=StaticToken(TOKEN)),
                                     host="127.0.0.1")) as c:
        yield c


async def _infer(client, tokens, **extra):
    return await client.post("/v1/infer", json={"tokens": tokens, **extra})


async def test_probes_and_inference(client):
    health = await (await client.get("/healthz")).json()
    assert health["status"] == "ok" and health["gateVersion"] == VERSION_A.version
    assert health["checksum"] == VERSION_A.checksum and health["uptimeSeconds"] >= 0
    assert (await client.get("/readyz")).status == 200
    resp = await _infer(client, [[1, 2, 3, 4], [5, 6, 7, 8]], returnLogits=True)
    assert resp.status == 200
    body = await resp.json()
    assert body["gateVersion"] == VERSION_A.version and body["numTokens"] == 8
    assert len(body["nextTokens"]) == 2 and len(body["logits"]) == 2
    assert len(body["logits"][0]) == 512
    assert body["nextTokens"] == [max(range(512), key=row.__getitem__) for row in body["logits"]]
    assert [sum(c) for c in body["expertCounts"]] == [8, 8]  # exactly one expert per token
    assert body["activeExpertsPerToken"] == 1.0 and body["toolGateFireRate"] == 1.0
    assert body["toolCalls"] == [[0, 1, 2, 3], [0, 1, 2, 3]]


async def test_inference_matches_the_model_run_directly(client):
    tokens = [[10, 20, 30, 40, 50]]
    body = await (await _infer(client, tokens, returnLogits=True)).json()
    model = build_model()  # same seed -> same weights
    direct = run_batch(model, tokens, gate=VERSION_A.params, precisions=tuple(body["precisions"]),
                       return_logits=True)
    assert body["nextTokens"] == direct.next_tokens
    assert torch.allclose(torch.tensor(body["logits"]), torch.tensor(direct.last_logits),
                          atol=1e-5)
    assert body["expertCounts"] == direct.expert_counts


@pytest.mark.parametrize("payload, status, message", [
    ({"tokens": [[1, 2], [3]]}, 422, "tokens: all sequences must be non-empty and of equal length"),
    ({"tokens": [1, 2, 3]}, 422, "list of token-id lists"),
    ({"tokens": []}, 422, "non-empty"),
    ({"tokens": [[]]}, 422, "non-empty"),
    ({"tokens": [[1, 2.5]]}, 422, "tokens[0][1]: token ids must be integers, got 2.5"),
    ({"tokens": [[1, "2"]]}, 422, "integers"),
    ({"tokens": [[1, 2], [3, True]]}, 422, "tokens[1][1]: token ids must be integers"),
    ({"tokens": [[1, 512]]}, 422, "tokens[0][1]: token id 512 is outside the vocabulary"),
    ({"tokens": [[1, "x" * 5000]]}, 422, "got 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx..."),
    ({"tokens": [[-1]]}, 422, "outside the vocabulary"),
    ({"tokens": [[1] * 257]}, 413, "sequence length 257"),
    ({"tokens": [[1]] * 65}, 413, "batch of 65"),
    ({"tokens": [[1] * 100] * 41}, 413, "tokens exceed"),
    ({"tokens": [[1]], "extra": 1}, 422, "unknown fields: extra"),
    ({"toks": [[1]]}, 422, "unknown fields"),
    ([[1, 2]], 422, "JSON object"),
])
async def test_bad_input_gets_4xx_json(client, payload, status, message):
    resp = await client.post("/v1/infer", json=payload)
    assert resp.status == status
    assert message in (await resp.json())["error"]


async def test_return_logits_response_is_bounded():
    """returnLogits answers rows x vocab floats: with a large vocabulary 64 rows would be a
    response of hundreds of MB built in memory, so past MAX_RETURNED_LOGITS it is a 413 naming
    the field (a row is always allowed); without returnLogits the same batch is served."""
    from sparsegate_workload.model import ModelConfig

    vocab = 1 << 16  # 64 rows: 4M logits, ~85 MB of JSON
    app = create_app(model_config=ModelConfig(vocab_size=vocab, d_model=16, d_ff=32, n_layers=1, num_experts=4))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        await wait_ready(app)
        resp = await _infer(c, [[1]] * 64, returnLogits=True)
        assert resp.status == 413 and "returnLogits" in (await resp.json())["error"]
        resp = await _infer(c, [[1]] * 4, returnLogits=True)  # 2^18 logits: the limit
        assert resp.status == 200 and len((await resp.json())["logits"]) == 4
        assert (await _infer(c, [[1]] * 5, returnLogits=True)).status == 413
        assert (await _infer(c, [[1]] * 64)).status == 200


def test_request_timeout_must_be_finite_and_positive(monkeypatch, capsys):
    """float() parses "nan" and "inf": a NaN --request-timeout fired at once (every request 503), an
    infinite one never (and the SIGTERM drain waited for in-flight requests forever)."""
    from sparsegate_workload import server

    def serving(*args, **kwargs):
        raise AssertionError("the server would have started")

    monkeypatch.setattr(server, "create_app", serving)
    for timeout in ("nan", "inf", "0", "-1"):
        with pytest.raises(SystemExit):
            server.main(["--request-timeout", timeout])
        assert "--request-timeout a finite number above 0" in capsys.readouterr().err


async def test_readiness_fails_while_the_model_thread_is_stuck():
    """A model call that never returns (a hung kernel) makes every request behind it wait to its
    --request-timeout (503): /readyz turns 503 naming it once one call has run past twice that,
    so the pod leaves the Service's endpoints, and ready again once the thread is free."""
    import threading

    app = create_app(gate_doc=VERSION_A, request_timeout_s=0.2)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        await wait_ready(app)
        assert (await c.get("/readyz")).status == 200
        release = threading.Event()
        stuck = app[STATE].executor.submit(release.wait, 30)
        try:
            assert (await _infer(c, [[1, 2]])).status == 503  # waited 0.2 s behind it
            await asyncio.sleep(0.3)
            ready = await c.get("/readyz")
            assert ready.status == 503 and "model thread stuck" in (await ready.json())["reason"]
            assert (await c.get("/healthz")).status == 200
        finally:
            release.set()
        await asyncio.wrap_future(stuck)
        for _ in range(100):  # the request that timed out still runs its batch, then frees the thread
            if (await c.get("/readyz")).status == 200:
                break
            await asyncio.sleep(0.02)
        assert (await c.get("/readyz")).status == 200


async def test_bad_json_content_type_and_size(client):
    resp = await client.post("/v1/infer", data=b'{"tokens": [[1,2]',
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]
    resp = await client.post("/v1/infer", data=b"tokens=1", headers={"Content-Type": "text/plain"})
    assert resp.status == 415 and "application/json" in (await resp.json())["error"]
    resp = await client.post("/v1/infer", data=b"[" + b"1," * 600_000 + b"1]",
                             headers={"Content-Type": "application/json"})
    assert resp.status == 413 and "exceeds" in (await resp.json())["error"]
    resp = await client.get("/v1/infer")
    assert resp.status == 405 and "error" in await resp.json()


async def test_admin_endpoint_requires_the_bearer_token(client, admin):
    doc = VERSION_B.to_json()
    assert (await admin.put("/admin/gate", json=doc)).status == 401
    bad = await admin.put("/admin/gate", json=doc, headers={"Authorization": "Bearer nope"})
    assert bad.status == 403 and "invalid admin token" in (await bad.json())["error"]
    basic = await admin.put("/admin/gate", json=doc, headers={"Authorization": "Basic eDp5"})
    assert basic.status == 401
    # Reading the gate needs the token too.
    assert (await admin.get("/admin/gate")).status == 401
    assert (await admin.get("/admin/gate", headers={"Authorization": "Bearer nope"})).status == 403
    assert (await (await admin.get("/admin/gate", headers=AUTH)).json())["version"] == VERSION_A.version
    ok = await admin.put("/admin/gate", json=doc, headers=AUTH)
    assert ok.status == 200
    body = await ok.json()
    assert body["applied"] and body["previousVersion"] == VERSION_A.version
    assert (await (await admin.get("/admin/gate", headers=AUTH)).json())["version"] == VERSION_B.version
    again = await (await admin.put("/admin/gate", json=doc, headers=AUTH)).json()
    assert again["applied"] is False
    metrics = await (await client.get("/metrics")).text()
    assert 'sparsegate_gate_config_applies_total{result="applied"} 1.0' in metrics
    assert 'sparsegate_gate_config_applies_total{result="unchanged"} 1.0' in metrics
    # The swap reached the inference app: they share one state.
    assert (await (await client.get("/healthz")).json())["gateVersion"] == VERSION_B.version


async def test_inference_port_serves_no_admin_routes(client):
    for method in ("GET", "PUT"):
        resp = await client.request(method, "/admin/gate", json=VERSION_B.to_json(), headers=AUTH)
        assert resp.status == 404 and "error" in await resp.json()
    assert (await (await client.get("/healthz")).json())["gateVersion"] == VERSION_A.version


async def test_admin_disabled_without_configured_token(client):
    async with TestClient(TestServer(create_admin_app(client.server.app, auth=StaticToken(None)),
                                     host="127.0.0.1")) as c:
        resp = await c.put("/admin/gate", json=VERSION_B.to_json(), headers=AUTH)
        assert resp.status == 403 and "disabled" in (await resp.json())["error"]


async def test_invalid_gate_documents_are_rejected_and_not_applied(client, admin):
    tampered = VERSION_B.to_json()
    tampered["params"] = {**tampered["params"], "entropyBeta": 0.5}
    for doc, message in [
        (tampered, "checksum mismatch"),
        ({**VERSION_B.to_json(), "version": "v7"}, "content address"),
        (make_document({"maxExpertsPerToken": 9}).to_json(), "maxExpertsPerToken"),
        ({"version": "x"}, "missing"),
    ]:
        resp = await admin.put("/admin/gate", json=doc, headers=AUTH)
        assert resp.status == 422 and message in (await resp.json())["error"]
    resp = await admin.put("/admin/gate", data=b"{", headers={**AUTH,
                                                                "Content-Type": "application/json"})
    assert resp.status == 400
    assert (await (await client.get("/healthz")).json())["gateVersion"] == VERSION_A.version


async def test_hot_reload_under_concurrent_load_never_fails_or_mixes_versions(client, admin):
    applied = {VERSION_A.version: VERSION_A, VERSION_B.version: VERSION_B}
    results: list[tuple[int, dict]] = []
    done = asyncio.Event()

    async def worker(i):
        # Each worker keeps one request in flight until the swaps are over.
        while True:
            resp = await _infer(client, [[(i * 7 + j) % 512 for j in range(6)]] * 2)
            results.append((resp.status, await resp.json()))
            if done.is_set():
                return

    async def swap_to(doc):
        resp = await admin.put("/admin/gate", json=doc.to_json(), headers=AUTH)
        assert resp.status == 200
        # Swap again only once a request that started under this version has finished, so
        # every swap happens with the full load in flight, whatever the machine's speed.
        seen_before = len(results)
        async with asyncio.timeout(60):
            while not any(body.get("gateVersion") == doc.version
                          for _, body in results[seen_before:]):
                await asyncio.sleep(0.005)

    workers = [asyncio.create_task(worker(i)) for i in range(200)]
    for doc in [VERSION_B, VERSION_A] * 2:
        await swap_to(doc)
    done.set()
    await asyncio.gather(*workers)
    assert len(results) >= 400
    seen = set()
    for status, body in results:
        assert status == 200, body
        doc = applied[body["gateVersion"]]  # KeyError = a version nobody applied
        seen.add(doc.version)
        assert body["checksum"] == doc.checksum
        k = doc.params.max_experts_per_token
        # The whole request ran under its version's params: expert count and tool gate agree.
        assert body["activeExpertsPerToken"] == k
        assert [sum(c) for c in body["expertCounts"]] == [12 * k, 12 * k]
        assert body["toolGateFireRate"] == (1.0 if doc is VERSION_A else 0.0)
    assert seen == set(applied)


async def test_fault_injection_is_a_seeded_chaos_knob(client, admin):
    faulty = make_document({**DEFAULT_PARAMS, "faultInjection": {"errorRate": 0.5,
                                                                 "addedLatencyMs": 30}})
    assert (await admin.put("/admin/gate", json=faulty.to_json(), headers=AUTH)).status == 200
    started = time.perf_counter()
    statuses = []
    for _ in range(40):
        resp = await _infer(client, [[1, 2, 3]])
        statuses.append(resp.status)
        if resp.status == 503:
            assert "fault injected" in (await resp.json())["error"]
    assert time.perf_counter() - started >= 40 * 0.03
    assert set(statuses) == {200, 503} and 8 <= statuses.count(503) <= 32
    metrics = await (await client.get("/metrics")).text()
    assert (f'sparsegate_requests_total{{code="503",gate_version="{faulty.version}"}} '
            f'{statuses.count(503)}.0') in metrics
    # Same seed, same sequence of failures.
    app2 = create_app(gate_doc=faulty)
    async with TestClient(TestServer(app2, host="127.0.0.1")) as c2:
        await wait_ready(app2)
        again = [(await _infer(c2, [[1, 2, 3]])).status for _ in range(40)]
    assert again == statuses


async def test_metrics_are_exposed(client, admin):
    for _ in range(3):
        assert (await _infer(client, [[1, 2, 3, 4]])).status == 200
    assert (await _infer(client, [[1, 2, 9999]])).status == 422
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    text = await resp.text()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    a = VERSION_A.version
    assert samples[f'sparsegate_requests_total{{code="200",gate_version="{a}"}}'] == 3
    assert samples[f'sparsegate_requests_total{{code="422",gate_version="{a}"}}'] == 1
    assert samples[f'sparsegate_request_duration_seconds_count{{gate_version="{a}"}}'] == 4
    assert samples[f'sparsegate_tokens_total{{gate_version="{a}"}}'] == 12
    per_expert = [v for k, v in samples.items()
                  if k.startswith('sparsegate_expert_tokens_total{expert=') and 'layer="0"' in k]
    assert len(per_expert) == 8 and sum(per_expert) == 12  # version A: one expert per token
    assert samples["sparsegate_active_experts_per_token"] == 1.0
    assert samples["sparsegate_tool_gate_fire_rate"] == 1.0
    assert 0.0 <= samples["sparsegate_gate_entropy"] <= 2.08
    info = f'sparsegate_gate_config_info{{checksum="{VERSION_A.checksum}",version="{VERSION_A.version}"}}'
    assert samples[info] == 1.0
    await admin.put("/admin/gate", json=VERSION_B.to_json(), headers=AUTH)
    text = await (await client.get("/metrics")).text()
    # The gate info names only the version in effect (quality counters keep one series per
    # version served: test_quality.py).
    info = [line for line in text.splitlines() if line.startswith("sparsegate_gate_config_info{")]
    assert len(info) == 1 and VERSION_B.version in info[0]



def test_module_entry_point_serves_inference_and_tls_admin_from_files(tmp_path):
    from admin_files import admin_call, paths, write_secret_volume

    gate_file = tmp_path / "gate.json"
    gate_file.write_text(json.dumps(VERSION_B.to_json()))
    cert = write_secret_volume(tmp_path / "admin", token=TOKEN)
    token_file, cert_file, key_file = paths(tmp_path / "admin")
    port, admin_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparsegate_workload.server", "--host", "127.0.0.1",
         "--port", str(port), "--gate-config", str(gate_file), "--admin-port", str(admin_port),
         "--admin-token-file", token_file, "--admin-tls-cert", cert_file, "--admin-tls-key", key_file],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "server not ready in 30 s"
            time.sleep(0.1)
        with urllib.request.urlopen(base + "/healthz") as r:
            assert json.load(r)["gateVersion"] == VERSION_B.version
        # The operator's way in: TLS trusting the model's certificate alone, checked for its name.
        status, body = asyncio.run(admin_call("PUT", admin_port, cert_pem=cert, token=TOKEN,
                                              body=VERSION_A.to_json()))
        assert status == 200 and body["version"] == VERSION_A.version
        req = urllib.request.Request(base + "/v1/infer", data=b'{"tokens": [[1, 2, 3]]}',
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            assert json.load(r)["gateVersion"] == VERSION_A.version
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_module_entry_point_refuses_half_configured_admin(tmp_path):
    from admin_files import paths, write_secret_volume

    write_secret_volume(tmp_path / "admin", token=TOKEN)
    token_file, cert_file, _ = paths(tmp_path / "admin")
    for args, message in ((["--admin-token-file", token_file], "go together"),
                          (["--admin-token-file", token_file, "--admin-tls-cert", cert_file,
                            "--admin-tls-key", cert_file], "admin credentials")):
        done = subprocess.run([sys.executable, "-m", "sparsegate_workload.server", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def _spawn_server(*args: str, nofile: int | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m sparsegate_workload.server`` on a free port (soft RLIMIT_NOFILE ``nofile``),
    once /readyz answers 200."""
    import resource

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sparsegate_workload.server", "--host", "127.0.0.1",
                             "--port", str(port), *args], preexec_fn=limit,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server not ready: {proc.stdout.read().decode()}")
        time.sleep(0.1)


def _closed_by_server(sock, wait: float = 0.0) -> bool:
    """Whether the server closed ``sock`` (an idle connection), waiting up to ``wait`` s."""
    import ssl
    import socket

    sock.settimeout(wait or 0.001)
    try:
        return sock.recv(1) == b""
    except (socket.timeout, ssl.SSLWantReadError, BlockingIOError):
        return False
    except (ConnectionError, ssl.SSLError):
        return True


def test_idle_connections_cannot_take_the_descriptors_the_probes_need():
    """A client holding hundreds of idle keep-alive connections exhausted the server's file
    descriptors (aiohttp accepts until EMFILE and keeps an idle connection 75 s): the kubelet's
    probes then waited in the backlog and timed out. The default --max-connections comes from
    RLIMIT_NOFILE: beyond it a new connection closes the oldest idle one, so probes answer."""
    import socket

    proc, base = _spawn_server(nofile=640)  # --max-connections 176 by default
    idle = []
    try:
        for _ in range(700):
            idle.append(socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=5))
        time.sleep(0.5)
        for path in ("/healthz", "/readyz"):
            with urllib.request.urlopen(base + path, timeout=2) as r:
                assert r.status == 200
        assert len(os.listdir(f"/proc/{proc.pid}/fd")) < 640 - 256  # headroom left
        req = urllib.request.Request(base + "/v1/infer", data=b'{"tokens": [[1, 2, 3]]}',
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
    finally:
        for sock in idle:
            sock.close()
        proc.terminate()
        out = proc.communicate(timeout=15)[0].decode()
    assert proc.returncode == 0, out
    assert "Too many open files" not in out, out


def test_keepalive_timeout_and_connection_cap_cover_both_listeners(tmp_path):
    """--keepalive-timeout closes an idle connection on the inference listener and on the admin
    TLS listener (which kept one about an hour: a bare AppRunner's default), and there a stalled
    TLS handshake (counted, but it cannot be evicted); at --max-connections
    (counted over both) a new connection closes the oldest idle one and is served."""
    import socket
    import ssl

    from admin_files import paths, write_secret_volume

    write_secret_volume(tmp_path / "admin", token=TOKEN)
    token_file, cert_file, key_file = paths(tmp_path / "admin")
    admin_port = free_port()
    proc, base = _spawn_server("--keepalive-timeout", "1.5", "--max-connections", "3",
                               "--admin-port", str(admin_port), "--admin-token-file", token_file,
                               "--admin-tls-cert", cert_file, "--admin-tls-key", key_file)
    port = int(base.rsplit(":", 1)[1])
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
    try:
        admin = tls.wrap_socket(socket.create_connection(("127.0.0.1", admin_port), timeout=5))
        plain = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        time.sleep(0.3)
        # A fourth connection (a probe): the oldest idle one (the admin connection) makes room.
        with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
            assert r.status == 200
        assert _closed_by_server(admin, wait=0.5)
        assert not any(_closed_by_server(s) for s in plain)
        # Then the idle ones are closed after the keep-alive timeout.
        assert all(_closed_by_server(s, wait=2.5) for s in plain)
        admin = tls.wrap_socket(socket.create_connection(("127.0.0.1", admin_port), timeout=5))
        assert not _closed_by_server(admin, wait=0.5)
        assert _closed_by_server(admin, wait=2.5)
        # A connection that never starts its TLS handshake too (asyncio's default: 60 s).
        stalled = socket.create_connection(("127.0.0.1", admin_port), timeout=5)
        assert not _closed_by_server(stalled, wait=0.5)
        assert _closed_by_server(stalled, wait=2.5)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=15)[0].decode()
    assert proc.returncode == 0, out


async def test_event_loop_stays_responsive_while_the_model_computes(client):
    big = [[(i * 31 + j) % 512 for j in range(256)] for i in range(16)]  # 4096 tokens each
    pending = [asyncio.create_task(_infer(client, big)) for _ in range(8)]
    await asyncio.sleep(0.05)
    health = await client.get("/healthz")
    assert health.status == 200
    # Model batches run one at a time in the executor thread; /healthz answered in between.
    assert not all(t.done() for t in pending)
    assert all(r.status == 200 for r in await asyncio.gather(*pending))


async def test_hostile_json_is_a_400_not_a_500(client):
    headers = {"Content-Type": "application/json"}
    for body, message in ((b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                          (b'{"tokens": [[' + b"9" * 5000 + b"]]}", "not valid JSON")):
        resp = await client.post("/v1/infer", data=body, headers=headers)
        assert resp.status == 400, await resp.text()
        assert message in (await resp.json())["error"]


async def serving(app):
    c = TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0))
    await c.start_server()
    await wait_ready(app)
    return c


async def test_admission_is_bounded_and_requests_time_out():
    # One request admitted at a time: while a slow one (300 ms of injected latency) is in flight,
    # the next is refused at once with 429, not queued without bound.
    slow = make_document({**DEFAULT_PARAMS, "faultInjection": {"errorRate": 0.0, "addedLatencyMs": 300}})
    c = await serving(create_app(gate_doc=slow, max_inflight=1))
    try:
        body = {"tokens": [[1, 2, 3]]}
        first = asyncio.create_task(c.post("/v1/infer", json=body))
        await asyncio.sleep(0.1)
        second = await c.post("/v1/infer", json=body)
        assert second.status == 429 and "limit 1" in (await second.json())["error"]
        assert (await first).status == 200
        assert (await c.post("/v1/infer", json=body)).status == 200  # the slot is free again
    finally:
        await c.close()
    # A result later than the timeout answers 503; the slot frees once the batch is done.
    c = await serving(create_app(request_timeout_s=0.0005, max_inflight=1))
    try:
        resp = await c.post("/v1/infer", json={"tokens": [[i % 500 for i in range(256)] for _ in range(16)]})
        assert resp.status == 503 and "no result within" in (await resp.json())["error"]
        await asyncio.sleep(1.0)
        assert c.server.app[STATE].inflight == 0
    finally:
        await c.close()


async def test_a_client_that_abandons_its_request_keeps_its_slot_until_its_batch_ran():
    """A /v1/infer client that disconnects while its batch waits for the model thread: the batch
    still runs, so its admission slot stays taken until then. Freed at once (as it was), abandoned
    requests queued batches on the model thread past --max-inflight, never answered 429."""
    c = await serving(create_app(max_inflight=2))
    state = c.server.app[STATE]
    try:
        busy = asyncio.get_running_loop().run_in_executor(state.executor, time.sleep, 1.0)
        statuses = []
        for _ in range(6):
            try:
                resp = await c.post("/v1/infer", json={"tokens": [[1, 2, 3]]},
                                    timeout=aiohttp.ClientTimeout(total=0.1))
                statuses.append(resp.status)
            except asyncio.TimeoutError:
                statuses.append("abandoned")
        await asyncio.sleep(0.1)  # the abandoned handlers have been cancelled
        assert statuses == ["abandoned", "abandoned", 429, 429, 429, 429]
        assert state.inflight == 2 and state.executor.queued == 2
        await busy
        for _ in range(100):
            if state.inflight == 0:
                break
            await asyncio.sleep(0.02)
        assert state.inflight == 0
        assert (await c.post("/v1/infer", json={"tokens": [[1, 2, 3]]})).status == 200
        text = await (await c.get("/metrics")).text()
        assert 'vllm:num_requests_waiting{model_name="builtin"} 0.0' in text
        assert 'vllm:num_requests_running{model_name="builtin"} 0.0' in text
    finally:
        await c.close()


async def test_a_client_stalling_its_body_holds_no_slot_and_gets_408():
    """A client that sends its headers and then stalls its body (slowloris) took an admission
    slot before its body was read, and held it for as long as it kept the connection open: with
    --max-inflight 1, every other request got 429, past --request-timeout. Now the slot is taken
    once the body is in, and a body not received within --request-timeout answers 408 (a 4xx:
    no error the rollout analysis counts against the version)."""
    c = await serving(create_app(max_inflight=1, request_timeout_s=0.5))
    state = c.server.app[STATE]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", c.server.port)
        writer.write(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"tok")
        await writer.drain()
        await asyncio.sleep(0.1)
        assert (await c.post("/v1/infer", json={"tokens": [[1, 2, 3]]})).status == 200
        assert state.inflight == 0
        head = await asyncio.wait_for(reader.readline(), 5)
        assert b" 408 " in head, head
        writer.close()
        text = await (await c.get("/metrics")).text()
        counted = {ln.split('code="', 1)[1].split('"', 1)[0]: float(ln.rsplit(" ", 1)[1])
                   for ln in text.splitlines() if ln.startswith("sparsegate_requests_total{")}
        assert {k: v for k, v in counted.items() if v} == {"200": 1.0, "408": 1.0}
    finally:
        await c.close()


async def test_a_model_that_fails_to_load_is_unhealthy_with_the_reason(monkeypatch):
    from sparsegate_workload import server

    def broken(*_a, **_k):
        raise RuntimeError("shard model-00002.safetensors is missing")

    monkeypatch.setattr(server, "build_model", broken)
    c = await serving(create_app())
    try:
        health = await c.get("/healthz")
        assert health.status == 500 and "model-00002.safetensors" in (await health.json())["error"]
        ready = await c.get("/readyz")
        assert ready.status == 503 and "failed to load" in (await ready.json())["reason"]
        assert (await c.post("/v1/infer", json={"tokens": [[1]]})).status == 503
    finally:
        await c.close()


def _version_series(text: str) -> dict[str, int]:
    """Samples per gate_version label in a /metrics exposition."""
    import re
    out: dict[str, int] = {}
    for v in re.findall(r'gate_version="([^"]*)"', text):
        out[v] = out.get(v, 0) + 1
    return out


async def test_series_of_versions_no_longer_held_are_bounded(client, admin):
    """Many rollouts on one pod: only the held versions and the last RETIRED_VERSIONS_KEPT
    versions no longer held keep their gate_version series; the newest are intact."""
    from sparsegate_workload.metrics import RETIRED_VERSIONS_KEPT
    versions = []
    for i in range(RETIRED_VERSIONS_KEPT + 6):
        doc = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1 + i % 2,
                             "maxExpertsPerToken": 2, "capacityFactor": 8 + i})
        versions.append(doc.version)
        assert (await admin.put("/admin/gate", json=doc.to_json(), headers=AUTH)).status == 200
        assert (await _infer(client, [[1, 2, 3]])).status == 200
    text = await (await client.get("/metrics")).text()
    series = _version_series(text)
    assert VERSION_A.version not in series
    kept = set(versions[-1 - RETIRED_VERSIONS_KEPT:])
    assert set(series) - {""} == kept, series
    # The held version and the previous one keep every series, with their counts.
    for v in versions[-2:]:
        assert f'sparsegate_requests_total{{code="200",gate_version="{v}"}} 1.0' in text
        assert f'sparsegate_request_duration_seconds_count{{gate_version="{v}"}} 1.0' in text
        assert f'sparsegate_tokens_total{{gate_version="{v}"}} 3.0' in text
        assert f'sparsegate_quality_tokens_total{{gate_version="{v}"}}' in text
    # One more rollout: the set stays the same size.
    doc = make_document({**DEFAULT_PARAMS, "capacityFactor": 63})
    assert (await admin.put("/admin/gate", json=doc.to_json(), headers=AUTH)).status == 200
    after = _version_series(await (await client.get("/metrics")).text())
    assert len(set(after) - {""}) == len(kept) and versions[-1 - RETIRED_VERSIONS_KEPT] not in after
    # A request of a dropped version ending late brings its series back; the next rollout drops it.
    client.server.app[STATE].metrics.observe_request(code=200, gate_version=versions[0], seconds=0.01)
    assert versions[0] in _version_series(await (await client.get("/metrics")).text())
    doc = make_document({**DEFAULT_PARAMS, "capacityFactor": 62})
    assert (await admin.put("/admin/gate", json=doc.to_json(), headers=AUTH)).status == 200
    assert versions[0] not in _version_series(await (await client.get("/metrics")).text())
