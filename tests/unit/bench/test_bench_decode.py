"""tests/bench/bench_decode.py: every timed run's tokens are checked against HF sequential's,
and each run's tokens/s comes from that run's own tokens (the engine and HF are faked here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_decode  # noqa: E402

MAX_TOKENS = 8


def test_a_run_whose_tokens_differ_is_reported_not_only_the_last(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import transformers

    calls = {"sg": 0}

    def fake_sparsegate(hf, batch, max_tokens, max_num_seqs):
        if max_tokens != MAX_TOKENS:  # the warm-up
            return 1.0, [[5] * max_tokens for _ in batch]
        calls["sg"] += 1
        out = [[5] * max_tokens for _ in batch]
        if calls["sg"] == 1:  # the first timed run: request 0 got other (and fewer) tokens
            out[0] = [6] * (max_tokens // 2)
        return 1.0, out

    def fake_hf(model, batch, max_tokens):
        return 1.0, [[5] * max_tokens for _ in batch]

    monkeypatch.setattr(bench_decode, "build_tiny_checkpoint", lambda path, **_: path)
    monkeypatch.setattr(bench_decode, "load", lambda path, **_: SimpleNamespace(vocab_size=32))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: SimpleNamespace(eval=lambda: None)))
    monkeypatch.setattr(bench_decode, "run_sparsegate", fake_sparsegate)
    monkeypatch.setattr(bench_decode, "run_hf_sequential", fake_hf)
    monkeypatch.setattr(bench_decode, "run_hf_batched", fake_hf)
    out = tmp_path / "bench_decode.json"
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--concurrency", "2", "--runs", "3",
                                      "--max-tokens", str(MAX_TOKENS), "--out", str(out)])
    bench_decode.main()

    (row,) = json.loads(out.read_text())["rows"]
    assert row["requests_with_other_tokens"] == 1
    # Runs 2 and 3 generated 16 tokens in 1 s on both sides, run 1 12 against 16: median ratio 1.
    assert row["ratio_vs_hf_sequential"] == pytest.approx(1.0)
    assert row["tokens_per_s"]["sg"] == pytest.approx(16.0)
