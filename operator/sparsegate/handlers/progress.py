"""Kopf's progress records (``sparsegate.dev/<handler id>`` annotations: a handler's retries and
delays), read so that one not as Kopf writes it is no record.

Kopf decodes the annotation of each handler of an object at every change it handles (and at each
object's resume when the operator starts) and does not catch what fails: an undecodable value
(``sparsegate.dev/reconcile_model: oops``, an edit, another tool), a JSON value that is not an
object or a time it cannot parse stopped the watch of the whole kind ("Event processing has failed
with an unrecoverable error ... The operator will stop"), at every start again: one annotation on
one SparseModel put the operator in a crash loop. Such a record reads as none (the handler runs as
on a first change; its success purges the annotation), with a WARNING naming it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import iso8601  # Kopf's own parser of these times
import kopf

log = logging.getLogger(__name__)

_TIMES = ("started", "stopped", "delayed")
_TEXTS = ("purpose", "message")
_FLAGS = ("success", "failure")


def record_problem(record: Any) -> str | None:
    """Why a decoded progress record is not one Kopf can read (None: it is)."""
    if not isinstance(record, Mapping):
        return f"not an object: {type(record).__name__}"
    for key in _TIMES:
        value = record.get(key)
        if value is None:
            continue
        try:
            if not isinstance(value, str):
                raise ValueError(value)
            iso8601.parse_date(value)
        except (ValueError, iso8601.ParseError):
            return f"{key} is not a time: {value!r}"
    retries = record.get("retries")
    if retries is not None and (not isinstance(retries, int) or isinstance(retries, bool)):
        return f"retries is not an integer: {retries!r}"
    for key in _TEXTS:
        if record.get(key) is not None and not isinstance(record[key], str):
            return f"{key} is not a string: {record[key]!r}"
    for key in _FLAGS:
        if record.get(key) is not None and not isinstance(record[key], bool):
            return f"{key} is not a boolean: {record[key]!r}"
    subrefs = record.get("subrefs")
    if subrefs is not None and (not isinstance(subrefs, list) or not all(isinstance(s, str) for s in subrefs)):
        return f"subrefs is not a list of handler ids: {subrefs!r}"
    return None


class ProgressStorage(kopf.AnnotationsProgressStorage):
    """Kopf's annotation progress storage whose ``fetch`` reads a malformed record as none."""

    def fetch(self, *, key: Any, body: kopf.Body) -> Any:
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        for full_key in self.make_keys(key, body=body):
            encoded = annotations.get(full_key)
            if encoded is None:
                continue
            try:
                decoded = json.loads(encoded)
            except (TypeError, ValueError) as e:
                problem: str | None = f"not JSON: {e}"
            else:
                if decoded is None:
                    continue  # as Kopf reads it
                problem = record_problem(decoded)
            if problem is None:
                return decoded
            meta = body.get("metadata") or {}
            log.warning("%s/%s: annotation %s ignored (%s): the handler runs as on a first change",
                        meta.get("namespace"), meta.get("name"), full_key, problem)
        return None
