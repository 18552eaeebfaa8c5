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
])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--output", str(tmp_path / "out"), *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err, err
    assert not (tmp_path / "out").exists()


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
