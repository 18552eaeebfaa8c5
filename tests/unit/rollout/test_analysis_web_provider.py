"""The ``web`` analysis provider against a tiny HTTP server this test starts on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from sparsegate.clients.analysis_providers import MeasureRequest, WebRequest, measure_safely
from sparsegate.domain.analysis_run import MeasurementPhase, judge, parse_checks

ARGS = {"canaryVersion": "g-new", "namespace": "ns"}


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[dict]]]:
    seen: list[dict] = []

    async def score(request: web.Request) -> web.Response:
        seen.append({"method": request.method, "query": dict(request.query), "body": await request.text(),
                     "key": request.headers.get("X-Key"), "type": request.headers.get("Content-Type")})
        return web.json_response({"data": {"items": [{"score": 0.93}], "ok": True, "text": "0.5", "none": None,
                                           "said": "the launch code is 1234"}})

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html>")

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2)
        return web.json_response(1)

    app = web.Application()
    app.router.add_route("*", "/score", score)
    app.router.add_get("/broken", broken)
    app.router.add_get("/html", html)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def web_check(url: str, **provider: object):
    (c,) = parse_checks({"checks": [{"name": "q", "provider": {"web": {"url": url, **provider}},
                                     "successCondition": "result >= 0.9"}]})
    return c


async def measure(c):
    return await measure_safely(WebRequest(), c, MeasureRequest(namespace="ns", now=50.0, args=ARGS))


async def test_get_selects_the_number_with_placeholders(server) -> None:
    base, seen = server
    c = web_check(base + "/score?v={{args.canaryVersion}}&ns={{args.namespace}}", jsonPath="$.data.items[0].score",
                  headers=[{"name": "X-Key", "value": "secret"}])
    m = await measure(c)
    assert m.value == 0.93 and m.error is None and m.at == 50.0
    assert seen[-1] == {"method": "GET", "query": {"v": "g-new", "ns": "ns"}, "body": "", "key": "secret",
                        "type": None}
    assert judge(c, m, now=50).phase == MeasurementPhase.SUCCESSFUL


async def test_post_sends_the_rendered_body(server) -> None:
    base, seen = server
    c = web_check(base + "/score", method="POST", body='{"version": "{{args.canaryVersion}}"}', jsonPath="data.ok")
    m = await measure(c)
    assert m.value == 1.0  # true counts as 1
    assert seen[-1]["method"] == "POST" and json.loads(seen[-1]["body"]) == {"version": "g-new"}
    assert seen[-1]["type"] == "application/json"


async def test_a_declared_content_type_is_kept_whatever_its_case(server) -> None:
    """Header names are case-insensitive: a lowercase content-type was replaced by application/json."""
    base, seen = server
    c = web_check(base + "/score", method="POST", body="v={{args.canaryVersion}}", jsonPath="data.ok",
                  headers=[{"name": "content-type", "value": "application/x-www-form-urlencoded"}])
    assert (await measure(c)).value == 1.0
    assert seen[-1]["type"] == "application/x-www-form-urlencoded" and seen[-1]["body"] == "v=g-new"


@pytest.mark.parametrize(("path", "json_path", "value", "error"), [
    ("/score", "$.data.text", 0.5, None),  # numeric strings are numbers
    ("/score", "$.data.none", None, None),  # null: no data (inconclusive)
    ("/score", "$.data.items", None, "$.data.items is an array of 1 items, not a number"),
    ("/score", "$.data", None, "$.data is an object of 5 fields, not a number"),
    ("/score", "$.data.missing", None, "$.data has no field 'missing'"),
    ("/broken", None, None, "HTTP 500"),
    ("/html", None, None, "Expecting value"),
    ("/slow", None, None, "TimeoutError"),
])
async def test_answers_that_are_not_a_number(server, path: str, json_path: str | None, value: float | None,
                                             error: str | None) -> None:
    base, _ = server
    fields = {"timeout": "500ms"} if path == "/slow" else {}
    if json_path:
        fields["jsonPath"] = json_path
    m = await measure(web_check(base + path, **fields))
    assert m.value == value
    if error is None:
        assert m.error is None
    else:
        assert m.error is not None and error in m.error


async def test_a_text_answer_is_described_never_quoted_in_the_measurement(server) -> None:
    """The message lands in the GateConfig's status; the operator's requests reach pods the GateConfig's
    authors could not (its source is always allowed by the agents): a model's completion text quoted
    there leaked it to another namespace."""
    base, _ = server
    m = await measure(web_check(base + "/score", jsonPath="$.data.said"))
    assert m.value is None and m.error is not None
    assert "a string of 23 characters, not a number" in m.error and "launch" not in m.error


async def test_unreachable_server_is_an_error_not_an_exception() -> None:
    m = await measure(web_check("http://127.0.0.1:9/score"))
    assert m.error is not None and "127.0.0.1:9" in m.error
