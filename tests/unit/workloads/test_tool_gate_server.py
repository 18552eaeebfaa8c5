"""The built-in model's tool gate calling tools on a real in-process model server, with HTTP
tools served by an aiohttp server this test starts on loopback: a firing gate calls the
calculator or the HTTP tool and the result is forced as the next tokens; a slow tool times out
and a failing one errors, both leaving plain decoding with 200; audit lines and metrics."""

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.server import create_app, wait_ready
from sparsegate_workload.tools import ToolRegistry, parse_tools

# sigmoid > 0 everywhere: the gate fires at every position (and never above 1.0).
FIRING = make_document({**DEFAULT_PARAMS, "toolGateThreshold": 0.0})
SILENT = make_document({**DEFAULT_PARAMS, "toolGateThreshold": 1.0})


def _tool_app(seen: list) -> web.Application:
    async def upper(request):
        body = await request.json()
        seen.append(body)
        return web.json_response({"result": body["arguments"].upper()})

    async def slow(request):
        await asyncio.sleep(2)
        return web.json_response({"result": "late"})

    async def broken(request):
        return web.json_response({"error": "boom"}, status=500)
    app = web.Application()
    app.router.add_post("/upper", upper)
    app.router.add_post("/slow", slow)
    app.router.add_post("/broken", broken)
    return app


async def _infer(client, rows, request_id=None):
    headers = {"X-Request-Id": request_id} if request_id else {}
    resp = await client.post("/v1/infer", json={"tokens": rows}, headers=headers)
    assert resp.status == 200, await resp.text()
    return await resp.json()


def _samples(text: str, name: str) -> dict:
    return {tuple(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name}


async def test_tool_gate_calls_tools_and_degrades_on_failure(caplog):
    caplog.set_level(logging.INFO, logger="sparsegate.tools")
    seen: list = []
    async with TestServer(_tool_app(seen), host="127.0.0.1") as tool_server:
        base = f"http://127.0.0.1:{tool_server.port}"
        registry = ToolRegistry(http=parse_tools([
            {"name": "upper", "url": f"{base}/upper", "timeoutMs": 2000},
            {"name": "slow", "url": f"{base}/slow", "timeoutMs": 100},
            {"name": "broken", "url": f"{base}/broken", "timeoutMs": 2000}]))
        # Equal lengths (one batch); each segment ends at the last position, where it fires.
        rows = [list(b"xy\n2+3*4="), list(b"\nupper:ab"), list(b"\nslow: zz"),
                list(b"broken: a"), list(b"\nno tool!")]
        assert len({len(r) for r in rows}) == 1
        plain_app, app = create_app(gate_doc=SILENT), create_app(gate_doc=FIRING,
                                                                tool_registry=registry)
        async with TestClient(TestServer(plain_app, host="127.0.0.1")) as plain, \
                TestClient(TestServer(app, host="127.0.0.1")) as client:
            await wait_ready(plain_app)
            await wait_ready(app)
            model_only = await _infer(plain, rows)
            assert model_only["toolResults"] == [None] * 5   # gate silent: plain decoding
            out = await _infer(client, rows, request_id="req-42")
            metrics_text = await (await client.get("/metrics")).text()

    calc, upper, slow, broken, none = out["toolResults"]
    # The calculator's result is forced: "14" -> next token '1', continuation [49, 52].
    assert (calc["tool"], calc["outcome"], calc["tokens"]) == ("calculator", "ok", list(b"14"))
    assert out["nextTokens"][0] == ord("1") != model_only["nextTokens"][0]
    assert (upper["tool"], upper["outcome"], upper["tokens"]) == ("upper", "ok", list(b"AB"))
    assert out["nextTokens"][1] == ord("A") != model_only["nextTokens"][1]
    assert seen == [{"tool": "upper", "arguments": "ab"}]
    # Failures: request 200, the model's own next token, the outcome recorded.
    assert (slow["outcome"], slow["tokens"]) == ("timeout", [])
    assert 90 <= slow["latencyMs"] < 1500
    assert (broken["outcome"], broken["tokens"]) == ("error", [])
    assert "HTTP 500" in broken["detail"]
    assert none is None
    assert out["nextTokens"][2:] == model_only["nextTokens"][2:]
    for rec in (calc, upper, slow, broken):
        assert rec["requestId"] == "req-42" and rec["position"] == 8
        assert 0.0 < rec["gateProbability"] <= 1.0 and len(rec["argumentsDigest"]) == 64

    calls = _samples(metrics_text, "sparsegate_tool_calls_total")
    for tool, outcome in (("calculator", "ok"), ("upper", "ok"), ("slow", "timeout"),
                          ("broken", "error")):
        assert calls[(("outcome", outcome), ("tool", tool))] == 1.0
    counts = _samples(metrics_text, "sparsegate_tool_call_duration_seconds_count")
    assert counts[(("tool", "slow"),)] == 1.0

    audits = [json.loads(r.getMessage().split(" ", 2)[2]) for r in caplog.records
              if r.name == "sparsegate.tools"]
    assert sorted((a["tool"], a["outcome"]) for a in audits) == [
        ("broken", "error"), ("calculator", "ok"), ("slow", "timeout"), ("upper", "ok")]
