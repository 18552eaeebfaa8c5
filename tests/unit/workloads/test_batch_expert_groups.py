"""Expert-group scoped sequences in continuous batching (tiny Mixtral checkpoint, 8 experts, built
in code): sequences of group a (experts 0-1), group b (2-3) and unscoped ones prefill and decode
in the same forwards; every forward's per-sequence expert counts keep each scoped sequence inside
its group at every layer, and the unscoped sequence's tokens and expert counts equal its decode
alone. Then the OpenAI routes of a real in-process server: the header narrows a request in a
shared batch (plain and streamed), usage names the group and the experts used."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_contracts.request_access import EXPERT_GROUP_HEADER
from sparsegate_workload.batch_decode import BatchDecoder, DecodeRequest
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint
from sparsegate_workload.hf_serving import HFServedModel, load
from sparsegate_workload.server import STATE, create_app, wait_ready

GROUPS = {"a": (0, 1), "b": (2, 3)}
# capacityFactor 8 caps nothing, so sequences of one step never compete for an expert.
DYNAMIC = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 3,
                         "capacityFactor": 8})
TWO = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2,
                     "capacityFactor": 8})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ck") / "mixtral", family="mixtral")


def _requests() -> list[DecodeRequest]:
    # Two of each kind, prompts of different lengths (left padding), greedy and sampled.
    scopes = [GROUPS["a"], GROUPS["b"], None, GROUPS["a"], None, GROUPS["b"]]
    return [DecodeRequest(key=i, prompt_ids=[1] + [(11 * i + 5 * j) % 300 + 3 for j in range(3 + 4 * i % 9)],
                          max_tokens=7 + i % 3, temperature=0.0 if i % 2 else 0.8, seed=i,
                          allowed_experts=scope)
            for i, scope in enumerate(scopes)]


def _drain(dec: BatchDecoder, reqs, *, per_step: int):
    """Run jobs until all ended; returns tokens, generations and every forward's routing record."""
    forwards: list[tuple[list, list]] = []
    dec.on_routed = lambda keys, counts: forwards.append((keys, counts.tolist()))
    tokens, gens, pending = {}, {}, list(reqs)
    while pending or dec.running:
        admit, pending = pending[:per_step], pending[per_step:]
        for ev in dec.run(admit, []):
            tokens.setdefault(ev.key, []).append(ev.token)
            if ev.generation is not None:
                gens[ev.key] = ev.generation
    return tokens, gens, forwards


def _used(counts) -> set[int]:
    return {e for layer in counts for e, n in enumerate(layer) if n}


@pytest.mark.parametrize("doc", [DYNAMIC, TWO], ids=["dynamic", "fixed-k2"])
@pytest.mark.parametrize("per_step", [1, 6])  # 6: all prompts packed into one prefill
def test_scoped_rows_stay_in_their_group_and_unscoped_rows_are_unaffected(checkpoint, doc, per_step):
    hf = load(checkpoint, gate=doc, device="cpu")
    reqs = _requests()
    tokens, gens, forwards = _drain(BatchDecoder(hf), reqs, per_step=per_step)
    scope = {r.key: r.allowed_experts for r in reqs}
    assert set(gens) == set(scope)
    # Sequences of both groups and unscoped ones really shared forwards (prefill and steps).
    assert any({scope[k] for k in keys} == {GROUPS["a"], GROUPS["b"], None} for keys, _ in forwards)
    n_layers = len(gens[0].expert_counts)
    for keys, counts in forwards:
        for key, row in zip(keys, counts):
            assert len(row) == n_layers
            if scope[key] is not None:
                for layer in row:  # every layer of every forward (prefill, each step)
                    assert {e for e, n in enumerate(layer) if n} <= set(scope[key]), (key, row)
                    assert sum(layer) > 0  # each token still reaches one of its group's experts
    for key, gen in gens.items():
        if scope[key] is not None:
            assert _used(gen.expert_counts) <= set(scope[key])
    # The mask is not trivially met: unscoped sequences use experts outside both groups.
    assert any(_used(gens[k].expert_counts) - {0, 1, 2, 3} for k in scope if scope[k] is None)
    for req in reqs:
        alone_tokens, alone_gens, _ = _drain(BatchDecoder(hf), [req], per_step=1)
        # Batched equals alone, scoped or not: another row's mask leaks into no sequence.
        assert tokens[req.key] == alone_tokens[req.key], req
        assert gens[req.key].expert_counts == alone_gens[req.key].expert_counts, req
        if req.allowed_experts is None:
            solo = hf.generate(req.prompt_ids, max_tokens=req.max_tokens,
                               temperature=req.temperature, seed=req.seed)
            assert tokens[req.key] == solo.token_ids


def test_a_scoped_sequence_parked_on_a_tool_resumes_inside_its_group(checkpoint):
    import torch

    from sparsegate_workload.batch_decode import ToolFire
    from sparsegate_workload.hf.tool_head import ToolHead

    hf = load(checkpoint, gate=DYNAMIC, device="cpu")
    hf.lm.tool_head = ToolHead(weight=torch.zeros(64), bias=10.0)  # the tool gate fires everywhere
    dec = BatchDecoder(hf)
    dec.tool_select = lambda ids: ("calculator", "40+2")
    forwards: list[tuple[list, list]] = []
    dec.on_routed = lambda keys, counts: forwards.append((keys, counts.tolist()))
    tool = DecodeRequest(key="t", prompt_ids=[67, 70, 70, 223, 19, 20], max_tokens=6, max_tool_calls=1,
                         allowed_experts=GROUPS["b"])
    other = DecodeRequest(key="o", prompt_ids=[5, 6, 7], max_tokens=6)
    fires = [ev for ev in dec.run([tool, other], []) if isinstance(ev, ToolFire)]
    assert [f.key for f in fires] == ["t"] and dec.parked == 1
    dec.run([], [], resume=[("t", [22, 20])])  # forced tokens: one forward on its own cache
    while dec.running:
        dec.run([], [])
    seen = [row for keys, counts in forwards for key, row in zip(keys, counts) if key == "t"]
    assert len(seen) >= 3  # prefill, the forced tokens' forward, decode steps
    for row in seen:
        assert all({e for e, n in enumerate(layer) if n} <= {2, 3} for layer in row), row


def test_a_bad_group_is_refused_before_it_reaches_a_batch(checkpoint):
    dec = BatchDecoder(load(checkpoint, gate=TWO, device="cpu"))
    for bad in [(), (8,), (0, -1)]:
        with pytest.raises(ValueError, match="allowed_experts"):
            dec.allowed_mask(bad)
    assert dec.allowed_mask(None) is None
    assert dec.allowed_mask((1, 3)).tolist() == [False, True, False, True] + [False] * 4


@pytest.mark.parametrize("rows", [[(0, 1), None, (2, 3)], [(0,), None, (2, 3)]],
                         ids=["groups-of-k", "a-group-below-k"])
def test_masked_fixed_k_fast_path_routes_as_the_general_assign(checkpoint, monkeypatch, rows):
    import torch

    from sparsegate_workload.hf import gated_block

    hf = load(checkpoint, gate=TWO, device="cpu")
    block = hf.lm.blocks[0]
    flat = torch.randn(3 * 4, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(5))
    allowed = torch.ones(3 * 4, hf.num_experts, dtype=torch.bool)
    for i, group in enumerate(rows):
        if group is not None:
            allowed[i * 4:(i + 1) * 4] = False
            allowed[i * 4:(i + 1) * 4, list(group)] = True
    with torch.inference_mode():
        fast = block.route(flat, hf.lm.gate, allowed)
        monkeypatch.setattr(gated_block, "FIXED_K_FAST_TOKENS", 0)  # the general `assign` only
        general = block.route(flat, hf.lm.gate, allowed)
    assert fast.counts == general.counts
    for field in ("token_idx", "weights", "slots", "per_token", "selected"):
        assert torch.equal(getattr(fast, field), getattr(general, field)), field
    picked = fast.token_idx.tolist()
    experts = [e for e, n in enumerate(fast.counts) for _ in range(n)]
    assert all(allowed[t, e] for t, e in zip(picked, experts))


async def _serve(app) -> TestClient:
    client = TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0))
    await client.start_server()
    await wait_ready(app)
    return client


async def _sse(resp) -> list:
    assert resp.status == 200, await resp.text()
    lines = [ln[len("data: "):] for ln in (await resp.read()).decode().split("\n\n") if ln]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


async def test_openai_routes_narrow_a_named_group_in_a_shared_batch(checkpoint):
    client = await _serve(create_app(gate_doc=DYNAMIC, model_path=str(checkpoint), expert_groups=GROUPS))
    try:
        body = {"prompt": "the gate keeps the fewest experts", "temperature": 0, "max_tokens": 12}
        alone = await (await client.post("/v1/completions", json=body)).json()
        # Submitted together: one engine batch holds group a, group b and the unscoped request.
        answers = await asyncio.gather(
            client.post("/v1/completions", json=body, headers={EXPERT_GROUP_HEADER: "a"}),
            client.post("/v1/completions", json=body, headers={EXPERT_GROUP_HEADER: "b"}),
            client.post("/v1/completions", json=body),
            client.post("/v1/chat/completions", headers={EXPERT_GROUP_HEADER: "b"},
                        json={"messages": [{"role": "user", "content": "route this"}], "temperature": 0,
                              "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}))
        a, b, plain = [await r.json() for r in answers[:3]]
        assert all(r.status == 200 for r in answers[:3]), (a, b, plain)
        assert app_engine(client).max_batch >= 3
        for out, name in ((a, "a"), (b, "b")):
            ours = out["usage"]["sparsegate"]
            assert ours["expert_group"] == name and ours["allowed_experts"] == list(GROUPS[name])
            assert ours["access_rule"] == ""  # no access rules: narrowed, not checked
            assert ours["experts_used"] and set(ours["experts_used"]) <= set(GROUPS[name])
        # The unscoped answer in the shared batch is the one it gets alone, and reports no group.
        assert plain["choices"] == alone["choices"]
        assert plain["usage"] == alone["usage"] and "expert_group" not in plain["usage"]["sparsegate"]
        chunks = await _sse(answers[3])
        ours = chunks[-1]["usage"]["sparsegate"]
        assert ours["expert_group"] == "b" and set(ours["experts_used"]) <= {2, 3}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c["choices"])
        # An unknown group is refused naming the header, as on /v1/infer.
        resp = await client.post("/v1/completions", json=body, headers={EXPERT_GROUP_HEADER: "c"})
        err = (await resp.json())["error"]  # in OpenAI's shape on its routes
        assert resp.status == 400 and err["type"] == "invalid_request_error" and EXPERT_GROUP_HEADER in err["message"]
        scrape = await (await client.get("/metrics")).text()
        assert 'sparsegate_request_access_total{expert_group="a",result="narrowed"} 1.0' in scrape
        assert 'sparsegate_request_access_total{expert_group="b",result="narrowed"} 2.0' in scrape
    finally:
        await client.close()


def app_engine(client: TestClient):
    return client.server.app[STATE].engine


class _Reviewer:
    """TokenReview stand-in: one token authenticates ns/caller-a, "down" cannot be reviewed."""

    async def review(self, token: str):
        from sparsegate_workload.caller_auth import Caller, ReviewUnavailable

        if token == "down":
            raise ReviewUnavailable("API server unreachable")
        return Caller("ns", "caller-a") if token == "token-a" else None


async def test_access_refusals_on_the_openai_routes_answer_in_openai_s_error_shape(checkpoint):
    """The access guard refuses before any handler runs; on the OpenAI routes its refusals are
    still OpenAI errors (details inside the error object), elsewhere the server's own shape."""
    from sparsegate.domain.policy import rules_from_spec
    from sparsegate.domain.request_access import access_document
    from sparsegate_workload.admin import StaticToken
    from sparsegate_workload.server import create_admin_app

    groups = {"a": (0, 1, 2, 3), "b": (4, 5, 6, 7)}  # every expert in a group
    app = create_app(gate_doc=DYNAMIC, model_path=str(checkpoint), expert_groups=groups, reviewer=_Reviewer())
    client = await _serve(app)
    admin = TestClient(TestServer(create_admin_app(app, auth=StaticToken("adm")), host="127.0.0.1"))
    await admin.start_server()
    body = {"prompt": "the gate keeps", "temperature": 0, "max_tokens": 4}
    chat = {"messages": [{"role": "user", "content": "route this"}], "temperature": 0, "max_tokens": 4}

    async def post(path: str, payload: dict, token: str | None = None, group: str | None = None):
        headers = {**({"Authorization": f"Bearer {token}"} if token else {}),
                   **({EXPERT_GROUP_HEADER: group} if group else {})}
        resp = await client.post(path, json=payload, headers=headers)
        return resp.status, await resp.json()

    try:
        status, out = await post("/v1/completions", body, "token-a", "a")
        assert status == 503 and out["error"]["type"] == "server_error" and "no access rules" in out["error"]["message"]
        rules = rules_from_spec(namespace="ns", name="allow-a", spec={
            "action": "Allow", "sources": [{"serviceAccount": "caller-a"}],
            "targets": [{"sparseModel": "moe", "expertGroups": ["a"]}]})
        doc = access_document(rules, namespace="ns", model="moe", serving_port=8080, trust_domain="cluster.local")
        resp = await admin.put("/admin/access", json=doc, headers={"Authorization": "Bearer adm"})
        assert resp.status == 200 and (await resp.json())["enforced"] is True

        status, out = await post("/v1/completions", body)
        assert status == 401 and out["error"]["type"] == "invalid_request_error"
        assert "missing Bearer token" in out["error"]["message"] and out["error"]["param"] is None
        status, out = await post("/v1/chat/completions", chat, "down", "a")
        assert status == 503 and "cannot verify the caller" in out["error"]["message"]
        status, out = await post("/v1/chat/completions", chat, "token-a", "b")
        assert status == 403 and out["error"]["caller"] == "ns/caller-a" and out["error"]["expertGroup"] == "b"
        assert out["error"]["type"] == "invalid_request_error" and "default deny" in out["error"]["message"]
        status, out = await post("/v1/completions", body, "token-a", "nope")
        assert status == 400 and EXPERT_GROUP_HEADER in out["error"]["message"]
        status, out = await post("/v1/completions", body, "token-a", "a")
        assert status == 200 and out["usage"]["sparsegate"]["expert_group"] == "a"
        # /v1/infer keeps the server's shape.
        status, out = await post("/v1/infer", {"tokens": [[1, 2, 3]]})
        assert status == 401 and out["status"] == 401 and "missing Bearer token" in out["error"]
        # The whole model allowed, but both groups (every expert) denied: a refusal on every route,
        # not a 500 from the engine (OpenAI routes) or a forward with no expert (/v1/infer).
        assert sorted(e for g in groups.values() for e in g) == list(range(app[STATE].hf.num_experts))
        rules = [*rules_from_spec(namespace="ns", name="allow-all", spec={
                     "action": "Allow", "sources": [{"serviceAccount": "caller-a"}],
                     "targets": [{"sparseModel": "moe"}]}),
                 *rules_from_spec(namespace="ns", name="deny-groups", spec={
                     "action": "Deny", "sources": [{"serviceAccount": "caller-a"}],
                     "targets": [{"sparseModel": "moe", "expertGroups": ["a", "b"]}]})]
        doc = access_document(rules, namespace="ns", model="moe", serving_port=8080, trust_domain="cluster.local")
        assert (await admin.put("/admin/access", json=doc, headers={"Authorization": "Bearer adm"})).status == 200
        for path, payload in (("/v1/completions", body), ("/v1/chat/completions", chat),
                              ("/v1/infer", {"tokens": [[1, 2, 3]]})):
            status, out = await post(path, payload, "token-a")
            message = out["error"]["message"] if path != "/v1/infer" else out["error"]
            assert status == 403 and "every expert is in a group denied to this caller (a, b)" in message, (path, out)
    finally:
        await admin.close()
        await client.close()
