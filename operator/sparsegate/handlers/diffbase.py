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
"""

from __future__ import annotations

import json
from typing import Any

import kopf

from sparsegate_contracts import names
from sparsegate_contracts.names import KOPF_ANNOTATION_PREFIX, KOPF_DIFFBASE_KEY


# What Kopf's essence keeps of an object's metadata, and what its key naming reads (mark_key).
_METADATA_READ = ("labels", "annotations", "ownerReferences")


class InProcessDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """Essences by object uid, as compact JSON (10,000 models: a few MiB). ``build`` gives the
    annotation storage's essence, so the legacy annotation never counts as a change."""

    def __init__(self, *, prefix: str, key: str) -> None:
        super().__init__(prefix=prefix, key=key)
        self._essences: dict[str, str] = {}

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        """Kopf's essence of ``body``, built from the object without its status and with only the
        metadata Kopf reads, so those are not deep-copied first. With extra fields (a handler
        filtering on a field outside the spec, possibly in status): Kopf's build of the whole body."""
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


STORAGE = InProcessDiffBaseStorage(prefix=KOPF_ANNOTATION_PREFIX, key=KOPF_DIFFBASE_KEY)


def _deleted(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


@kopf.on.event(names.GROUP, names.VERSION, names.SPARSEMODELS, when=_deleted)
@kopf.on.event(names.GROUP, names.VERSION, names.ROUTINGPOLICIES, when=_deleted)
async def forget_deleted(uid: str | None, **_: Any) -> None:
    """Every kind with create/update handlers (``sparsemodel``, ``routingpolicy``)."""
    STORAGE.forget(uid)
