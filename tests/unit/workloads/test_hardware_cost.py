"""Hardware-aware routing (gate param hardwareCostLambda): validated like the other params and
absent from documents without it; the per-expert cost EWMA; lambda 0 routes bit-identically to
no cost; lambda > 0 moves assignments away from a costly expert, in the built-in DynamicGate and
in a patched Hugging Face block whose cost comes from its own timed dispatch."""

import pytest
import torch

from sparsegate_workload.expert_cost import ExpertCost
from sparsegate_workload.gateparams import DEFAULT_PARAMS, GateParamsError, make_document
from sparsegate_workload.gating import DynamicGate
from sparsegate_workload.hf import SparseGatedMoEBlock, build_tiny_checkpoint, load_moe_checkpoint


@pytest.mark.parametrize("value, message", [
    (-0.5, r"hardwareCostLambda must be in \[0.0, 100.0\], got -0.5"),
    (101, r"hardwareCostLambda must be in \[0.0, 100.0\], got 101"),
    ("1", "hardwareCostLambda must be a finite number"),
    (True, "hardwareCostLambda must be a finite number"),
])
def test_bad_lambda_is_rejected_naming_the_field(value, message):
    with pytest.raises(GateParamsError, match=message):
        make_document({**DEFAULT_PARAMS, "hardwareCostLambda": value})


def test_absent_lambda_is_zero_and_leaves_documents_as_they_were():
    plain = make_document(DEFAULT_PARAMS)
    assert plain.params.hardware_cost_lambda == 0.0
    assert "hardwareCostLambda" not in plain.raw_params
    biased = make_document({**DEFAULT_PARAMS, "hardwareCostLambda": 2})
    assert biased.params.hardware_cost_lambda == 2.0
    assert biased.version != plain.version


def test_cost_is_an_ewma_per_row_times_placement_normalised_by_the_largest():
    cost = ExpertCost(3, alpha=0.5)
    assert cost.vector().tolist() == [1.0, 1.0, 1.0]  # nothing timed: all equal
    cost.record(0, 1.0, rows=10)   # 0.1 s/row
    cost.record(0, 3.0, rows=10)   # 0.3 -> EWMA 0.1 + 0.5 * 0.2 = 0.2
    cost.record(1, 0.4, rows=4)    # 0.1
    cost.record(2, 5.0, rows=0)    # no rows: ignored, expert 2 takes the timed mean 0.15
    assert cost.raw() == pytest.approx([0.2, 0.1, 0.15])
    assert cost.vector().tolist() == pytest.approx([1.0, 0.5, 0.75])
    cost.set_placement([1.0, 4.0, 1.0])
    assert cost.vector().tolist() == pytest.approx([0.5, 1.0, 0.375])
    with pytest.raises(ValueError, match="placement needs 3 factors > 0"):
        cost.set_placement([1.0, 0.0, 1.0])


def _gate() -> tuple[DynamicGate, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gate = DynamicGate(16, 8)
    gate.reset_parameters(g)
    gate.weight.requires_grad_(False)
    return gate, torch.randn(256, 16, generator=g)


def test_dynamic_gate_lambda_zero_is_bit_identical_to_no_cost():
    gate, x = _gate()
    cost = torch.linspace(0, 1, 8)
    kw = dict(confidence_threshold=0.6, min_experts=1, max_experts=4, capacity_factor=None)
    plain = gate(x, **kw)
    zero = gate(x, **kw, cost=cost, cost_lambda=0.0)
    assert torch.equal(plain.token_idx, zero.token_idx)
    assert torch.equal(plain.weights, zero.weights)
    assert plain.counts == zero.counts


def test_dynamic_gate_lambda_moves_assignments_off_the_costly_expert():
    gate, x = _gate()
    kw = dict(confidence_threshold=0.6, min_experts=1, max_experts=4, capacity_factor=None)
    plain = gate(x, **kw)
    busiest = max(range(8), key=lambda e: plain.counts[e])
    cost = torch.zeros(8)
    cost[busiest] = 1.0
    shares = [gate(x, **kw, cost=cost, cost_lambda=lam).counts[busiest] for lam in (0, 1, 3, 10)]
    assert shares[0] > shares[1] > shares[2] > shares[3]
    assert shares[3] < shares[0] / 4
    # Weights stay the unbiased gate probabilities of the kept experts, renormalised per token.
    r = gate(x, **kw, cost=cost, cost_lambda=3.0)
    per_token = torch.zeros(x.shape[0]).index_add_(0, r.token_idx, r.weights)
    assert torch.allclose(per_token, torch.ones(x.shape[0]))


def test_hf_block_times_its_experts_and_routes_around_a_costly_one(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "ckpt", family="mixtral", seed=1)
    base = dict(DEFAULT_PARAMS)
    lm = load_moe_checkpoint(path, gate=make_document(base))
    blocks = [m for m in lm.model.modules() if isinstance(m, SparseGatedMoEBlock)]
    ids = torch.randint(0, lm.model.config.vocab_size, (4, 32),
                        generator=torch.Generator().manual_seed(0))

    def run() -> torch.Tensor:
        with torch.no_grad():
            return lm.model(ids).logits

    plain = run()
    block = blocks[0]
    assert all(s is not None for s in block.cost.seconds_per_row)  # dispatch timed every expert
    lm.set_gate(make_document({**base, "hardwareCostLambda": 0}))
    assert torch.equal(run(), plain)  # lambda 0: same bits
    flat = torch.randn(128, block.gate.storage.data.shape[1],
                       generator=torch.Generator().manual_seed(1))
    zero_gate = block._slot.active
    counts0 = block.route(flat, zero_gate).counts
    busiest = max(range(block.num_experts), key=lambda e: counts0[e])
    block.cost.set_placement([50.0 if e == busiest else 1.0 for e in range(block.num_experts)])
    lm.set_gate(make_document({**base, "hardwareCostLambda": 5}))
    counts5 = block.route(flat, block._slot.active).counts
    assert counts5[busiest] < counts0[busiest] / 2, (counts0, counts5)


@pytest.mark.parametrize("kind", ["checkpoint", "builtin"])
async def test_served_model_exports_the_learnt_cost_per_layer_and_expert(tmp_path, kind):
    import aiohttp
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from sparsegate_workload.server import create_app, wait_ready

    gate = make_document({**DEFAULT_PARAMS, "hardwareCostLambda": 1})
    if kind == "checkpoint":
        app = create_app(model_path=str(build_tiny_checkpoint(tmp_path / "tiny-mixtral", family="mixtral")),
                         gate_doc=gate)
    else:
        app = create_app(gate_doc=gate)
    client = TestClient(TestServer(app, host="127.0.0.1"), connector=aiohttp.TCPConnector(limit=0))
    await client.start_server()
    try:
        await wait_ready(app)
        if kind == "checkpoint":
            resp = await client.post("/v1/completions", json={"prompt": "the gate keeps",
                                                              "max_tokens": 4, "temperature": 0})
        else:
            resp = await client.post("/v1/infer", json={"tokens": [[1, 2, 3, 4, 5, 6, 7, 8]] * 4})
        assert resp.status == 200, await resp.text()
        text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
    samples = [s for f in text_string_to_metric_families(text) if f.name == "sparsegate_expert_cost"
               for s in f.samples]
    by_layer: dict[str, list[float]] = {}
    for s in samples:
        by_layer.setdefault(s.labels["layer"], []).append(s.value)
    assert by_layer and all(len(v) == 8 for v in by_layer.values())
    # Normalised by each layer's costliest expert, measured from the requests just served.
    assert all(max(v) == 1.0 and min(v) > 0 for v in by_layer.values())


def _served_builtin(*, cost_lambda: float):
    from sparsegate_workload.model import ModelConfig, build_model

    params = make_document({**DEFAULT_PARAMS, "minExpertsPerToken": 1, "maxExpertsPerToken": 2,
                            "confidenceThreshold": 0.6, "capacityFactor": 8,
                            "hardwareCostLambda": cost_lambda}).params
    model = build_model(ModelConfig(), gate=params)
    return model, params


def test_builtin_model_times_its_experts_and_routes_around_a_costly_one():
    """The built-in model (what `/v1/infer` serves) end to end: its experts' inference loop
    records each expert's time, lambda 0 routes as before, and a large lambda with one expert
    made costly (placement factor, as a slow device would report) moves tokens off it."""
    tokens = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(3))

    def counts(model, params) -> list[int]:
        with torch.inference_mode():
            out = model(tokens, gate=params, precisions=model.resolve_precisions("fp32"),
                        expert_precisions=["fp32"] * len(model.blocks))
        return out.layers[0].counts

    plain_model, plain = _served_builtin(cost_lambda=0.0)
    base = counts(plain_model, plain)
    timed = plain_model.blocks[0].moe.cost.seconds_per_row
    assert all(t is not None and t > 0 for t, n in zip(timed, base) if n), timed
    busiest = max(range(len(base)), key=base.__getitem__)

    biased_model, biased = _served_builtin(cost_lambda=50.0)
    for blk in biased_model.blocks:
        blk.moe.cost.set_placement([100.0 if e == busiest else 1.0 for e in range(8)])
    counts(biased_model, biased)  # a first call times every expert (untimed ones take the mean)
    moved = counts(biased_model, biased)
    assert moved[busiest] < base[busiest] // 4, (base, moved)
    # lambda 0 with the same costly expert: identical routing to the unbiased model.
    for blk in plain_model.blocks:
        blk.moe.cost.set_placement([100.0 if e == busiest else 1.0 for e in range(8)])
    assert counts(plain_model, plain) == base


def test_dispatch_off_the_cpu_records_no_host_clock_times(monkeypatch):
    """On an accelerator the dispatch loop's host clock sees kernel launches only (nothing
    synchronises): a near-constant time per expert, so per row the least-loaded experts would
    look the costliest and lambda > 0 would push tokens onto the busiest ones. Only CPU times
    are recorded; off the CPU the cost is the placement factor (measured synchronised)."""
    from sparsegate_workload import experts as experts_mod
    from sparsegate_workload.experts import dispatch_sorted
    from sparsegate_workload.gating import Routing
    from sparsegate_workload.precision import StoredWeight

    ticks = iter(range(1000))  # every expert "takes" 1 s whatever its rows: launch-bound
    monkeypatch.setattr(experts_mod.time, "perf_counter", lambda: float(next(ticks)))
    counts = [6, 0, 1, 3]

    def dispatch(device: str) -> ExpertCost:
        d, f, n = 8, 4, sum(counts)
        x = torch.zeros(5, d, device=device)
        token_idx = torch.zeros(n, dtype=torch.long, device=device)
        routing = Routing(token_idx=token_idx, weights=torch.ones(n, device=device),
                          counts=counts, slots=torch.zeros(5, 1, dtype=torch.long, device=device),
                          per_token=token_idx, selected=token_idx,
                          probs=torch.zeros(5, 4, device=device), dropped=0, capacity=None,
                          load=counts)
        cost = ExpertCost(4)
        dispatch_sorted(x, routing, StoredWeight.store(torch.zeros(4, d, 2 * f, device=device), "fp32"),
                        StoredWeight.store(torch.zeros(4, f, d, device=device), "fp32"), cost=cost)
        return cost

    assert dispatch("cpu").seconds_per_row == [1 / 6, None, 1.0, 1 / 3]  # CPU: timed
    off_cpu = dispatch("meta")  # any non-CPU device: the clock would time launches only
    assert off_cpu.seconds_per_row == [None] * 4
    assert off_cpu.vector().tolist() == [1.0] * 4  # placement factors alone (all 1.0 here)


def test_cost_vector_is_copied_to_the_routing_device_once_per_update():
    """A CUDA routing with lambda > 0 read the CPU vector and copied it to the GPU in every
    layer call: a blocking host-to-device copy, i.e. one more host sync per layer."""
    cost = ExpertCost(3)
    cost.set_placement([1.0, 2.0, 4.0])
    meta = torch.device("meta")  # stands in for the GPU: any device other than the CPU
    first = cost.vector(meta)
    assert first.device == meta and cost.vector(meta) is first  # cached, no second copy
    assert cost.vector().tolist() == [0.25, 0.5, 1.0] and cost.vector().device.type == "cpu"
    cost.set_placement([1.0, 1.0, 1.0])
    assert cost.vector(meta) is not first  # an update invalidates the device copy too
