"""``sparsegate-train``: bad flags fail with an argparse error naming the flag; a tiny run
writes a checkpoint plus a gate document the server's loader accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparsegate_contracts.gate import parse_document
from sparsegate_workload.hf import load_moe_checkpoint
from sparsegate_workload.training.cli import GATE_FILE, main
from sparsegate_workload.training.trainer import TRAINING_FILE

TINY = ["--hidden-size", "32", "--layers", "1", "--heads", "2", "--experts", "4",
        "--expert-ffn", "32", "--max-positions", "64", "--seq-len", "32", "--batch-size", "4",
        "--corpus-lines", "300", "--heldout-lines", "40", "--quiet"]


@pytest.mark.parametrize(("args", "flag"), [
    (["--steps", "0"], "--steps"),
    (["--steps", "ten"], "--steps"),
    (["--confidence-threshold", "1.5"], "--confidence-threshold"),
    (["--confidence-threshold", "0"], "--confidence-threshold"),
    (["--entropy-beta", "-1"], "--entropy-beta"),
    (["--lr", "nan"], "--lr"),
    (["--trainable", "embeddings"], "--trainable"),
    (["--max-experts", "9"], "--max-experts"),
    (["--min-experts", "3", "--max-experts", "2"], "--min-experts"),
    (["--family", "gpt2"], "--family"),
    (["--heads", "3"], "--heads"),
    (["--vocab-size", "100"], "--vocab-size"),
    (["--seq-len", "300"], "--seq-len"),
    (["--hard-fraction", "2"], "--hard-fraction"),
    (["--init-from", "/nonexistent/ckpt"], "--init-from"),
    (["--text-file", "/nonexistent/corpus.txt"], "--text-file"),
    # Past the gate document's ranges: refused here, not after training when the gate file is made.
    (["--entropy-beta", "50"], "--entropy-beta"),
    (["--capacity-factor", "100"], "--capacity-factor"),
])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--output", str(tmp_path / "out"), *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err, err
    assert not (tmp_path / "out").exists()


def _corpus_file(tmp_path: Path, kind: str) -> str:
    path = tmp_path / f"{kind}.txt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "latin1":
        path.write_bytes("caf\u00e9 au lait, cr\u00e8me br\u00fbl\u00e9e\n".encode("latin-1") * 200)
    elif kind == "short":
        path.write_text("hello world\n", encoding="utf-8")
    else:  # "short_tail": enough to train on, but its last 10 % is shorter than one window
        path.write_text("".join(f"line {i} of text here\n" for i in range(30)), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(("args", "flag"), [
    (["--text-file", "empty"], "--text-file"),
    (["--text-file", "latin1"], "--text-file"),
    (["--text-file", "short"], "--text-file"),
    (["--text-file", "short_tail"], "--text-file"),
    (["--corpus-lines", "1"], "--corpus-lines"),
    (["--heldout-lines", "1"], "--heldout-lines"),
])
def test_a_corpus_too_short_or_not_utf8_exits_2_naming_the_flag(
        args: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if args[0] == "--text-file":
        args = [args[0], _corpus_file(tmp_path, args[1])]
    with pytest.raises(SystemExit) as info:
        main(["--output", str(tmp_path / "out"), *TINY, "--steps", "2", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: " in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["unsupported_family", "truncated_weights"])
def test_an_unusable_init_from_checkpoint_exits_2_naming_the_flag(
        damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sparsegate_workload.hf.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "ckpt", family="mixtral", hidden_size=16, layers=1,
                                 heads=2, experts=2, expert_ffn=8, max_positions=64)
    if damage == "unsupported_family":
        (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    else:
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(SystemExit) as info:
        main(["--output", str(tmp_path / "out"), "--init-from", str(ckpt), "--max-experts", "2",
              "--steps", "1", "--quiet"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--init-from: " in err and str(ckpt) in err, err
    assert not (tmp_path / "out").exists()


def test_an_output_that_is_a_file_exits_2_before_training(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.write_text("not a directory")
    with pytest.raises(SystemExit) as info:
        main(["--output", str(out), *TINY, "--steps", "1"])
    assert info.value.code == 2
    assert "--output" in capsys.readouterr().err
    assert out.read_text() == "not a directory"


def test_the_gate_document_carries_the_capacity_factor_and_accepts_over_64_experts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    # 80 experts, top-70: valid for this model (the server checks against its expert count).
    assert main(["--output", str(out), *TINY, "--steps", "1", "--expert-ffn", "8",
                 "--experts", "80", "--top-k", "70", "--capacity-factor", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    document = parse_document(json.loads((out / GATE_FILE).read_text()), num_experts=80)
    assert document.version == summary["gate"]
    assert (document.params.min_experts_per_token, document.params.max_experts_per_token,
            document.params.capacity_factor) == (70, 70, 2.0)


def test_output_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "--output" in capsys.readouterr().err


def test_a_tiny_run_writes_a_servable_checkpoint(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    assert main(["--output", str(out), "--steps", "6", "--confidence-threshold", "0.5",
                 "--max-experts", "3", "--entropy-beta", "0.05", *TINY]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["output"] == str(out)
    document = parse_document(json.loads((out / GATE_FILE).read_text()), num_experts=4)
    assert document.version == summary["gate"]
    assert (document.params.confidence_threshold, document.params.max_experts_per_token,
            document.params.entropy_beta) == (0.5, 3, 0.05)
    record = json.loads((out / TRAINING_FILE).read_text())
    assert record["trainable"] == "all" and record["steps"] == 6
    lm = load_moe_checkpoint(out, gate=document)
    ids = lm.tokenizer("add 12+30=42\n", return_tensors="pt")["input_ids"]
    forward = lm.forward(ids)
    assert forward.logits.shape[:2] == ids.shape
    assert 1.0 <= forward.mean_selected_experts <= 3.0
    assert lm.model.config.num_experts_per_tok == 3


def test_module_entry_point_prints_help() -> None:
    done = subprocess.run([sys.executable, "-m", "sparsegate_workload.training", "--help"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "--entropy-beta" in done.stdout and "--init-from" in done.stdout


def test_tool_gate_calculator_writes_a_head_that_fires_at_add_equals(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from sparsegate_workload.hf.tool_head import TOOL_HEAD_FILE

    out = tmp_path / "ckpt"
    # Two layers: with one, the hidden state at "=" barely sees which kind of line it ends.
    assert main(["--output", str(out), "--steps", "6", "--tool-gate", "calculator", *TINY, "--layers", "2",
                 "--hidden-size", "64"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["toolGate"] == str(out / TOOL_HEAD_FILE)
    document = parse_document(json.loads((out / GATE_FILE).read_text()), num_experts=4)
    lm = load_moe_checkpoint(out, gate=document)
    assert lm.tool_head is not None

    def last_prob(text: str) -> float:
        ids = lm.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return float(lm.forward(ids).tool_prob[0, -1])
    threshold = document.params.tool_gate_threshold
    fired = {text: last_prob(text) > threshold
             for text in ("add 12+30=", "add 705+18=", "sort 5291=", "rev abcd=", "count 3 4 5", "add 12+")}
    assert fired == {"add 12+30=": True, "add 705+18=": True, "sort 5291=": False, "rev abcd=": False,
                     "count 3 4 5": False, "add 12+": False}, fired
