"""tests/bench/benchstats.py: the percentiles the benches print (bench_opa, bench_scale,
bench_service_create) by the nearest-rank definition."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from benchstats import nearest_rank  # noqa: E402


@pytest.mark.parametrize("n, q, want", [
    (100, 0.99, 99),    # p99 of 100 values: the 99th, not the maximum
    (2000, 0.99, 1980),
    (300, 0.99, 297),
    (10, 0.5, 5),       # ⌈0.5·10⌉ = 5th
    (11, 0.5, 6),
    (2, 0.5, 1),
    (100, 0.07, 7),     # 0.07 * 100 is 7.000000000000001 in floating point
    (100, 0.29, 29),    # 0.29 * 100 is 28.999999999999996
    (100, 0.991, 100),
    (5, 1.0, 5),
    (5, 0.0, 1),
    (1, 0.99, 1),
])
def test_nearest_rank_is_the_ceil_q_n_th_smallest(n: int, q: float, want: int) -> None:
    values = [float(v) for v in range(n, 0, -1)]  # unsorted on purpose
    assert nearest_rank(values, q) == want
