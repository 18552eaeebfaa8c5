"""The operator's direct scrape (clients.metrics_source.parse_pod_counters) reading a real model
server that holds a request-level canary: each version gets its own probe-set NLL, which the
qualityDrop check (domain.analysis.quality_check) compares."""

from __future__ import annotations

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from sparsegate.clients.metrics_source import parse_pod_counters
from sparsegate_contracts.canary import gate_set_document
from sparsegate_contracts.gate import DEFAULT_PARAMS, make_document
from sparsegate_workload.admin import StaticToken
from sparsegate_workload.server import STATE, create_admin_app, create_app, wait_ready

TOKEN = "probe-per-version-token"
STABLE = make_document({**DEFAULT_PARAMS, "confidenceThreshold": 0.3, "capacityFactor": 8})
CANARY = make_document({**DEFAULT_PARAMS, "confidenceThreshold": 0.95, "capacityFactor": 8})


async def test_each_version_held_reads_its_own_probe_nll() -> None:
    app = create_app(gate_doc=STABLE)
    async with TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0)) as c:
        await wait_ready(app)
        async with TestClient(TestServer(create_admin_app(app, auth=StaticToken(TOKEN)), host="127.0.0.1")) as a:
            resp = await a.put("/admin/gate", headers={"Authorization": f"Bearer {TOKEN}"},
                               json=gate_set_document(STABLE.to_json(), CANARY.to_json(), weight=0.2))
            assert resp.status == 200, await resp.text()
            text = await (await c.get("/metrics")).text()  # read right after the PUT, as the operator does
            scores = app[STATE].metrics.quality.probe_scores
    stable = parse_pod_counters(text, at=1.0, gate_version=STABLE.version)
    canary = parse_pod_counters(text, at=1.0, gate_version=CANARY.version)
    assert stable.probe_nll == scores[STABLE.version].mean_nll
    assert canary.probe_nll == scores[CANARY.version].mean_nll
    assert stable.probe_nll != canary.probe_nll
    # A version the pod does not hold has no probe score (the check then falls back to live traffic).
    assert parse_pod_counters(text, at=1.0, gate_version="g-000000000000").probe_nll is None
