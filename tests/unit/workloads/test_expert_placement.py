"""Per-expert placement of a checkpoint's experts (``--expert-placement-json``): bad specs are
rejected naming the key; placed experts compute the same outputs within their dtype's
tolerance; the placement factor is measured at load and shows the slower dtype; with
hardwareCostLambda > 0 the served forward sends fewer tokens to an expert placed in the slow
dtype; the server exports the factors."""

import pytest
import torch

from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint, load_moe_checkpoint
from sparsegate_workload.hf.placement import (PlacementError, parse_placement,
                                              parse_placement_json)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("place") / "tiny-mixtral",
                                 family="mixtral", seed=1)


@pytest.mark.parametrize("doc, message", [
    ([], r"--expert-placement-json must be a JSON object, got list"),
    ({"3": {"dtype": "float32"}}, r"\['3'\]: key must be '<layer>:<expert>'"),
    ({"a:1": {"dtype": "float32"}}, r"\['a:1'\]: key must be"),
    ({"0:1": {}}, r"\['0:1'\] must be an object with 'dtype' and/or 'device'"),
    ({"0:1": {"dtype": "int4"}}, r"\['0:1'\]\.dtype must be one of float32, bfloat16, float16, got 'int4'"),
    ({"*:1": {"device": "tpu"}}, r"\['\*:1'\]\.device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    ({"*:1": {"precision": "bf16"}}, r"\['\*:1'\]: unknown field 'precision'"),
])
def test_bad_placement_is_rejected_naming_the_key(doc, message):
    with pytest.raises(PlacementError, match=message):
        parse_placement(doc)


def test_bad_json_and_out_of_range_keys_are_named(ckpt):
    with pytest.raises(PlacementError, match="--expert-placement-json: not JSON"):
        parse_placement_json("{")
    with pytest.raises(PlacementError, match=r"\['0:9'\]: expert 9 out of range \(the model has 8 experts\)"):
        load_moe_checkpoint(ckpt, placement=parse_placement({"0:9": {"dtype": "float32"}}))
    with pytest.raises(PlacementError, match=r"\['5:1'\]: layer 5 out of range \(the model has 2 MoE blocks\)"):
        load_moe_checkpoint(ckpt, placement=parse_placement({"5:1": {"dtype": "float32"}}))


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-6), ("bfloat16", 3e-2), ("float16", 3e-3)])
def test_placed_experts_keep_the_block_output_within_the_dtype_tolerance(ckpt, dtype, atol):
    doc = make_document(DEFAULT_PARAMS)
    plain = load_moe_checkpoint(ckpt, gate=doc)
    placed = load_moe_checkpoint(ckpt, gate=doc, placement=parse_placement(
        {"*:3": {"dtype": dtype}, "0:5": {"dtype": dtype, "device": "cpu"}}))
    assert sorted(placed.blocks[0].placed) == [3, 5] and sorted(placed.blocks[1].placed) == [3]
    flat = torch.randn(256, plain.blocks[0].gate.weight.shape[1],
                       generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for a, b in zip(plain.blocks, placed.blocks):
            routing = a.route(flat, a._slot.active)
            assert routing.counts[3] > 0  # the placed expert really runs
            want, got = a.dispatch(flat, routing), b.dispatch(flat, routing)
            assert got.dtype == want.dtype
            scale = want.abs().max()
            assert (got - want).abs().max() <= atol * scale, (dtype, (got - want).abs().max(), scale)
    if dtype == "float32":  # the whole model: same logits
        ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(placed.forward(ids).logits, plain.forward(ids).logits,
                                       rtol=0, atol=1e-5)


def test_the_placement_factor_is_measured_and_shows_the_slower_dtype(ckpt):
    lm = load_moe_checkpoint(ckpt, placement=parse_placement({"*:3": {"dtype": "bfloat16"}}))
    for block in lm.blocks:
        factors = block.cost.placement
        # The layer's own (cpu, float32) experts are the fastest present: exactly 1.
        assert [f for e, f in enumerate(factors) if e != 3] == [1.0] * 7
        # This project's CPUs have no bf16 matmul units: bf16 measured several times slower.
        assert factors[3] > 1.5, factors
    unplaced = load_moe_checkpoint(ckpt)
    assert all(b.cost.placement == [1.0] * 8 for b in unplaced.blocks)


def test_lambda_sends_fewer_tokens_to_the_slow_placed_expert_through_the_served_forward(ckpt):
    base = dict(DEFAULT_PARAMS)
    ids = torch.randint(3, 300, (4, 32), generator=torch.Generator().manual_seed(2))
    probe = load_moe_checkpoint(ckpt, gate=make_document(base))
    counts0 = probe.forward(ids).layers[0].counts
    busiest = max(range(8), key=lambda e: counts0[e])
    lm = load_moe_checkpoint(ckpt, gate=make_document(base),
                             placement=parse_placement({f"*:{busiest}": {"dtype": "bfloat16"}}))

    def share(cost_lambda: float) -> float:
        lm.set_gate(make_document({**base, "hardwareCostLambda": cost_lambda}))
        counts = [0] * 8
        for _ in range(3):  # the dispatch timer's EWMA sees the slow expert too
            for layer in lm.forward(ids).layers:
                counts = [c + n for c, n in zip(counts, layer.counts)]
        return counts[busiest] / sum(counts)

    at0, at3 = share(0.0), share(3.0)
    assert at3 < at0 / 2, (at0, at3)
    assert lm.blocks[0].cost.vector()[busiest] == 1.0  # the costliest of its layer


async def test_server_places_experts_and_exports_the_factor(ckpt):
    import aiohttp
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from sparsegate_workload.server import create_app, wait_ready

    app = create_app(model_path=str(ckpt), expert_placement=parse_placement(
        {"1:2": {"dtype": "bfloat16"}}))
    client = TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0))
    await client.start_server()
    try:
        await wait_ready(app)
        text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
    factor = {(s.labels["layer"], s.labels["expert"]): s.value
              for f in text_string_to_metric_families(text)
              if f.name == "sparsegate_expert_placement_factor" for s in f.samples}
    assert len(factor) == 16
    assert factor[("1", "2")] > 1.5
    assert all(v == 1.0 for k, v in factor.items() if k != ("1", "2"))


def test_server_flag_is_checked_before_serving(capsys):
    from sparsegate_workload.server import main

    with pytest.raises(SystemExit):
        main(["--expert-placement-json", '{"*:1": {"dtype": "int8"}}', "--model-path", "/nonexistent"])
    assert "--expert-placement-json['*:1'].dtype must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--expert-placement-json", '{"*:1": {"dtype": "bfloat16"}}'])
    assert "--expert-placement-json needs --model-path" in capsys.readouterr().err


def test_the_factor_timing_synchronises_the_device_it_times(monkeypatch):
    """``cuda:N`` placements: torch.cuda.synchronize() without a device waits for the current
    device only (cuda:0), so a matmul on cuda:1 was timed by its launch alone."""
    from sparsegate_workload.hf import placement

    real_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None: real_randn(*shape))
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    placement._median_mm_seconds(4, 8, 16, torch.float32, torch.device("cuda", 1), reps=3)
    assert synced and all(d is not None and torch.device(d) == torch.device("cuda", 1)
                          for d in synced), synced
