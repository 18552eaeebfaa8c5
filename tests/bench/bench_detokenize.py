"""The text of a generation as its tokens come (a benchmark, not a test).

    python tests/bench/bench_detokenize.py [--lengths 256,1024,4096] [--repeats 3]

What the model server does per generated token with a stop string or a stream: the text so far,
to search or to send. Side by side, interleaved, on the same token ids (a tiny byte-level BPE
tokenizer made in code, `hf.build_tiny_tokenizer`, and text of mixed scripts): decoding every
id so far after each token (the server before `hf_serving.GrowingText`) vs `GrowingText`.
Prints the time per generated token for each and their ratio at each length.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workloads"))

from sparsegate_workload.hf import build_tiny_tokenizer  # noqa: E402
from sparsegate_workload.hf_serving import GrowingText, decode  # noqa: E402


def whole(tokenizer, ids: list[int]) -> str:
    text = ""
    for k in range(1, len(ids) + 1):
        text = decode(tokenizer, ids[:k])
    return text


def grown(tokenizer, ids: list[int]) -> str:
    text, growing = "", GrowingText(tokenizer)
    for token in ids:
        text = growing.extend([token])
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = build_tiny_tokenizer()
    rng = random.Random(0)
    words = ["the", "gate", "keeps", "experts", "naïve", "café", "数字", "🙂", "x²", "\n", ",", "."]
    print(f"{'tokens':>7} {'whole µs/token':>15} {'grown µs/token':>15} {'grown ÷ whole':>14}")
    for n in (int(x) for x in args.lengths.split(",")):
        ids: list[int] = []
        while len(ids) < n:
            ids += tok(" " + rng.choice(words), add_special_tokens=False)["input_ids"]
        ids = ids[:n]
        times = {"whole": [], "grown": []}
        for _ in range(args.repeats):  # interleaved
            for name, fn in (("whole", whole), ("grown", grown)):
                start = time.perf_counter()
                text = fn(tok, ids)
                times[name].append(time.perf_counter() - start)
                assert text == decode(tok, ids)
        w, g = (min(times[k]) / n * 1e6 for k in ("whole", "grown"))
        print(f"{n:>7} {w:>15.1f} {g:>15.1f} {g / w:>14.3f}")


if __name__ == "__main__":
    main()
