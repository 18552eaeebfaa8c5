"""The model server builds the shape it is told (SparseModel spec.model via flags), reports it,
and refuses gates that ask for more experts than the model has (422 on PUT, exit 2 at start)."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_workload.gateparams import DEFAULT_PARAMS, GateParams, make_document
from sparsegate_workload.model import ModelConfig, effective_gate
from sparsegate_workload.admin import StaticToken
from sparsegate_workload.server import create_admin_app, create_app, wait_ready
from localcluster.ports import free_port

TOKEN = "shape-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SMALL = ModelConfig(d_model=32, num_experts=4, n_layers=1, d_ff=64, vocab_size=100,
                    max_experts_per_token=2)


def test_default_shape_is_the_tiny_model() -> None:
    assert ModelConfig().shape() == {"dModel": 64, "experts": 8, "layers": 2, "heads": 4,
                                     "dFF": 128, "vocab": 512, "maxSeqLen": 256,
                                     "minExpertsPerToken": 1, "maxExpertsPerToken": 8, "seed": 0}


@pytest.mark.parametrize("kwargs, message", [
    ({"d_model": 40, "n_heads": 3}, "d_model (40) must be a multiple of n_heads (3)"),
    ({"d_model": 0}, "d_model must be >= 1"),
    ({"num_experts": 0}, "num_experts must be >= 1"),
    ({"num_experts": 65}, "at most 64"),
    ({"num_experts": 4, "max_experts_per_token": 5}, "<= num_experts (4)"),
    ({"min_experts_per_token": 3, "max_experts_per_token": 2}, "min (3) <= max (2)"),
])
def test_impossible_shapes_are_refused_with_the_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="invalid model shape") as info:
        ModelConfig(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("gate, bounds, expected", [
    ((1, 4), (1, 8), (1, 4)),   # inside the model's bounds: unchanged
    ((1, 4), (1, 2), (1, 2)),   # the model allows at most 2
    ((3, 3), (1, 2), (2, 2)),   # a minimum above the model's maximum is lowered to it
    ((1, 1), (2, 4), (2, 2)),   # the model needs at least 2
])
def test_gate_range_is_clamped_into_the_models(gate, bounds, expected) -> None:
    cfg = ModelConfig(num_experts=8, min_experts_per_token=bounds[0],
                      max_experts_per_token=bounds[1])
    p = effective_gate(GateParams(min_experts_per_token=gate[0], max_experts_per_token=gate[1]), cfg)
    assert (p.min_experts_per_token, p.max_experts_per_token) == expected


@pytest.fixture
async def small_client():
    app = create_app(model_config=SMALL)
    async with TestClient(TestServer(app, host="127.0.0.1"),
                          connector=aiohttp.TCPConnector(limit=0)) as c:
        await wait_ready(app)
        yield c


async def test_server_builds_reports_and_serves_the_given_shape(small_client) -> None:
    health = await (await small_client.get("/healthz")).json()
    assert health["model"] == SMALL.shape()
    info = await (await small_client.get("/v1/model")).json()
    assert info == {"model": SMALL.shape(), "loaded": True}
    resp = await small_client.post("/v1/infer", json={"tokens": [[1, 2, 99]], "returnLogits": True})
    body = await resp.json()
    assert resp.status == 200, body
    assert len(body["expertCounts"]) == 1 and len(body["expertCounts"][0]) == 4  # [layer][expert]
    assert len(body["logits"][0]) == 100 and len(body["precisions"]) == 1
    # the default gate allows 4 experts per token; this model allows 2
    assert 1 <= body["activeExpertsPerToken"] <= 2
    resp = await small_client.post("/v1/infer", json={"tokens": [[100]]})
    assert resp.status == 422 and "[0, 100)" in (await resp.json())["error"]


@pytest.fixture
async def small_admin(small_client):
    async with TestClient(TestServer(create_admin_app(small_client.server.app, auth=StaticToken(TOKEN)),
                                     host="127.0.0.1")) as c:
        yield c


async def test_gate_asking_for_more_experts_than_the_model_has_is_refused(small_client, small_admin) -> None:
    too_many = make_document({**DEFAULT_PARAMS, "maxExpertsPerToken": 6}).to_json()
    resp = await small_admin.put("/admin/gate", json=too_many, headers=AUTH)
    body = await resp.json()
    assert resp.status == 422
    assert "maxExpertsPerToken" in body["error"] and "4 experts" in body["error"]
    assert (await (await small_admin.get("/admin/gate", headers=AUTH)).json())["version"] != too_many["version"]
    # within the expert count but above the model's per-token maximum: applied, then clamped
    three = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 3, "maxExpertsPerToken": 3,
                           "capacityFactor": 8}).to_json()
    resp = await small_admin.put("/admin/gate", json=three, headers=AUTH)
    body = await resp.json()
    assert resp.status == 200 and body["applied"] is True
    assert body["effectiveExpertsPerToken"] == {"min": 2, "max": 2}
    out = await (await small_client.post("/v1/infer", json={"tokens": [[1, 2, 3, 4]]})).json()
    assert out["gateVersion"] == three["version"] and out["activeExpertsPerToken"] == 2.0


@pytest.mark.parametrize("d_model, heads", [(64, 4), (30, 2), (99, 1)])
def test_any_hidden_size_the_crd_admits_builds_and_runs(d_model: int, heads: int) -> None:
    """dModel is any integer >= 1 in the CRD: heads adapt, unaligned widths use the loop experts."""
    import argparse

    from sparsegate_workload.inference import run_batch
    from sparsegate_workload.model import build_model
    from sparsegate_workload.server import add_model_flags, model_config_from_args

    p = argparse.ArgumentParser()
    add_model_flags(p)
    cfg = model_config_from_args(argparse.Namespace(**vars(p.parse_args(
        ["--d-model", str(d_model), "--experts", "3", "--layers", "1"])), seed=0))
    assert (cfg.n_heads, cfg.d_ff) == (heads, 2 * d_model)
    model = build_model(cfg)
    for policy in ("fp32", "bf16"):
        out = run_batch(model, [[1, 2, 3, 4]], gate=GateParams(max_experts_per_token=3, capacity_factor=8.0),
                        precisions=model.resolve_precisions(policy))
        # capacityFactor 8 drops nothing: every token reaches at least one expert
        assert len(out.expert_counts) == 1 and sum(out.expert_counts[0]) >= 4



def _server(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sparsegate_workload.server", *args],
                            env=os.environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_entry_point_flags_build_the_shape_and_healthz_reports_it() -> None:
    port = free_port()
    proc = _server("--host", "127.0.0.1", "--port", str(port), "--d-model", "32",
                   "--experts", "6", "--layers", "1", "--vocab", "128",
                   "--min-experts-per-token", "1", "--max-experts-per-token", "3")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "server not ready in 30 s"
            time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz") as r:
            shape = json.load(r)["model"]
        assert shape == {"dModel": 32, "experts": 6, "layers": 1, "heads": 4, "dFF": 64,
                         "vocab": 128, "maxSeqLen": 256, "minExpertsPerToken": 1,
                         "maxExpertsPerToken": 3, "seed": 0}
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize("gate_params, flags, message", [
    ({**DEFAULT_PARAMS, "maxExpertsPerToken": 6}, ["--experts", "4"],
     "maxExpertsPerToken must be in [1, 4], got 6 (this model has 4 experts)"),
    (DEFAULT_PARAMS, ["--d-model", "30", "--heads", "4"],
     "invalid model shape: d_model (30) must be a multiple of n_heads (4)"),
    (DEFAULT_PARAMS, ["--experts", "4", "--max-experts-per-token", "5"], "<= num_experts (4)"),
])
def test_entry_point_refuses_to_start_with_a_clear_error(tmp_path, gate_params, flags, message) -> None:
    gate_file = tmp_path / "gate.json"
    gate_file.write_text(json.dumps(make_document(gate_params).to_json()))
    proc = _server("--port", str(free_port()), "--gate-config", str(gate_file), *flags)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert message in out.decode()
