"""Interned copies of what the operator keeps of watched objects for as long as they exist.

Every watch event is decoded on its own, so each object's kept strings are copies of their own:
the namespace, label keys and values, owner kinds, phases, and the names and uids by which objects
refer to each other (a pod names its ReplicaSet, which names its Deployment, which names its
model). Interned, each such string is held once however many projections keep it — about 1.6 KiB
less per pod (``tests/bench/bench_operator_memory.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def text(value: T) -> T:
    """``value`` interned if it is a string, else ``value``."""
    return sys.intern(value) if type(value) is str else value  # type: ignore[return-value]


def deep(value: Any) -> Any:
    """A copy of a JSON-shaped value (mappings become dicts, lists and tuples lists and tuples) whose
    strings, keys included, are interned."""
    if type(value) is str:
        return sys.intern(value)
    if isinstance(value, Mapping):
        return {deep(k): deep(v) for k, v in value.items()}
    if isinstance(value, list):
        return [deep(v) for v in value]
    if isinstance(value, tuple):
        return tuple(deep(v) for v in value)
    return value
