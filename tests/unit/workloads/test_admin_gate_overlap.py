"""Two ``PUT /admin/gate`` in flight at once on a checkpoint (whose swap awaits the model thread):
the one that arrived last must be what the server holds, and each answer must describe the set its
own PUT left in force. The operator can send such a pair: a PUT that timed out on its side keeps
running on the pod (the admin listener does not cancel handlers) while it pushes the next set
(an abort, a rollback, the next step)."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_contracts.canary import gate_set_document
from sparsegate_workload import server
from sparsegate_workload.admin import StaticToken
from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint
from sparsegate_workload.hf_serving import HFServedModel
from sparsegate_workload.server import STATE, create_admin_app, create_app, wait_ready

TOKEN = "overlap-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ONE = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 1, "capacityFactor": 8})
TWO = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 2, "maxExpertsPerToken": 2, "capacityFactor": 8})
THREE = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 3, "maxExpertsPerToken": 3, "capacityFactor": 8})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("overlap") / "tiny", family="mixtral")


def _served(body: dict) -> tuple[str, str | None]:
    return body["version"], body["canary"]["version"] if "canary" in body else None


@pytest.mark.parametrize(("older", "newer", "newer_set"), [
    # Abort while a canary step's PUT is still preparing the canary: the abort's stable-only set
    # was already held, so it was answered "unchanged", and the canary landed after it.
    (gate_set_document(ONE.to_json(), TWO.to_json(), weight=0.5), ONE.to_json(), (ONE.version, None)),
    # The older PUT's stable swap queued behind the newer one's on the model thread: the older
    # set was installed last, after the newer one had been answered as applied.
    (gate_set_document(THREE.to_json(), TWO.to_json(), weight=0.5), TWO.to_json(), (TWO.version, None)),
], ids=["abort-during-canary-prepare", "older-swap-finishes-last"])
async def test_overlapping_puts_leave_the_newer_set_in_force(checkpoint, monkeypatch, older, newer, newer_set):
    # Hold the model thread inside the older PUT's canary preparation until the newer PUT is in.
    entered, release = threading.Event(), threading.Event()
    prepare = HFServedModel.prepare_gate

    def held_prepare(self, *args, **kwargs):
        if not entered.is_set():
            entered.set()
            assert release.wait(timeout=30)
        return prepare(self, *args, **kwargs)
    monkeypatch.setattr(HFServedModel, "prepare_gate", held_prepare)
    # The newer PUT's body is read: from here it runs until its next await (its answer, a model
    # thread job, or waiting its turn).
    newer_read = asyncio.Event()
    read_json = server.read_json

    async def noted_read(request):
        body = await read_json(request)
        if body == newer:
            newer_read.set()
        return body
    monkeypatch.setattr(server, "read_json", noted_read)

    app = create_app(gate_doc=ONE, model_path=str(checkpoint))
    async with TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0)) as c:
        await wait_ready(app)
        async with TestClient(TestServer(create_admin_app(app, auth=StaticToken(TOKEN)), host="127.0.0.1")) as a:
            async def put(body):
                resp = await a.put("/admin/gate", json=body, headers=AUTH)
                return resp.status, await resp.json()
            try:
                first = asyncio.create_task(put(older))
                assert await asyncio.to_thread(entered.wait, 30)
                second = asyncio.create_task(put(newer))
                await asyncio.wait_for(newer_read.wait(), 30)
                await asyncio.sleep(0.05)  # let it reach that next await
            finally:
                release.set()
            (s1, b1), (s2, b2) = await first, await second
            assert (s1, s2) == (200, 200), (b1, b2)
            assert b2["applied"] is True, b2
            assert _served(b2) == newer_set  # the newer answer says what it left in force ...
            state = app[STATE]
            held = (state.gate.doc.version, state.canary.gate.doc.version if state.canary else None)
            assert held == newer_set  # ... and it is still in force once both have answered
            assert state.hf.lm.gate.version == state.gate.doc.version  # routing agrees with the report
            health = await (await c.get("/healthz")).json()
            assert (health["gateVersion"], health.get("canary", {}).get("version")) == newer_set
            assert _served(b1) == (older["version"], older["canary"]["version"])  # the older one's own set
