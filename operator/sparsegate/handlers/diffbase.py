"""Kopf's diff-base — the essence of each object as last handled, which tells a change from a
no-op — kept in this process instead of in an annotation on the object.

Kopf's default writes ``sparsegate.dev/last-handled-configuration`` after every handled change:
one more PATCH of the object (schema and CEL validation, managed fields, an etcd write) and one
more watch event to every watcher, per change (``bench_scale.py --apiserver-cost``). Kept here, a
handled change costs no write of Kopf's own (only an object's first handling still writes Kopf's
``sparsegate.dev/kopf-managed`` marker, once, which other Kopf operators rely on to ignore our
annotations). What is lost on a restart is harmless: an object without a stored essence is handled
as created, by the same handler the resume would have run (every kind here registers one function
for resume, create and update), so a new process reconciles each object once, as before.

An annotation left by an earlier operator version is ignored in the essence and removed with the
next handled change. Essences of deleted objects are forgotten on their DELETED event.

Kopf builds the essence of every event it processes by deep-copying the whole object and then
dropping all but the spec, labels and annotations; the managed fields and status it copies are
most of a SparseModel. ``build`` hands Kopf's code only what it keeps (the same essence):
``bench_scale.py --operator-profile`` at 1,000 models found that copy in 11 % of the operator's
samples holding the GIL over the steady phase.

Kopf also builds the essence of every event of every kind it watches (pods, Deployments,
ReplicaSets, GateConfigs), though only kinds with create/update/resume handlers (or daemons and
timers: we have none) read it. ``build`` answers an empty essence for the others: a pod's build
deep-copied the whole pod, managed fields included, on each of 20,000 pods' events.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

import kopf

from sparsegate_contracts import names
from sparsegate_contracts.names import KOPF_ANNOTATION_PREFIX, KOPF_DIFFBASE_KEY


# What Kopf's essence keeps of an object's metadata, and what its key naming reads (mark_key).
_METADATA_READ = ("labels", "annotations", "ownerReferences")

# The kinds of our group whose essence Kopf reads: those with create/update/resume handlers
# (``sparsemodel``, ``routingpolicy``; test_diffbase checks it against Kopf's registry).
ESSENCE_KINDS: frozenset[str] = frozenset({"SparseModel", "RoutingPolicy"})


class InProcessDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """Essences by object uid, as compact JSON (10,000 models: a few MiB). ``build`` gives the
    annotation storage's essence, so the legacy annotation never counts as a change."""

    def __init__(self, *, prefix: str, key: str, kinds: Collection[str] | None = None) -> None:
        """``kinds``: the kinds of ``names.GROUP`` whose essence is read (None: every kind's)."""
        super().__init__(prefix=prefix, key=key)
        self._essences: dict[str, str] = {}
        self._kinds = None if kinds is None else frozenset(kinds)

    def _unread(self, body: kopf.Body) -> bool:
        """An object of a kind whose essence nothing reads (unknown kind: read, to be safe)."""
        if self._kinds is None:
            return False
        api_version, kind = body.get("apiVersion"), body.get("kind")
        if not api_version or not kind:
            return False
        return not (kind in self._kinds and api_version.partition("/")[0] == names.GROUP)

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        """Kopf's essence of ``body``, built from the object without its status and with only the
        metadata Kopf reads, so those are not deep-copied first; empty for a kind whose essence
        nothing reads. With extra fields (a handler filtering on a field outside the spec,
        possibly in status): Kopf's build of the whole body."""
        if self._unread(body):
            return {}
        if extra_fields:
            return super().build(body=body, extra_fields=extra_fields)
        metadata = body.get("metadata") or {}
        lean = {key: value for key, value in body.items() if key not in ("metadata", "status")}
        lean["metadata"] = {key: metadata[key] for key in _METADATA_READ if key in metadata}
        return super().build(body=kopf.Body(lean))

    def fetch(self, *, body: kopf.Body) -> Any:
        encoded = self._essences.get(body.metadata.uid or "")
        return json.loads(encoded) if encoded is not None else None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        self._essences[body.metadata.uid or ""] = json.dumps(essence, separators=(",", ":"))
        for full_key in self.make_keys(self.key, body=body):
            if full_key in body.metadata.annotations:
                patch.metadata.annotations[full_key] = None  # an earlier version's copy: stale from now on

    def forget(self, uid: str | None) -> None:
        self._essences.pop(uid or "", None)

    def __len__(self) -> int:
        return len(self._essences)


STORAGE = InProcessDiffBaseStorage(prefix=KOPF_ANNOTATION_PREFIX, key=KOPF_DIFFBASE_KEY, kinds=ESSENCE_KINDS)


def _deleted(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


async def forget_deleted(uid: str | None, **_: Any) -> None:
    """Registered for every kind whose essence is kept (ESSENCE_KINDS)."""
    STORAGE.forget(uid)


for _kind in sorted(ESSENCE_KINDS):
    kopf.on.event(names.GROUP, names.VERSION, names.PLURALS[_kind], when=_deleted)(forget_deleted)
