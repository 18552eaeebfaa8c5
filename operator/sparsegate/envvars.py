"""Numbers the operator reads from its environment (set by the chart, or by operator.extraEnv).

Read when a handler module is imported, so a bad value stops the operator at start with the
variable's name, instead of a bare ``float()`` error or a loop that never waits (0, negative, NaN).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping


def seconds(name: str, default: float, *, env: Mapping[str, str] | None = None) -> float:
    """``env[name]`` as a positive, finite number of seconds; unset or empty: ``default``."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be a positive number of seconds (e.g. 5 or 0.5), got {raw!r}")
    return value
