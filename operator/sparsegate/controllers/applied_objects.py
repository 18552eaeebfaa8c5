"""Which of a SparseModel's owned objects a reconcile needs to apply again.

Every reconcile renders all of a model's objects, but a change (a replica count, a gate version)
usually touches only some of them. Server-side applying an unchanged object writes nothing to
etcd, yet the API server still decodes it, merges it and compares managed fields, and the
reconcile waits for the answer (``bench_scale.py --apiserver-cost`` at 10,000 models: PATCH
handling 29 % of the API server's CPU, managed fields 24 %). So this process remembers, per model,
a digest of each object as it last applied it (or, for the admin Secret, last found usable), and
a reconcile skips the ones whose rendering has not changed since.

A deletion of the Service or ConfigMap by someone else is put back at its watch event
(``handlers.sparsemodel.owned_object_deleted`` expires the model's records); so is another write
of them (``kubectl edit``: a Service's selector or ports, the ConfigMap's gate): they have no spec
generation, but the resourceVersion each apply of ours returned is kept (``record``'s
``answer``), and an event at a newer one is someone else's write (``foreign_write``; our own
apply's event carries the version its answer did, recognised without a request, and a no-op apply
returns the version it found, so a writer of only its own fields, a label or Argo CD's tracking
annotation, costs one no-op apply per write). A record older than ``interval_s``
(``--reapply-interval``, an hour by default) no longer counts either: what no watch reports (the
admin Secret) is undone by the first reconcile after it, or at once by touching the model (below).
0 keeps no record (every reconcile applies everything). The Deployment is
applied by every reconcile; the generation its last apply returned tells a later change of its
spec by someone else (``foreign_edit``), which its event handler puts back.
An object whose apply failed has no record (the next reconcile applies it) and keeps the error's
message until an apply of it lands (``failure``): a reconcile that does not wait for that object's
apply (the Service, ``handlers.modelsync``) reports the last one meanwhile. Such an apply is also
tracked while in flight (``begin``), so status written meanwhile can hold Ready back (``hold``) and
be written again once it lands (``take_held``).
A model's records are dropped when its Deployment is deleted (the model itself deleted, or the
Deployment deleted from under it and re-created: everything is applied again) or the model is
(one that never had a Deployment), and a restarted operator starts with none. They stop counting
(``expire``) when the model changes without a new generation (a label or an annotation: touching
it, or Kopf's retry of a failed reconcile), so touching a model repairs at once what was deleted
or edited (``handlers.sparsemodel``).
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
        self._failures: dict[ModelKey, dict[ObjectKey, str]] = {}
        self._in_flight: set[tuple[ModelKey, ObjectKey]] = set()
        self._held: set[tuple[ModelKey, ObjectKey]] = set()
        self._generations: dict[ModelKey, tuple[str | None, int]] = {}
        self._versions: dict[ModelKey, dict[ObjectKey, int]] = {}  # resourceVersions our applies returned

    def unchanged(self, model: ModelKey, obj: Mapping[str, Any], *, now: float) -> bool:
        """True if ``obj`` (rendered for ``model``) is what this process last applied, less than
        ``interval_s`` before ``now`` (seconds on a monotonic clock)."""
        with self._lock:
            record = self._records.get(model, {}).get(_key(obj))
        return record is not None and now - record[1] < self.interval_s and record[0] == digest(obj)

    def record(self, model: ModelKey, obj: Mapping[str, Any], *, now: float,
               answer: Mapping[str, Any] | None = None) -> None:
        """``obj`` was applied (or found as rendered) at ``now``; ``answer``: the apply's answer, whose
        resourceVersion tells the watch events of our own writes from others' (``foreign_write``)."""
        entry = (digest(obj), now)
        version = _version(answer)
        with self._lock:
            self._in_flight.discard((model, _key(obj)))
            _drop(self._failures, model, _key(obj))
            if self.interval_s:
                self._records.setdefault(model, {})[_key(obj)] = entry
            if version is not None:
                versions = self._versions.setdefault(model, {})
                if versions.get(_key(obj), -1) < version:  # answers may come out of order
                    versions[_key(obj)] = version

    def record_failure(self, model: ModelKey, obj: Mapping[str, Any], message: str) -> None:
        """Applying ``obj`` failed with ``message``: it is applied again next time."""
        with self._lock:
            self._in_flight.discard((model, _key(obj)))
            _drop(self._records, model, _key(obj))
            self._failures.setdefault(model, {})[_key(obj)] = message

    def begin(self, model: ModelKey, obj: Mapping[str, Any]) -> None:
        """An apply of ``obj`` is in flight, until ``record`` or ``record_failure``."""
        with self._lock:
            self._in_flight.add((model, _key(obj)))

    def unapplied(self, model: ModelKey, obj: Mapping[str, Any]) -> bool:
        """True while an apply of ``obj``'s kind and name is in flight or the last one failed."""
        with self._lock:
            return self._unapplied(model, _key(obj))

    def hold(self, model: ModelKey, obj: Mapping[str, Any]) -> bool:
        """Status is about to be written with Ready held back for ``obj``: True (and remembered for
        ``take_held``) if it is still unapplied, False if it landed meanwhile (write it as applied)."""
        with self._lock:
            if not self._unapplied(model, _key(obj)):
                return False
            self._held.add((model, _key(obj)))
            return True

    def _unapplied(self, model: ModelKey, key: ObjectKey) -> bool:
        """In flight or failed last time; the caller holds the lock."""
        return (model, key) in self._in_flight or key in self._failures.get(model, {})

    def take_held(self, model: ModelKey, obj: Mapping[str, Any]) -> bool:
        """True once if status was written with Ready held back for ``obj`` since the last call."""
        key = (model, _key(obj))
        with self._lock:
            if key not in self._held:
                return False
            self._held.discard(key)
            return True

    def failure(self, model: ModelKey, obj: Mapping[str, Any]) -> str | None:
        """The error of the last apply of ``obj``'s kind and name for ``model`` if it failed, else None."""
        with self._lock:
            return self._failures.get(model, {}).get(_key(obj))

    def record_deployment(self, model: ModelKey, deployment: Mapping[str, Any] | None) -> None:
        """``deployment`` is the answer of this process's apply of the model's Deployment: its uid
        and spec generation are what the next watch events of it are compared with (``foreign_edit``)."""
        meta = (deployment or {}).get("metadata") or {}
        generation = meta.get("generation")
        if generation is None:
            return
        with self._lock:
            record = self._generations.get(model)
            if record is None or record[0] != meta.get("uid") or record[1] < int(generation):
                self._generations[model] = (meta.get("uid"), int(generation))  # answers may come out of order

    def foreign_edit(self, model: ModelKey, deployment: Mapping[str, Any] | None) -> bool:
        """True if ``deployment`` (as watched) is at a spec generation past the one this process's
        last apply of it returned: someone else changed its spec since (``kubectl scale``, ``kubectl
        edit``, ``kubectl rollout restart``). Its status moving (pods becoming Ready) keeps the
        generation, as does an event of our own apply; with no apply recorded (a restarted
        operator: its resume applies everything) or another Deployment of the name, False."""
        meta = (deployment or {}).get("metadata") or {}
        generation = meta.get("generation")
        with self._lock:
            record = self._generations.get(model)
        return record is not None and generation is not None and meta.get("uid") == record[0] \
            and int(generation) > record[1]

    def foreign_write(self, model: ModelKey, obj: Mapping[str, Any] | None) -> bool:
        """True if ``obj`` (a Service or ConfigMap as watched) is at a resourceVersion past the one
        this process's last apply of it returned: someone else wrote it since (``kubectl edit``, a
        label). The event of our own apply carries the version its answer did (once recorded: an
        apply still in flight, ``applying``, may not be); with no apply recorded (a restarted
        operator: its resume applies everything), False."""
        version = _version(obj)
        if version is None:
            return False
        with self._lock:
            ours = self._versions.get(model, {}).get(_key(obj))
        return ours is not None and version > ours

    def applying(self, model: ModelKey, obj: Mapping[str, Any]) -> bool:
        """True while an apply of ``obj``'s kind and name is in flight (``begin``)."""
        with self._lock:
            return (model, _key(obj)) in self._in_flight

    def expire_object(self, model: ModelKey, obj: Mapping[str, Any]) -> None:
        """``obj``'s record no longer counts: the model's next reconcile applies it again."""
        with self._lock:
            _drop(self._records, model, _key(obj))

    def expire(self, model: ModelKey) -> None:
        """The model's records no longer count (its next reconcile applies everything again); an
        apply in flight or failed keeps its mark."""
        with self._lock:
            self._records.pop(model, None)

    def forget(self, model: ModelKey) -> None:
        with self._lock:
            self._records.pop(model, None)
            self._failures.pop(model, None)
            self._generations.pop(model, None)
            self._versions.pop(model, None)
            self._in_flight = {k for k in self._in_flight if k[0] != model}
            self._held = {k for k in self._held if k[0] != model}

    def __len__(self) -> int:
        """Models with records."""
        return len(self._records)


def _key(obj: Mapping[str, Any]) -> ObjectKey:
    return obj["kind"], obj["metadata"]["name"]


def _version(obj: Mapping[str, Any] | None) -> int | None:
    """``obj``'s resourceVersion as a number (etcd's revision: later writes have larger ones), or
    None (none, or not a number: such objects are left to ``--reapply-interval``)."""
    version = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    try:
        return int(version) if version is not None else None
    except (TypeError, ValueError):
        return None


def _drop(table: dict[ModelKey, dict[ObjectKey, Any]], model: ModelKey, key: ObjectKey) -> None:
    entries = table.get(model)
    if entries is not None:
        entries.pop(key, None)
        if not entries:
            del table[model]
