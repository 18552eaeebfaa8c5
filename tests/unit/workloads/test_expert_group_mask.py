"""A request scoped to an expert group activates only that group's experts in every layer of the
built-in model (the gate masks the others before selection), whatever min/max experts ask."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from sparsegate_workload.gateparams import GateParams
from sparsegate_workload.inference import run_batch
from sparsegate_workload.model import build_model
from sparsegate_workload.server_state import STATE

FP32 = ("fp32", "fp32")


@pytest.fixture(scope="module")
def model():
    return build_model()


def _used(result) -> set[int]:
    return {e for layer in result.expert_counts for e, n in enumerate(layer) if n > 0}


def test_unscoped_requests_use_many_experts(model):
    tokens = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1)).tolist()
    assert len(_used(run_batch(model, tokens, gate=GateParams(), precisions=FP32))) > 4


@pytest.mark.parametrize("group", [[2, 3], [5], [0, 4, 7]])
@pytest.mark.parametrize("min_experts", [1, 3])
def test_scoped_requests_use_only_their_group(model, group, min_experts):
    tokens = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(2)).tolist()
    # No capacity cap here (its share is tested below): every token must reach its group.
    gate = dataclasses.replace(GateParams(), min_experts_per_token=min_experts, capacity_factor=None)
    result = run_batch(model, tokens, gate=gate, precisions=FP32, allowed_experts=group)
    assert _used(result) and _used(result) <= set(group)
    # every token still reaches at least one of its group's experts, in every layer
    assert all(sum(layer) >= len(tokens) * 32 for layer in result.expert_counts)
    assert result.selected_experts_per_token <= len(group)
    assert all(isinstance(t, int) for t in result.next_tokens)


@pytest.mark.parametrize("group", [[2, 3], [0, 4, 7, 5]])
def test_the_capacity_cap_of_a_scoped_request_is_its_groups_even_share(model, group):
    # capacityFactor is a multiple of the even share of a batch's assignments: over the experts
    # the request may use. Shared over all 8, a 2-expert group kept ~1/3 of its assignments
    # (default 1.25: 382 of 555 dropped) and most tokens skipped their MoE layers entirely.
    tokens = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(4)).tolist()
    result = run_batch(model, tokens, gate=GateParams(), precisions=FP32, allowed_experts=group)
    assert _used(result) <= set(group)
    n_assign = round(result.selected_experts_per_token * len(tokens) * 64)
    cap = -(-1.25 * n_assign // len(group))
    assert all(n <= cap + 1 for layer in result.expert_counts for n in layer)
    assert result.dropped_assignments <= 0.1 * n_assign * len(result.expert_counts)
    assert result.active_experts_per_token > 0.9 * result.selected_experts_per_token


def test_the_gate_caps_a_masked_batch_over_its_allowed_experts():
    from sparsegate_workload.gating import DynamicGate

    gate = DynamicGate(16, 8)
    gate.reset_parameters(torch.Generator().manual_seed(0))
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(8, dtype=torch.bool)
    allowed[[1, 6]] = True
    r = gate(x, confidence_threshold=0.6, min_experts=1, max_experts=1, capacity_factor=1.0,
             allowed=allowed)
    # 40 assignments over the 2 allowed experts: 20 each at factor 1 (over all 8 it was 5).
    assert r.capacity == 20 and set(e for e, n in enumerate(r.counts) if n) <= {1, 6}
    unmasked = gate(x, confidence_threshold=0.6, min_experts=1, max_experts=1, capacity_factor=1.0)
    assert unmasked.capacity == 5  # without a mask: the share over every expert, as before


async def test_the_server_narrows_a_request_to_its_named_group():
    from aiohttp.test_utils import TestClient, TestServer

    from sparsegate_contracts.request_access import EXPERT_GROUP_HEADER
    from sparsegate_workload.model import ModelConfig
    from sparsegate_workload.server import create_app, wait_ready

    app = create_app(model_config=ModelConfig(), expert_groups={"code": (2, 3)})
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        await wait_ready(app)
        body = {"tokens": [[1, 2, 3, 4, 5, 6, 7, 8]]}
        resp = await client.post("/v1/infer", json=body, headers={EXPERT_GROUP_HEADER: "code"})
        out = await resp.json()
        assert resp.status == 200, out
        assert {e for layer in out["expertCounts"] for e, n in enumerate(layer) if n} <= {2, 3}
        assert out["access"] == {"expertGroup": "code", "rule": "", "allowedExperts": [2, 3]}
        plain = await (await client.post("/v1/infer", json=body)).json()
        assert "access" not in plain and len({e for layer in plain["expertCounts"] for e, n in enumerate(layer) if n}) > 2
        resp = await client.post("/v1/infer", json=body, headers={EXPERT_GROUP_HEADER: "math"})
        assert resp.status == 400 and EXPERT_GROUP_HEADER in (await resp.json())["error"]
        resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                                 headers={EXPERT_GROUP_HEADER: "code"})
        # The OpenAI routes take the header too (per-sequence masks); the built-in model has no text API.
        assert resp.status == 404 and "no tokenizer" in (await resp.json())["error"]["message"]
        scrape = await (await client.get("/metrics")).text()
        assert 'sparsegate_request_access_total{expert_group="code",result="narrowed"} 2.0' in scrape
        assert 'sparsegate_request_access_total{expert_group="",result="bad_group"} 1.0' in scrape


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from sparsegate_workload.hf import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("olmoe"), family="olmoe", seed=1, tokenizer=False)


@pytest.mark.parametrize("params", [
    {"confidence_threshold": 0.9, "min_experts_per_token": 1, "max_experts_per_token": 8},
    {"min_experts_per_token": 4, "max_experts_per_token": 4},  # fixed k above the group's size
])
def test_a_checkpoint_scoped_request_uses_only_its_group(checkpoint, params):
    from sparsegate_contracts.gate import GateParams as Params
    from sparsegate_workload.hf import load_moe_checkpoint

    lm = load_moe_checkpoint(checkpoint)
    lm.set_gate(Params(**params), dropless=True)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(3))
    free = lm.forward(ids)
    assert len({e for st in free.layers for e, n in enumerate(st.counts) if n}) > 3
    scoped = lm.forward(ids, allowed_experts=[1, 5])
    used = {e for st in scoped.layers for e, n in enumerate(st.counts) if n}
    assert used and used <= {1, 5}
    assert all(sum(st.counts) >= ids.numel() for st in scoped.layers)  # dropless: every token routed


@pytest.mark.parametrize("params", [
    {"confidence_threshold": 0.9, "min_experts_per_token": 1, "max_experts_per_token": 2},
    {"min_experts_per_token": 2, "max_experts_per_token": 2},  # fixed k: the fast path too
])
def test_a_checkpoint_caps_a_scoped_request_over_its_group(checkpoint, params):
    from sparsegate_contracts.gate import GateParams as Params
    from sparsegate_workload.hf import load_moe_checkpoint

    lm = load_moe_checkpoint(checkpoint)
    lm.set_gate(Params(**params, capacity_factor=1.25))
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        scoped = lm.forward(ids, allowed_experts=[1, 5])
    for st in scoped.layers:
        assert {e for e, n in enumerate(st.counts) if n} <= {1, 5}
        n_assign = sum(st.counts) + st.dropped
        # capacity ceil(1.25 * n / 2) per allowed expert: both together hold every assignment
        assert st.dropped == 0 and n_assign >= ids.numel(), (st.counts, st.dropped)


async def test_a_checkpoint_server_refuses_groups_past_its_experts(checkpoint):
    from aiohttp.test_utils import TestClient, TestServer

    from sparsegate_workload.server import create_app

    app = create_app(model_path=str(checkpoint), expert_groups={"far": (63,)})
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for _ in range(600):
            if app[STATE].load_error is not None:
                break
            await asyncio.sleep(0.05)
        assert "expertGroups[0].experts: 63 is not an expert index below" in app[STATE].load_error
        assert (await client.get("/healthz")).status != 200


async def test_a_checkpoint_server_narrows_v1_infer_to_the_named_group(checkpoint):
    from aiohttp.test_utils import TestClient, TestServer

    from sparsegate_contracts.request_access import EXPERT_GROUP_HEADER
    from sparsegate_workload.server import create_app, wait_ready

    app = create_app(model_path=str(checkpoint), expert_groups={"pair": (1, 5)})
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        await wait_ready(app)
        resp = await client.post("/v1/infer", json={"tokens": [[1, 2, 3, 4, 5, 6]]},
                                 headers={EXPERT_GROUP_HEADER: "pair"})
        out = await resp.json()
        assert resp.status == 200, out
        assert {e for layer in out["expertCounts"] for e, n in enumerate(layer) if n} <= {1, 5}
        assert out["access"]["allowedExperts"] == [1, 5]
