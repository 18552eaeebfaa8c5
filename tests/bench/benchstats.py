"""Summaries the benches share (run as scripts, so they import this as a sibling module)."""

from __future__ import annotations

import math


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (not empty) by nearest rank: the smallest value with at
    least a ``q`` share of the values at or below it, i.e. the ⌈q·n⌉-th smallest (the smallest for
    q = 0, the largest for q = 1). p99 of 100 values is the 99th, not the largest."""
    ordered = sorted(values)
    rank = math.ceil(round(q * len(ordered), 9))  # round: 0.07 * 100 is 7.000000000000001
    return ordered[min(len(ordered), max(rank, 1)) - 1]
