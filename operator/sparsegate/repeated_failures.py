"""One rule for failures tried again every tick or round (a pod refusing its push, a status write
refused, OPA or the API server down): logged at WARNING when a failure starts or changes, at DEBUG
while the same one repeats, so a persistent failure is not a log line per object per tick."""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def repeats(last: MutableMapping[K, str], key: K, error: str | None) -> bool:
    """Record ``key``'s latest outcome in ``last``: ``error``, or None when it succeeded (its record
    goes). Returns whether ``error`` is the one recorded before: log it at DEBUG; False is news."""
    if error is None:
        last.pop(key, None)
        return False
    repeated = last.get(key) == error
    last[key] = error
    return repeated
