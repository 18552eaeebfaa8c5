"""The gate's optional targetExpertsPerToken: validated like the other params, absent from (and
so not changing the hash of) documents without it, and on a real in-process model server a PI
controller per gate version that moves the threshold until the mean selected experts per token
of the traffic approaches the target, exported as sparsegate_gate_controlled_threshold."""

import asyncio
import random

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from sparsegate_workload.gateparams import DEFAULT_PARAMS, GateParamsError, make_document
from sparsegate_workload.model import ModelConfig
from sparsegate_workload.server import create_app, wait_ready

GAUGE = "sparsegate_gate_controlled_threshold"
TARGET = 2.5


@pytest.mark.parametrize("params, message", [
    ({"targetExpertsPerToken": 5}, "targetExpertsPerToken must be in [1, 4], got 5"),
    ({"targetExpertsPerToken": 0.5}, "targetExpertsPerToken must be in [1, 4], got 0.5"),
    ({"minExpertsPerToken": 2, "targetExpertsPerToken": 1.5},
     "targetExpertsPerToken must be in [2, 4], got 1.5"),
    ({"targetExpertsPerToken": "2"}, "targetExpertsPerToken must be a finite number"),
    ({"targetExpertsPerToken": True}, "targetExpertsPerToken must be a finite number"),
])
def test_target_outside_the_expert_bounds_is_rejected_naming_the_field(params, message):
    with pytest.raises(GateParamsError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_document({**DEFAULT_PARAMS, **params})


def test_absent_target_is_no_control_and_leaves_documents_as_they_were():
    plain = make_document(DEFAULT_PARAMS)
    assert plain.params.target_experts_per_token is None
    assert "targetExpertsPerToken" not in plain.raw_params
    controlled = make_document({**DEFAULT_PARAMS, "targetExpertsPerToken": TARGET})
    assert controlled.params.target_experts_per_token == TARGET
    assert controlled.version != plain.version  # the target is part of the content address


def _traffic(n: int, *, seed: int, vocab: int = ModelConfig().vocab_size) -> list[list[list[int]]]:
    """A mix of batch sizes and prompt lengths over random tokens (the same list for each run)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, rows = rng.choice([4, 16, 32]), rng.choice([1, 2, 4])
        out.append([[rng.randrange(vocab) for _ in range(length)] for _ in range(rows)])
    return out


async def _serve(doc, traffic) -> tuple[list[float], dict[str, float]]:
    """Send the traffic one batch at a time; the selected experts per token of each, and the
    gauge's samples by gate_version afterwards."""
    app = create_app(gate_doc=doc)
    async with TestClient(TestServer(app, host="127.0.0.1"),
                          connector=aiohttp.TCPConnector(limit=0)) as client:
        await wait_ready(app)
        measured = []
        for tokens in traffic:
            resp = await client.post("/v1/infer", json={"tokens": tokens})
            assert resp.status == 200, await resp.text()
            body = await resp.json()
            assert body["gateVersion"] == doc.version
            measured.append(body["selectedExpertsPerToken"])
        text = await (await client.get("/metrics")).text()
    gauge = {s.labels["gate_version"]: s.value
             for family in text_string_to_metric_families(text) if family.name == GAUGE
             for s in family.samples}
    return measured, gauge


async def test_controlled_gate_approaches_the_target_and_exports_the_threshold():
    traffic = _traffic(40, seed=7)
    fixed = make_document(DEFAULT_PARAMS)  # confidenceThreshold 0.6, experts per token in [1, 4]
    controlled = make_document({**DEFAULT_PARAMS, "targetExpertsPerToken": TARGET})

    fixed_measured, fixed_gauge = await _serve(fixed, traffic)
    measured, gauge = await _serve(controlled, traffic)

    # Without the field nothing is controlled: no gauge series, and the fixed threshold routes the
    # same traffic the same way, far below the target.
    assert fixed_gauge == {}
    fixed_mean = sum(fixed_measured) / len(fixed_measured)
    assert fixed_mean < TARGET - 0.7, fixed_mean
    # The first controlled batch routes with the same start threshold (0.6) as the fixed gate.
    assert measured[0] == pytest.approx(fixed_measured[0])
    # After warming up, the mean experts per token sits near the target (batch-to-batch spread
    # of this traffic at a fixed threshold is about +-0.5 experts).
    tail = measured[-15:]
    tail_mean = sum(tail) / len(tail)
    print(f"\nfixed 0.6: mean {fixed_mean:.3f} experts/token; controlled (target {TARGET}): "
          f"first {measured[0]:.3f}, mean of last 15 {tail_mean:.3f}; "
          f"threshold 0.6 -> {gauge.get(controlled.version)}")
    assert abs(tail_mean - TARGET) < 0.25, tail_mean
    # The gauge is labelled by the version and has moved up from confidenceThreshold.
    assert set(gauge) == {controlled.version}
    assert 0.7 < gauge[controlled.version] < 0.99


# A checkpoint: the same loop on /v1/infer, and on the OpenAI routes' batched prefill and decode.
CHECKPOINT_TARGET = 2.5
WORDS = ("the gate keeps experts busy while the router scores each token and kubernetes rolls "
         "new versions out to a few instances first").split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from sparsegate_workload.hf import build_tiny_checkpoint

    # 8 experts, top-2 in the checkpoint; served here with a top-p gate of 1 to 4 experts.
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ctl") / "tiny", family="mixtral")


def _prompts(n: int, *, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


async def _serve_checkpoint(doc, checkpoint, *, infer=(), prompts=()) -> tuple[list[float], list[tuple[float, int]], dict[str, float]]:
    """/v1/infer batches one at a time (selected experts per token of each), then completions in
    waves of 4 concurrent requests, decoded together ((mean experts per token, tokens) of each),
    and the gauge by gate_version."""
    app = create_app(gate_doc=doc, model_path=str(checkpoint))
    async with TestClient(TestServer(app, host="127.0.0.1"),
                          connector=aiohttp.TCPConnector(limit=0)) as client:
        await wait_ready(app)
        measured = []
        for tokens in infer:
            resp = await client.post("/v1/infer", json={"tokens": tokens})
            assert resp.status == 200, await resp.text()
            measured.append((await resp.json())["selectedExpertsPerToken"])

        async def complete(prompt: str) -> tuple[float, int]:
            resp = await client.post("/v1/completions",
                                     json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
            assert usage["sparsegate"]["gate_version"] == doc.version
            return usage["sparsegate"]["mean_experts_per_token"], usage["total_tokens"]

        generated = []
        for wave in range(0, len(prompts), 4):
            generated += await asyncio.gather(*(complete(p) for p in prompts[wave:wave + 4]))
        text = await (await client.get("/metrics")).text()
    gauge = {s.labels["gate_version"]: s.value
             for family in text_string_to_metric_families(text) if family.name == GAUGE
             for s in family.samples}
    return measured, generated, gauge


def _token_mean(generated: list[tuple[float, int]]) -> float:
    return sum(m * n for m, n in generated) / sum(n for _, n in generated)


async def test_a_checkpoint_approaches_the_target_on_infer(checkpoint):
    traffic = _traffic(40, seed=7, vocab=384)  # the tiny checkpoint's vocabulary
    fixed = make_document({**DEFAULT_PARAMS, "capacityFactor": 8})
    controlled = make_document({**DEFAULT_PARAMS, "capacityFactor": 8,
                                "targetExpertsPerToken": CHECKPOINT_TARGET})
    fixed_measured, _, fixed_gauge = await _serve_checkpoint(fixed, checkpoint, infer=traffic)
    measured, _, gauge = await _serve_checkpoint(controlled, checkpoint, infer=traffic)
    assert fixed_gauge == {}
    fixed_mean = sum(fixed_measured) / len(fixed_measured)
    assert fixed_mean < CHECKPOINT_TARGET - 0.7, fixed_mean
    assert measured[0] == pytest.approx(fixed_measured[0])  # same start threshold (0.6)
    tail_mean = sum(measured[-15:]) / 15
    print(f"\ncheckpoint /v1/infer: fixed 0.6 mean {fixed_mean:.3f}; controlled (target "
          f"{CHECKPOINT_TARGET}) mean of last 15 {tail_mean:.3f}; threshold -> {gauge}")
    assert abs(tail_mean - CHECKPOINT_TARGET) < 0.25, tail_mean
    assert set(gauge) == {controlled.version} and 0.7 < gauge[controlled.version] < 0.99


async def test_a_checkpoint_approaches_the_target_on_batched_generation(checkpoint):
    prompts = _prompts(48, seed=3)
    fixed = make_document({**DEFAULT_PARAMS, "capacityFactor": 8})
    controlled = make_document({**DEFAULT_PARAMS, "capacityFactor": 8,
                                "targetExpertsPerToken": CHECKPOINT_TARGET})
    _, fixed_generated, _ = await _serve_checkpoint(fixed, checkpoint, prompts=prompts)
    _, generated, gauge = await _serve_checkpoint(controlled, checkpoint, prompts=prompts)
    fixed_mean = _token_mean(fixed_generated)
    assert fixed_mean < CHECKPOINT_TARGET - 0.7, fixed_mean
    # Prompt and generated tokens alike (usage counts both), over the last 16 requests.
    tail_mean = _token_mean(generated[-16:])
    print(f"\ncheckpoint completions: fixed 0.6 mean {fixed_mean:.3f} experts/token; controlled "
          f"(target {CHECKPOINT_TARGET}) first wave {_token_mean(generated[:4]):.3f}, last 16 "
          f"requests {tail_mean:.3f}; threshold -> {gauge}")
    assert abs(tail_mean - CHECKPOINT_TARGET) < 0.25, tail_mean
    assert set(gauge) == {controlled.version} and 0.7 < gauge[controlled.version] < 0.99


def test_requests_scoped_to_an_expert_group_do_not_feed_the_controller(checkpoint):
    """A group of 1 expert can never reach a target of 2.5: fed from its batches, the loop would
    push the version's threshold to its bound for every request. Scoped /v1/infer batches and
    scoped batched generation leave the controller alone; unscoped ones move it."""
    from sparsegate_workload.batch_decode import BatchDecoder, DecodeRequest
    from sparsegate_workload.hf_serving import load
    from sparsegate_workload.server_state import threshold_controller

    doc = make_document({**DEFAULT_PARAMS, "capacityFactor": 8,
                         "targetExpertsPerToken": CHECKPOINT_TARGET})
    hf = load(checkpoint, gate=doc, device="cpu")
    controller = threshold_controller(doc.params)
    hf.set_gate(doc, controller=controller)
    start = controller.threshold
    tokens = [[1] + [(7 * j) % 300 + 3 for j in range(40)]]
    for _ in range(3):
        hf.run_batch(tokens, allowed_experts=(0,))
    dec = BatchDecoder(hf)
    pending = [DecodeRequest(key=i, prompt_ids=tokens[0][:20 + i], max_tokens=6, allowed_experts=(0,))
               for i in range(3)]
    while pending or dec.running:
        dec.run(pending[:1], [])
        pending = pending[1:]
    assert controller.threshold == start
    hf.run_batch(tokens)
    assert controller.threshold != start
