"""The training library on a tiny config: the loss falls, a seed fixes the weights, the saved
checkpoint is what the loader serves, and a routers-only fine-tune moves only the routers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sparsegate_contracts.gate import GateParams
from sparsegate_workload.hf import load_moe_checkpoint
from sparsegate_workload.training.corpus import TokenClass, generate_lines
from sparsegate_workload.quality import PROBE_FILE, PROBE_LINES, checkpoint_probe
from sparsegate_workload.training.trainer import (TRAINING_FILE, GateSetting, ModelShape,
                                                  TrainConfig, TrainingConfigError, evaluate,
                                                  probe_lines, save_checkpoint, train)

TINY = ModelShape(hidden_size=32, layers=2, heads=2, experts=4, expert_ffn=32,
                  max_positions=64)


def _config(**overrides: object) -> TrainConfig:
    base = dict(steps=40, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=5, seed=3,
                shape=TINY, corpus_lines=600, heldout_lines=80,
                gate=GateSetting(threshold=0.6, min_experts=1, max_experts=3),
                entropy_beta=0.01)
    base.update(overrides)
    return TrainConfig(**base)  # type: ignore[arg-type]


def _state(result) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in result.lm.model.state_dict().items()}


def test_loss_decreases() -> None:
    result = train(_config())
    ce = [s.ce for s in result.history]
    assert ce[0] == pytest.approx(math.log(len(result.tokenizer)), abs=0.5)
    assert sum(ce[-5:]) / 5 < sum(ce[:5]) / 5 - 1.0, ce
    held = evaluate(result.lm, result.heldout, seq_len=32)
    assert held.loss < ce[0] - 1.0
    assert set(held.by_class) == {c.name.lower() for c in TokenClass}
    assert 1.0 <= held.experts <= 3.0


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b = _state(train(_config(steps=8))), _state(train(_config(steps=8)))
    c = _state(train(_config(steps=8, seed=4)))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_saved_checkpoint_loads_and_scores_the_same(tmp_path: Path) -> None:
    result = train(_config(steps=10))
    held = evaluate(result.lm, result.heldout, seq_len=32)
    out = save_checkpoint(result, tmp_path / "ckpt", evaluation=held)
    assert {"config.json", "model.safetensors", "tokenizer.json", TRAINING_FILE} <= \
        {p.name for p in out.iterdir()}
    record = json.loads((out / TRAINING_FILE).read_text())
    assert record["objective"]["entropyBeta"] == 0.01
    assert record["heldout"]["loss"] == pytest.approx(held.loss)
    served = load_moe_checkpoint(out, gate=result.lm.gate.params, dropless=True)
    assert served.tokenizer is not None and len(served.tokenizer) == len(result.tokenizer)
    again = evaluate(served, result.heldout, seq_len=32)
    assert again.loss == pytest.approx(held.loss, abs=1e-5)
    assert again.experts == pytest.approx(held.experts, abs=1e-6)


def test_saved_checkpoint_carries_held_out_probe_lines_the_server_reads(tmp_path: Path) -> None:
    cfg = _config(steps=2)
    result = train(cfg)
    out = save_checkpoint(result, tmp_path / "ckpt")
    lines = (out / PROBE_FILE).read_text(encoding="utf-8").splitlines()
    assert lines == probe_lines(cfg) and len(lines) == PROBE_LINES
    trained_on = {t for t, _ in generate_lines(cfg.corpus_lines, seed=cfg.seed, hard_fraction=cfg.hard_fraction)}
    assert lines[0] == generate_lines(1, seed=10_000 + cfg.seed, hard_fraction=cfg.hard_fraction)[0][0]
    assert len(set(lines) - trained_on) > 0  # the held-out seed, not the training lines
    probe = checkpoint_probe(out, result.tokenizer, vocab_size=len(result.tokenizer), context_length=64)
    assert probe.source == str(out / PROBE_FILE) and len(probe.windows) > 0


def test_a_text_file_model_is_probed_on_the_files_held_out_tail(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    # Equal-length lines: the 90 % cut falls on a line boundary (line 1800 of 2000).
    text.write_text("".join(f"line {i:04d} of the user's own text\n" for i in range(2000)), encoding="utf-8")
    lines = probe_lines(_config(steps=1, text_file=str(text)))
    assert lines == [f"line {i:04d} of the user's own text" for i in range(1800, 1800 + PROBE_LINES)]


def test_routers_only_fine_tune_moves_only_the_routers(tmp_path: Path) -> None:
    base = save_checkpoint(train(_config(steps=5)), tmp_path / "base")
    before = {k: v.clone() for k, v in load_moe_checkpoint(base).model.state_dict().items()}
    tuned = train(_config(steps=5, init_from=str(base), trainable="routers", seed=9))
    after = tuned.lm.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith("mlp.gate.weight") for k in changed), changed


def test_overwriting_a_checkpoint_removes_its_stale_tool_gate_head(tmp_path: Path) -> None:
    from sparsegate_workload.hf.tool_head import TOOL_HEAD_FILE, ToolHead

    result = train(_config(steps=1))
    out = save_checkpoint(result, tmp_path / "ckpt")
    # A head an earlier run (another hidden size) fitted beside the old weights.
    ToolHead(weight=torch.ones(2 * TINY.hidden_size), bias=0.0).save(out)
    save_checkpoint(result, out)
    assert not (out / TOOL_HEAD_FILE).exists()
    assert load_moe_checkpoint(out).tool_head is None


def test_fine_tuning_keeps_the_checkpoints_output_router_logits(tmp_path: Path) -> None:
    base = save_checkpoint(train(_config(steps=1)), tmp_path / "base")
    assert json.loads((base / "config.json").read_text())["output_router_logits"] is False
    config = json.loads((base / "config.json").read_text())
    config["output_router_logits"] = True
    (base / "config.json").write_text(json.dumps(config))
    tuned = train(_config(steps=1, init_from=str(base), trainable="routers"))
    out = save_checkpoint(tuned, tmp_path / "tuned")
    assert json.loads((out / "config.json").read_text())["output_router_logits"] is True


def test_a_gate_wider_than_the_checkpoint_is_refused(tmp_path: Path) -> None:
    base = save_checkpoint(train(_config(steps=2)), tmp_path / "base")
    with pytest.raises(TrainingConfigError, match="max_experts"):
        train(_config(steps=2, init_from=str(base), trainable="routers",
                      gate=GateSetting(threshold=0.5, min_experts=1, max_experts=5)))


@pytest.mark.parametrize(("overrides", "field"), [
    ({"steps": 0}, "steps"),
    ({"lr": float("nan")}, "lr"),
    ({"entropy_beta": -0.1}, "entropy_beta"),
    ({"entropy_beta": 11.0}, "entropy_beta"),   # past the gate document's entropyBeta range
    ({"gate": GateSetting(capacity_factor=100.0)}, "capacity_factor"),
    ({"trainable": "embeddings"}, "trainable"),
    ({"gate": GateSetting(threshold=0.0)}, "threshold"),
    ({"gate": GateSetting(min_experts=3, max_experts=2)}, "min_experts"),
    ({"gate": GateSetting(max_experts=5)}, "max_experts"),
    ({"seq_len": 65}, "seq_len"),
    ({"hard_fraction": 1.5}, "hard_fraction"),
])
def test_invalid_settings_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(TrainingConfigError) as info:
        _config(**overrides)
    assert info.value.field == field


def test_gate_params_route_like_the_setting() -> None:
    result = train(_config(steps=1, gate=GateSetting.top_k(2)))
    params: GateParams = result.lm.gate.params
    assert (params.min_experts_per_token, params.max_experts_per_token) == (2, 2)
    assert params.entropy_beta == 0.01


def test_corpus_lines_are_correct_and_labelled() -> None:
    lines = generate_lines(400, seed=1, hard_fraction=0.5)
    hard = [t for t, h in lines if h]
    assert 120 < len(hard) < 280
    for text in hard:
        kind, body = text.split(" ", 1)
        prompt, answer = body.split("=")
        if kind == "add":
            a, b = prompt.split("+")
            assert int(answer) == int(a) + int(b)
        elif kind == "rev":
            assert answer == prompt[::-1]
        else:
            assert answer == "".join(sorted(prompt))
    assert generate_lines(50, seed=1) == generate_lines(50, seed=1)
