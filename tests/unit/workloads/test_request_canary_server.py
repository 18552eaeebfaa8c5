"""The model server holding a stable and a canary gate version and choosing per request
(sparsegate_contracts.canary), in-process: sticky sessions, per-version metrics, hot swaps."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_contracts.canary import gate_set_document, routes_to_canary
from sparsegate_workload.admin import StaticToken
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint
from sparsegate_workload.server import STATE, create_admin_app, create_app, wait_ready

TOKEN = "canary-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Visible in every response: STABLE routes each token to one expert, CANARY to three.
STABLE = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 1, "capacityFactor": 8})
CANARY = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 3, "maxExpertsPerToken": 3, "capacityFactor": 8})
EXPERTS = {STABLE.version: 1.0, CANARY.version: 3.0}


@pytest.fixture
async def server():
    app = create_app(gate_doc=STABLE)
    async with TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0)) as c:
        await wait_ready(app)
        async with TestClient(TestServer(create_admin_app(app, auth=StaticToken(TOKEN)), host="127.0.0.1")) as a:
            yield c, a


async def _put(admin, body):
    resp = await admin.put("/admin/gate", json=body, headers=AUTH)
    return resp.status, await resp.json()


async def _infer(client, headers=None):
    resp = await client.post("/v1/infer", json={"tokens": [[1, 2, 3, 4]]}, headers=headers or {})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    # The response names the version that served it, and the routing shows it really did.
    assert body["activeExpertsPerToken"] == EXPERTS[body["gateVersion"]]
    return body["gateVersion"]


def _samples(text):
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


async def test_sticky_sessions_and_request_ids_follow_the_contract(server):
    client, admin = server
    status, body = await _put(admin, gate_set_document(STABLE.to_json(), CANARY.to_json(), weight=0.3))
    assert status == 200 and body["applied"] and body["version"] == STABLE.version
    assert body["canary"]["version"] == CANARY.version and body["canary"]["weight"] == 0.3
    health = await (await client.get("/healthz")).json()
    assert health["gateVersion"] == STABLE.version
    assert health["canary"] == {"version": CANARY.version, "checksum": CANARY.checksum, "weight": 0.3,
                                "stickyHeader": "x-session-id"}
    served = {}
    for i in range(40):
        session = f"conversation-{i}"
        versions = {await _infer(client, {"X-Session-Id": session, "X-Request-Id": f"r{i}-{n}"}) for n in range(3)}
        assert len(versions) == 1, session  # one conversation, one version, whatever its request ids
        served[session] = versions.pop()
        assert served[session] == (CANARY.version if routes_to_canary(session, 0.3) else STABLE.version)
    # Without the sticky header the request id decides.
    for i in range(20):
        rid = f"request-{i}"
        want = CANARY.version if routes_to_canary(rid, 0.3) else STABLE.version
        assert await _infer(client, {"X-Request-Id": rid}) == want
    # Monotone: a session on the canary at 30 % stays there at 60 %.
    status, _ = await _put(admin, gate_set_document(STABLE.to_json(), CANARY.to_json(), weight=0.6))
    assert status == 200
    for session, version in served.items():
        if version == CANARY.version:
            assert await _infer(client, {"X-Session-Id": session}) == CANARY.version


async def test_random_requests_split_at_the_weight_and_metrics_are_per_version(server):
    client, admin = server
    weight, n = 0.2, 600
    await _put(admin, gate_set_document(STABLE.to_json(), CANARY.to_json(), weight=weight))
    versions = [await _infer(client) for _ in range(n)]  # no header: a random id each
    canary = versions.count(CANARY.version)
    assert abs(canary - weight * n) <= 4 * math.sqrt(n * weight * (1 - weight)), canary
    samples = _samples(await (await client.get("/metrics")).text())
    assert samples[f'sparsegate_requests_total{{code="200",gate_version="{CANARY.version}"}}'] == canary
    assert samples[f'sparsegate_requests_total{{code="200",gate_version="{STABLE.version}"}}'] == n - canary
    assert samples[f'sparsegate_request_duration_seconds_count{{gate_version="{CANARY.version}"}}'] == canary
    # Routing counters per version: the canary's experts per token apart from the stable one's.
    for version, experts in EXPERTS.items():
        tokens = samples[f'sparsegate_tokens_total{{gate_version="{version}"}}']
        assignments = samples[f'sparsegate_expert_assignments_total{{gate_version="{version}"}}']
        assert assignments / (tokens * 2) == experts  # 2 MoE layers
        # One per-request observation each (drift's noise): this gate keeps exactly `experts`.
        count = samples[f'sparsegate_request_experts_per_token_count{{gate_version="{version}"}}']
        assert count == (canary if version == CANARY.version else n - canary)
        assert samples[f'sparsegate_request_experts_per_token_sum{{gate_version="{version}"}}'] == experts * count
        assert samples[f'sparsegate_request_experts_per_token_squares_total{{gate_version="{version}"}}'] \
            == experts * experts * count


async def test_a_faulty_canary_fails_only_its_own_requests(server):
    client, admin = server
    faulty = make_document({**DEFAULT_PARAMS, "faultInjection": {"errorRate": 1.0, "addedLatencyMs": 0}})
    await _put(admin, gate_set_document(STABLE.to_json(), faulty.to_json(), weight=0.5, sticky_header="x-user"))
    codes = {}
    for i in range(40):
        user = f"user-{i}"
        resp = await client.post("/v1/infer", json={"tokens": [[1, 2]]}, headers={"x-user": user})
        codes[user] = resp.status
        assert resp.status == (503 if routes_to_canary(user, 0.5) else 200)
    samples = _samples(await (await client.get("/metrics")).text())
    assert samples[f'sparsegate_requests_total{{code="503",gate_version="{faulty.version}"}}'] \
        == list(codes.values()).count(503) > 0
    assert samples[f'sparsegate_requests_total{{code="503",gate_version="{STABLE.version}"}}'] == 0


async def test_a_version_s_request_series_exist_at_zero_from_the_moment_it_is_served(server):
    """So that Prometheus's increase() counts a canary's first requests and errors: a series born
    inside an analysis window loses what its first sample holds (metrics.ServerMetrics.serving)."""
    client, admin = server
    canary = make_document({**DEFAULT_PARAMS, "faultInjection": {"errorRate": 1.0, "addedLatencyMs": 0}})
    await _put(admin, gate_set_document(STABLE.to_json(), canary.to_json(), weight=0.5, sticky_header="x-user"))
    samples = _samples(await (await client.get("/metrics")).text())  # no request served yet
    for version in (STABLE.version, canary.version):
        for code in ("200", "500", "503"):
            assert samples[f'sparsegate_requests_total{{code="{code}",gate_version="{version}"}}'] == 0
        assert samples[f'sparsegate_request_duration_seconds_count{{gate_version="{version}"}}'] == 0
        for name in ("sparsegate_tokens_total", "sparsegate_expert_assignments_total",
                     "sparsegate_request_experts_per_token_count", "sparsegate_request_experts_per_token_squares_total",
                     "sparsegate_quality_nll_total", "sparsegate_quality_tokens_total"):
            assert samples[f'{name}{{gate_version="{version}"}}'] == 0, name
    assert not [k for k in samples if k.startswith("sparsegate_requests_total") and 'code="4' in k]


async def test_promotion_rollback_and_swaps_under_load_drop_nothing(server):
    client, admin = server
    state = client.server.app[STATE]

    async def load():
        return [await _infer(client) for _ in range(60)]

    async def changes():
        for body in (gate_set_document(STABLE.to_json(), CANARY.to_json(), weight=0.05),
                     gate_set_document(STABLE.to_json(), CANARY.to_json(), weight=0.5),
                     CANARY.to_json(),                                                  # promote
                     gate_set_document(CANARY.to_json(), STABLE.to_json(), weight=0.2),
                     CANARY.to_json()):                                                 # roll back
            status, answer = await _put(admin, body)
            assert status == 200 and answer["applied"], answer
            await asyncio.sleep(0.02)

    results = await asyncio.gather(load(), load(), changes())
    assert all(v in EXPERTS for v in results[0] + results[1])  # every request answered 200
    assert state.gate.doc.version == CANARY.version and state.canary is None
    health = await (await client.get("/healthz")).json()
    assert health["gateVersion"] == CANARY.version and "canary" not in health
    status, answer = await _put(admin, CANARY.to_json())
    assert status == 200 and answer["applied"] is False


ONE = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 1, "capacityFactor": 8})
TWO = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2, "capacityFactor": 8})


async def test_a_checkpoint_pins_the_canary_per_request_on_every_route(tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", family="mixtral")
    app = create_app(gate_doc=ONE, model_path=str(checkpoint))
    async with TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0)) as c:
        await wait_ready(app)
        async with TestClient(TestServer(create_admin_app(app, auth=StaticToken(TOKEN)), host="127.0.0.1")) as a:
            status, body = await _put(a, gate_set_document(ONE.to_json(), TWO.to_json(), weight=0.5))
            assert status == 200 and body["canary"]["version"] == TWO.version, body
            experts = {ONE.version: 1.0, TWO.version: 2.0}
            sessions = [f"chat-{i}" for i in range(12)]

            async def complete(sid: str, stream: bool = False) -> str:
                resp = await c.post("/v1/completions", headers={"x-session-id": sid},
                                    json={"prompt": "the gate keeps", "max_tokens": 3, "temperature": 0})
                assert resp.status == 200, await resp.text()
                usage = (await resp.json())["usage"]["sparsegate"]
                # Prefill and every decode step ran under the version it reports.
                assert usage["mean_experts_per_token"] == experts[usage["gate_version"]]
                return usage["gate_version"]

            # Concurrent: prefills of both versions are packed apart, decoded in their own groups.
            served = await asyncio.gather(*(complete(s) for s in sessions))
            for sid, version in zip(sessions, served):
                assert version == (TWO.version if routes_to_canary(sid, 0.5) else ONE.version), sid
            assert set(served) == {ONE.version, TWO.version}
            for sid in sessions[:4]:  # /v1/infer follows the same choice
                resp = await c.post("/v1/infer", json={"tokens": [[1, 2, 3]]}, headers={"x-session-id": sid})
                body = await resp.json()
                assert body["gateVersion"] == (TWO.version if routes_to_canary(sid, 0.5) else ONE.version)
                assert body["activeExpertsPerToken"] == experts[body["gateVersion"]]
            samples = _samples(await (await c.get("/metrics")).text())
            for version in (ONE.version, TWO.version):
                want = served.count(version) + sum(
                    1 for sid in sessions[:4] if (TWO.version if routes_to_canary(sid, 0.5) else ONE.version) == version)
                assert samples[f'sparsegate_requests_total{{code="200",gate_version="{version}"}}'] == want
            # One weight storage: a canary that would need another is refused, naming the field.
            bf16 = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2,
                                  "precisionPolicy": "bf16"})
            status, body = await _put(a, gate_set_document(ONE.to_json(), bf16.to_json(), weight=0.1))
            assert status == 422 and "precisionPolicy" in body["error"], body
            assert (await (await c.get("/healthz")).json())["canary"]["version"] == TWO.version
            # A new stable with another storage is checked too, before anything changes.
            status, body = await _put(a, gate_set_document(bf16.to_json(), TWO.to_json(), weight=0.1))
            assert status == 422 and "precisionPolicy" in body["error"], body
            health = await (await c.get("/healthz")).json()
            assert health["gateVersion"] == ONE.version and health["canary"]["version"] == TWO.version
            # Promotion: the canary installed alone.
            status, body = await _put(a, TWO.to_json())
            assert status == 200 and "canary" not in body and body["version"] == TWO.version
            assert await complete("chat-0") == TWO.version


# Probe quality per version: the canary differs from the stable only by its top-p threshold.
LOOSE = make_document({**DEFAULT_PARAMS, "confidenceThreshold": 0.3, "capacityFactor": 8})
TIGHT = make_document({**DEFAULT_PARAMS, "confidenceThreshold": 0.95, "capacityFactor": 8})
PROBE = "sparsegate_probe_nll_per_token"


def _probes(text):
    return {key.split('gate_version="')[1].split('"')[0]: value
            for key, value in _samples(text).items() if key.startswith(PROBE + "{")}


async def _alone_probe(doc, **kwargs):
    """The probe score of ``doc`` installed alone in a fresh server (same seed, same weights)."""
    app = create_app(gate_doc=doc, **kwargs)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        await wait_ready(app)
        return _probes(await (await c.get("/metrics")).text())[doc.version]


async def _probe_lifecycle(client, admin):
    """Set, promote, roll back: each PUT's answer is followed by exactly the held versions'
    probe gauges, each version's value fixed from its first scoring."""
    alone = _probes(await (await client.get("/metrics")).text())
    assert list(alone) == [LOOSE.version]
    status, _ = await _put(admin, gate_set_document(LOOSE.to_json(), TIGHT.to_json(), weight=0.1))
    assert status == 200
    both = _probes(await (await client.get("/metrics")).text())
    assert set(both) == {LOOSE.version, TIGHT.version}
    assert both[LOOSE.version] == alone[LOOSE.version]
    # A wider top-p keeps more experts per token: the model's predictions, and their NLL, move.
    assert abs(both[TIGHT.version] - both[LOOSE.version]) > 1e-4, both
    status, _ = await _put(admin, gate_set_document(LOOSE.to_json(), TIGHT.to_json(), weight=0.5))
    assert status == 200 and _probes(await (await client.get("/metrics")).text()) == both
    status, _ = await _put(admin, TIGHT.to_json())  # promote
    assert status == 200
    assert _probes(await (await client.get("/metrics")).text()) == {TIGHT.version: both[TIGHT.version]}
    status, _ = await _put(admin, gate_set_document(TIGHT.to_json(), LOOSE.to_json(), weight=0.2))
    assert status == 200 and _probes(await (await client.get("/metrics")).text()) == both
    status, _ = await _put(admin, TIGHT.to_json())  # roll the canary back
    assert status == 200
    assert _probes(await (await client.get("/metrics")).text()) == {TIGHT.version: both[TIGHT.version]}
    return both


async def test_the_builtin_model_scores_the_probe_set_for_every_version_it_holds():
    app = create_app(gate_doc=LOOSE)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        await wait_ready(app)
        async with TestClient(TestServer(create_admin_app(app, auth=StaticToken(TOKEN)), host="127.0.0.1")) as a:
            both = await _probe_lifecycle(c, a)
    # The canary's score is the one it has installed alone.
    assert both[TIGHT.version] == pytest.approx(await _alone_probe(TIGHT), rel=1e-6)


async def test_a_checkpoint_scores_its_canary_pinned_for_the_probe_forward(tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", family="mixtral", experts=4, top_k=2)
    app = create_app(gate_doc=LOOSE, model_path=str(checkpoint))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        await wait_ready(app)
        async with TestClient(TestServer(create_admin_app(app, auth=StaticToken(TOKEN)), host="127.0.0.1")) as a:
            both = await _probe_lifecycle(c, a)
    # Pinned beside LOOSE, the canary scores what it scores installed alone.
    assert both[TIGHT.version] == pytest.approx(await _alone_probe(TIGHT, model_path=str(checkpoint)), rel=1e-5)


async def test_a_checkpoints_controlled_canary_runs_its_own_loop_and_keeps_it_when_promoted(tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", family="mixtral")
    stable = make_document({**DEFAULT_PARAMS, "capacityFactor": 8})
    controlled = make_document({**DEFAULT_PARAMS, "capacityFactor": 8, "targetExpertsPerToken": 3})
    app = create_app(gate_doc=stable, model_path=str(checkpoint))
    async with TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0)) as c:
        await wait_ready(app)
        async with TestClient(TestServer(create_admin_app(app, auth=StaticToken(TOKEN)), host="127.0.0.1")) as a:
            status, _ = await _put(a, gate_set_document(stable.to_json(), controlled.to_json(), weight=1.0))
            assert status == 200
            state = app[STATE]
            controller = state.canary.gate.controller
            assert controller is not None and state.canary.gate.hf_gate.controller is controller
            # Its probe set was scored before the PUT answered, without feeding the loop.
            assert controlled.version in _probes(await (await c.get("/metrics")).text())
            assert controller.updates == 0 and controller.threshold == 0.6
            assert state.gate.controller is None
            for i in range(6):
                resp = await c.post("/v1/completions", headers={"x-session-id": f"s{i}"},
                                    json={"prompt": "the gate keeps the experts busy", "max_tokens": 6})
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["usage"]["sparsegate"]["gate_version"] == controlled.version
            resp = await c.post("/v1/infer", json={"tokens": [[5, 6, 7, 8]]}, headers={"x-session-id": "s0"})
            assert (await resp.json())["gateVersion"] == controlled.version
            assert controller.updates > 1 and controller.threshold > 0.6  # fed, and raised toward 3
            gauge = {k: v for k, v in _samples(await (await c.get("/metrics")).text()).items()
                     if k.startswith("sparsegate_gate_controlled_threshold")}
            assert gauge == {f'sparsegate_gate_controlled_threshold{{gate_version="{controlled.version}"}}':
                             controller.threshold}
            status, _ = await _put(a, controlled.to_json())  # promote: the loop goes on where it was
            assert status == 200
            assert state.gate.controller is controller and state.hf.lm.gate.controller is controller
            # Demoted: the promoted version becomes the canary of another stable and keeps its loop
            # (it was replaced by a fresh controller at confidenceThreshold).
            updates, threshold = controller.updates, controller.threshold
            status, _ = await _put(a, gate_set_document(stable.to_json(), controlled.to_json(), weight=0.5))
            assert status == 200
            assert state.canary.gate.controller is controller and state.canary.gate.hf_gate.controller is controller
            assert (controller.updates, controller.threshold) == (updates, threshold)
            # What /healthz says and what a request runs under are one set, assigned together.
            health = await (await c.get("/healthz")).json()
            assert (health["gateVersion"], health["canary"]["version"]) == (stable.version, controlled.version)
