"""A checkpoint's tool gate (hf.tool_head): a head fitted on the frozen tiny checkpoint's final
hidden states to fire where an ``add`` line reaches ``=``, saved beside the weights, then a real
in-process server: /v1/infer calls the calculator with the text its tokenizer decodes and forces
the result as the tokenizer's tokens; elsewhere the gate stays silent; no file, no tool gate; a
misshapen file fails the load naming it. (HTTP tools take the same `tools.call` path as the
built-in model's, tested in test_tool_gate_server.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from sparsegate_workload.gateparams import DEFAULT_PARAMS, make_document
from sparsegate_workload.hf import build_tiny_checkpoint, fit_tool_head, load_moe_checkpoint
from sparsegate_workload.hf.tool_head import TOOL_HEAD_FILE
from sparsegate_workload.server import STATE, create_app, wait_ready
from sparsegate_workload.training.corpus import generate_lines

GATE = make_document(DEFAULT_PARAMS)  # toolGateThreshold 0.85


def _fires(prefix: str) -> bool:
    """Where the calculator's answer should follow: an add line has just reached '='."""
    return prefix.startswith("add ") and prefix.endswith("=")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tg") / "tiny", family="mixtral")


@pytest.fixture(scope="module")
def with_head(plain, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tgh") / "tiny"
    shutil.copytree(plain, directory)
    lm = load_moe_checkpoint(directory)
    head = fit_tool_head(lm, [text for text, _ in generate_lines(400, seed=1)], fires=_fires)
    head.save(directory)
    return directory


def test_the_fitted_head_fires_exactly_at_held_out_add_equals(with_head):
    lm = load_moe_checkpoint(with_head)
    assert lm.tool_head is not None
    tp = fp = fn = 0
    for text, _ in generate_lines(200, seed=2):  # another seed: lines the fit never saw
        ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
        fired = (lm.forward(torch.tensor([ids])).tool_prob[0] > GATE.params.tool_gate_threshold).tolist()
        for i, f in enumerate(fired):
            want = _fires(lm.tokenizer.decode(ids[:i + 1]))
            tp, fp, fn = tp + (f and want), fp + (f and not want), fn + (want and not f)
    print(f"\nheld-out positions at 0.85: {tp} true, {fp} false firings, {fn} missed")
    assert tp > 10 and fp <= 1 and fn <= 1


async def _serve(directory, rows_text):
    app = create_app(gate_doc=GATE, model_path=str(directory))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        await wait_ready(app)
        tok = app[STATE].hf.tokenizer
        rows = [tok(t, add_special_tokens=False)["input_ids"] for t in rows_text]
        out = []
        for row in rows:  # one sequence per request: rows differ in length
            resp = await client.post("/v1/infer", json={"tokens": [row]})
            assert resp.status == 200, await resp.text()
            out.append((await resp.json()))
        metrics = await (await client.get("/metrics")).text()
    return tok, out, metrics


async def test_a_checkpoint_with_a_head_calls_the_calculator_and_forces_its_tokens(with_head):
    tok, (add, sort, plain_text), metrics = await _serve(
        with_head, ["add 12+30=", "sort 5291=", "the big cat sees the old dog."])
    call = add["toolResults"][0]
    assert call["tool"] == "calculator" and call["outcome"] == "ok", call
    assert call["tokens"] == tok("42", add_special_tokens=False)["input_ids"]
    assert add["nextTokens"] == [call["tokens"][0]]
    assert add["toolGateFireRate"] > 0 and add["toolCalls"][0][-1] == call["position"]
    assert sort["toolResults"] == [None] and plain_text["toolResults"] == [None]
    assert 'sparsegate_tool_calls_total{outcome="ok",tool="calculator"} 1.0' in metrics


async def test_without_the_file_a_checkpoint_has_no_tool_gate(plain):
    _, (out,), _ = await _serve(plain, ["add 12+30="])
    assert out["toolCalls"] == [[]] and out["toolGateFireRate"] == 0.0 and out["toolResults"] == [None]


async def test_a_misshapen_head_fails_the_load_naming_the_file(plain, tmp_path):
    from safetensors.torch import save_file

    directory = tmp_path / "bad"
    shutil.copytree(plain, directory)
    save_file({"weight": torch.zeros(3), "bias": torch.zeros(1)}, str(directory / TOOL_HEAD_FILE))
    app = create_app(gate_doc=GATE, model_path=str(directory))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        await wait_ready(app)
        resp = await client.get("/healthz")
        body = await resp.json()
    assert resp.status == 500 and TOOL_HEAD_FILE in body["error"] and "weight [64]" in body["error"], body


def test_a_head_with_a_nan_weight_fails_the_load_naming_the_file(plain, tmp_path):
    """Its probability would be NaN, never above the threshold: a tool gate silently dead."""
    from safetensors.torch import save_file

    from sparsegate_workload.hf import CheckpointError

    directory = tmp_path / "nan"
    shutil.copytree(plain, directory)
    weight = torch.zeros(64)
    weight[5] = float("nan")
    save_file({"weight": weight, "bias": torch.zeros(1)}, str(directory / TOOL_HEAD_FILE))
    with pytest.raises(CheckpointError, match=r"tool-gate head weight: NaN or infinite") as err:
        load_moe_checkpoint(directory)
    assert err.value.file == directory / TOOL_HEAD_FILE
