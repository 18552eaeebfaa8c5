"""argparse value types shared by the workload's command lines (sparsegate-train, sparsegate-calibrate)."""

from __future__ import annotations

import argparse
from typing import Callable


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= lo``, refused with a message naming the bound."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value
    return parse
