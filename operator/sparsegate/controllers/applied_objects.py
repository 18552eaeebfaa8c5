"""Which of a SparseModel's owned objects a reconcile needs to apply again.

Every reconcile renders all of a model's objects, but a change (a replica count, a gate version)
usually touches only some of them. Server-side applying an unchanged object writes nothing to
etcd, yet the API server still decodes it, merges it and compares managed fields, and the
reconcile waits for the answer (``bench_scale.py --apiserver-cost`` at 10,000 models: PATCH
handling 29 % of the API server's CPU, managed fields 24 %). So this process remembers, per model,
a digest of each object as it last applied it (or, for the admin Secret, last found usable), and
a reconcile skips the ones whose rendering has not changed since.

The operator does not watch these objects, so an edit or a deletion by someone else is undone by
the first reconcile after ``interval_s`` (``--reapply-interval``, an hour by default) instead of
by the next one: a record older than that no longer counts. 0 keeps no record (every reconcile applies everything).
A model's records are dropped when its Deployment is deleted (the model itself deleted, or the
Deployment deleted from under it and re-created: everything is applied again), and a restarted
operator starts with none.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping
from typing import Any

# ``sparsegate run --reapply-interval``'s default. A record helps only a reconcile within the
# interval of the model's last one: at 10 minutes, 190 of the 200 changes of bench_scale's
# 10,000-model steady phase (models last applied 1 to 44 minutes before, in the create burst)
# applied everything again. An hour bounds how long reconciles leave an edit by someone else standing.
DEFAULT_INTERVAL_S = 3600.0

ModelKey = tuple[str, str]  # (namespace, model name)
ObjectKey = tuple[str, str]  # (kind, name)


def digest(obj: Mapping[str, Any]) -> bytes:
    """Equal for objects that are equal as JSON documents (key order aside)."""
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode(), digest_size=16).digest()


class AppliedObjects:
    """Thread-safe: reconciles run in pool threads."""

    def __init__(self, *, interval_s: float) -> None:
        if interval_s < 0:
            raise ValueError(f"the re-apply interval must be 0 (off) or positive, not {interval_s}")
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._records: dict[ModelKey, dict[ObjectKey, tuple[bytes, float]]] = {}

    def unchanged(self, model: ModelKey, obj: Mapping[str, Any], *, now: float) -> bool:
        """True if ``obj`` (rendered for ``model``) is what this process last applied, less than
        ``interval_s`` before ``now`` (seconds on a monotonic clock)."""
        with self._lock:
            record = self._records.get(model, {}).get(_key(obj))
        return record is not None and now - record[1] < self.interval_s and record[0] == digest(obj)

    def record(self, model: ModelKey, obj: Mapping[str, Any], *, now: float) -> None:
        """``obj`` was applied (or found as rendered) at ``now``."""
        if self.interval_s == 0:
            return
        entry = (digest(obj), now)
        with self._lock:
            self._records.setdefault(model, {})[_key(obj)] = entry

    def forget(self, model: ModelKey) -> None:
        with self._lock:
            self._records.pop(model, None)

    def __len__(self) -> int:
        """Models with records."""
        return len(self._records)


def _key(obj: Mapping[str, Any]) -> ObjectKey:
    return obj["kind"], obj["metadata"]["name"]
