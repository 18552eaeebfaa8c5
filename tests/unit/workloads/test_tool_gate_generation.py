"""Tools on the OpenAI generation routes, through a real in-process server on the tiny Mixtral
checkpoint with a tool-gate head fitted (hf.fit_tool_head) to fire where an ``add`` or ``slow:``
line reaches ``=``, and a loopback HTTP tool server the test starts: a completion whose prompt
reaches ``add 12+30=`` gets ``42`` forced and decodes on after it exactly as the model continues
``add 12+30=42``; the stream shows the forced tokens; a request decoding beside one parked on an
unanswered tool finishes first; a tool timeout degrades to the model's own tokens (200)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint, fit_tool_head, load_moe_checkpoint
from sparsegate_workload.server import STATE, create_app, wait_ready
from sparsegate_workload.tools import HttpTool, ToolRegistry
from sparsegate_workload.training.corpus import generate_lines

GATE = make_document(DEFAULT_PARAMS)  # toolGateThreshold 0.85


def _fires(prefix: str) -> bool:
    line = prefix.rsplit("\n", 1)[-1]
    return line.endswith("=") and line.startswith(("add ", "slow: "))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = build_tiny_checkpoint(tmp_path_factory.mktemp("tgg") / "tiny", family="mixtral")
    lm = load_moe_checkpoint(directory)
    texts = [t for t, _ in generate_lines(240, seed=1)]
    texts += [f"slow: {a}+{b}={a + b}" for a, b in zip(range(3, 300, 7), range(5, 400, 11))]
    fit_tool_head(lm, texts, fires=_fires).save(directory)
    return directory


class ToolServer:
    """POST /slow answers {"result": "7"} once ``release`` is set (or after ``hold_s``)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.called = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body["tool"] == "slow"
        self.called.set()
        try:
            await asyncio.wait_for(self.release.wait(), self.hold_s)
        except asyncio.TimeoutError:
            pass
        return web.json_response({"result": "7"})


@pytest.fixture
async def serve(checkpoint):
    opened = []

    async def start(*, hold_s=5.0, timeout_ms=5000):
        tool = ToolServer(hold_s)
        app = web.Application()
        app.router.add_post("/slow", tool.handle)
        tool_client = TestClient(TestServer(app, host="127.0.0.1"))
        await tool_client.start_server()
        registry = ToolRegistry(http={"slow": HttpTool(
            "slow", str(tool_client.make_url("/slow")), timeout_ms=timeout_ms)})
        server = create_app(gate_doc=GATE, model_path=str(checkpoint), tool_registry=registry)
        client = TestClient(TestServer(server, host="127.0.0.1"),
                            connector=aiohttp.TCPConnector(limit=0))
        await client.start_server()
        await wait_ready(server)
        opened.extend([client, tool_client])
        return client, tool
    yield start
    for c in opened:
        await c.close()


def _reference(client, text: str, max_tokens: int) -> str:
    """The model's own greedy text after ``text`` (no tools), decoded alone."""
    hf = client.server.app[STATE].hf
    gen = hf.generate(hf.tokenizer(text)["input_ids"], max_tokens=max_tokens)
    return hf.tokenizer.decode(gen.token_ids, skip_special_tokens=True)


async def test_the_calculator_result_is_forced_and_decoding_continues_after_it(serve, caplog):
    client, _ = await serve()
    body = {"prompt": "add 12+30=", "temperature": 0, "max_tokens": 8}
    with caplog.at_level(logging.INFO, logger="sparsegate.tools"):
        resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "gen-1"})
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    text = out["choices"][0]["text"]
    [call] = out["usage"]["sparsegate"]["tool_calls"]
    print(f"\ncompletion {text!r}, call {call}")
    assert call["tool"] == "calculator" and call["outcome"] == "ok"
    assert call["forced_text"] == "42" and call["forced_tokens"] == 2
    assert call["completion_offset"] == 0 and call["position"] == 9 and call["gate_probability"] > 0.85
    assert text.startswith("42") and out["usage"]["completion_tokens"] == 8
    # After the forced tokens the model decodes on from its extended cache.
    assert text[2:] == _reference(client, "add 12+30=42", 6)
    assert text != _reference(client, "add 12+30=", 8)  # without the tool it says something else
    [audit] = [json.loads(r.getMessage().split(" ", 2)[2]) for r in caplog.records
               if r.getMessage().startswith("tool call ")]
    assert audit["requestId"] == "gen-1" and audit["position"] == 9 and audit["outcome"] == "ok"
    metrics = await (await client.get("/metrics")).text()
    assert 'sparsegate_tool_calls_total{outcome="ok",tool="calculator"} 1.0' in metrics

    stream = await client.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}})
    raw = (await stream.read()).decode()
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    pieces = [c["choices"][0]["text"] for c in chunks if c.get("choices")]
    assert pieces[:2] == ["4", "2"] and "".join(pieces) == text
    assert chunks[-1]["usage"]["sparsegate"]["tool_calls"][0]["forced_text"] == "42"


async def test_a_request_beside_one_waiting_for_its_tool_is_not_held_up(serve):
    client, tool = await serve(hold_s=20.0)
    slow = asyncio.create_task(client.post("/v1/completions", json={
        "prompt": "slow: 3+4=", "temperature": 0, "max_tokens": 6}))
    await asyncio.wait_for(tool.called.wait(), 30)  # parked: its tool holds the answer
    started = time.perf_counter()
    resp = await client.post("/v1/completions", json={
        "prompt": "the big cat sees the old dog.", "temperature": 0, "max_tokens": 8})
    assert resp.status == 200
    other = await resp.json()
    print(f"\nbeside a parked request: 8 tokens in {(time.perf_counter() - started) * 1000:.0f} ms")
    assert not slow.done() and not tool.release.is_set(), "it finished while the tool still held"
    assert other["usage"]["completion_tokens"] == 8 and other["usage"]["sparsegate"]["tool_calls"] == []
    tool.release.set()
    out = await (await slow).json()
    [call] = out["usage"]["sparsegate"]["tool_calls"]
    assert call["tool"] == "slow" and call["outcome"] == "ok" and call["forced_text"] == "7"
    assert out["choices"][0]["text"].startswith("7")
    assert out["choices"][0]["text"][1:] == _reference(client, "slow: 3+4=7", 5)


async def test_a_tool_timeout_degrades_to_plain_decoding(serve):
    client, _ = await serve(hold_s=2.0, timeout_ms=100)
    resp = await client.post("/v1/completions", json={
        "prompt": "slow: 3+4=", "temperature": 0, "max_tokens": 6})
    assert resp.status == 200
    out = await resp.json()
    calls = out["usage"]["sparsegate"]["tool_calls"]
    assert calls and all(c["outcome"] == "timeout" and c["forced_tokens"] == 0 for c in calls), calls
    assert 90 <= calls[0]["latency_ms"] < 1500 and len(calls) <= 4
    assert out["choices"][0]["text"] == _reference(client, "slow: 3+4=", 6)


async def test_forced_text_reports_only_what_max_tokens_kept(serve):
    # max_tokens 1: the completion keeps the first of 42's two tokens, and so does its record.
    client, _ = await serve()
    resp = await client.post("/v1/completions", json={"prompt": "add 12+30=", "temperature": 0,
                                                      "max_tokens": 1})
    assert resp.status == 200, await resp.text()
    out = await resp.json()
    [call] = out["usage"]["sparsegate"]["tool_calls"]
    assert out["choices"][0]["text"] == "4" and out["choices"][0]["finish_reason"] == "length"
    assert call["outcome"] == "ok" and call["forced_text"] == "4" and call["forced_tokens"] == 1
