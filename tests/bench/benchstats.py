"""Summaries the benches share (run as scripts, so they import this as a sibling module)."""

from __future__ import annotations


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (not empty) by nearest rank: the value at index ⌊q·n⌋ of
    the sorted values, the largest for q = 1."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
