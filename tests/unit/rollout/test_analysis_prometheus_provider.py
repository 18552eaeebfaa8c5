"""The ``prometheus`` analysis provider against a tiny Prometheus API this test starts on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sparsegate.clients.analysis_providers import MeasureRequest, PrometheusQuery, measure_safely
from sparsegate.domain.analysis_run import MeasurementPhase, judge, parse_checks


def _vector(*values: str) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"i": str(i)}, "value": [1, v]} for i, v in enumerate(values)]}}


ANSWERS: dict[str, dict[str, Any]] = {
    "one": _vector("0.01"),
    "empty": _vector(),
    "nan": _vector("NaN"),
    "two": _vector("1", "2"),
    "scalar": {"status": "success", "data": {"resultType": "scalar", "result": [1, "0.01"]}},
    "scalar-nan": {"status": "success", "data": {"resultType": "scalar", "result": [1, "NaN"]}},
    "matrix": {"status": "success", "data": {"resultType": "matrix", "result": []}},
}


@pytest.fixture
async def address() -> AsyncIterator[str]:
    async def query(request: web.Request) -> web.Response:
        assert request.method == "POST"  # long pod alternations do not fit a URL
        return web.json_response(ANSWERS[(await request.post())["query"]])

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    async with TestServer(app, host="127.0.0.1") as srv:
        yield f"http://127.0.0.1:{srv.port}"


@pytest.mark.parametrize(("query", "value", "error", "phase"), [
    ("one", 0.01, None, MeasurementPhase.SUCCESSFUL),
    ("scalar", 0.01, None, MeasurementPhase.SUCCESSFUL),
    ("empty", None, None, MeasurementPhase.INCONCLUSIVE),  # no data
    ("nan", None, None, MeasurementPhase.INCONCLUSIVE),
    # scalar(sum(...)) of nothing is NaN: no data like a NaN series (it was answered as the value NaN,
    # counted as answer="value" in sparsegate_rollout_analysis_measurements_total).
    ("scalar-nan", None, None, MeasurementPhase.INCONCLUSIVE),
    ("two", None, "2 series", MeasurementPhase.ERROR),
    ("matrix", None, "a matrix", MeasurementPhase.ERROR),
])
async def test_instant_query_answers(address: str, query: str, value: float | None, error: str | None,
                                     phase: MeasurementPhase) -> None:
    (c,) = parse_checks({"checks": [{"name": "q", "provider": {"prometheus": {"query": query}},
                                     "successCondition": "result < 0.05"}]})
    m = await measure_safely(PrometheusQuery(default_address=address), c, MeasureRequest(namespace="ns", now=50.0))
    assert m.value == value
    assert (m.error is None) if error is None else (m.error is not None and error in m.error)
    assert judge(c, m, now=50.0).phase == phase
