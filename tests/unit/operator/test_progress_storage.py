"""Kopf's progress annotations (sparsegate.dev/<handler id>) as the operator reads them: one not as
Kopf writes it is no record, rather than an error that stopped the operator (handlers.progress)."""

from __future__ import annotations

import asyncio
import json
import logging

import kopf
import pytest
from kopf._core.actions import progression  # what Kopf runs on every handled change (processing.py)

from sparsegate import main

HANDLER = "reconcile_model"


class _Handler:
    id = HANDLER


def _configured_storage() -> kopf.ProgressStorage:
    settings = kopf.OperatorSettings()
    main.configure(settings=settings, memo=kopf.Memo())
    return settings.persistence.progress_storage


def _state(storage: kopf.ProgressStorage, value: str) -> progression.State:
    annotations = {f"sparsegate.dev/{HANDLER}": value}
    body = kopf.Body({"metadata": {"name": "m", "namespace": "ns", "annotations": annotations}})

    async def read() -> progression.State:
        return progression.State.from_storage(body=body, storage=storage, handlers=[_Handler()])

    return asyncio.run(read())


@pytest.mark.parametrize("value", [
    "oops",  # not JSON
    "1", "[]", '"text"',  # JSON, not an object
    '{"started": "yesterday"}',  # a time Kopf cannot parse
    '{"delayed": 5}',
    '{"retries": "x"}',
    '{"success": "no"}',
    '{"subrefs": 3}',
])
def test_a_malformed_progress_annotation_reads_as_no_record(value: str, caplog: pytest.LogCaptureFixture) -> None:
    """The operator's configured storage: Kopf's own raised (JSONDecodeError, AttributeError,
    iso8601.ParseError) in the event's processing, which stopped the operator at every start."""
    with caplog.at_level(logging.WARNING, logger="sparsegate.handlers.progress"):
        state = _state(_configured_storage(), value)
    assert HANDLER not in state
    assert f"sparsegate.dev/{HANDLER}" in caplog.text and "ns/m" in caplog.text


def test_a_record_kopf_wrote_is_read_as_kopf_reads_it() -> None:
    record = {"started": "2026-12-07T10:00:00.123456+00:00", "delayed": "2026-12-07T10:01:00+00:00",
              "purpose": "update", "retries": 2, "success": False, "failure": False, "message": "boom",
              "subrefs": ["a/b"]}
    ours = _state(_configured_storage(), json.dumps(record))
    kopfs = _state(kopf.AnnotationsProgressStorage(prefix="sparsegate.dev"), json.dumps(record))
    assert ours[HANDLER].as_in_storage() == kopfs[HANDLER].as_in_storage()
    assert ours[HANDLER].retries == 2 and ours[HANDLER].message == "boom"
    assert _state(_configured_storage(), "null") == _state(kopf.AnnotationsProgressStorage(prefix="sparsegate.dev"),
                                                           "null")
