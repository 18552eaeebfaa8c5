"""The memo ``sparsegate run`` gives Kopf: each object's copy is empty and reads the operator's keys
through, so tens of thousands of watched objects do not each hold a dict of every shared key."""

from __future__ import annotations

import asyncio
import copy
import sys
import uuid
from typing import Any

import kopf
import pytest
from kopf._core.reactor import inventory

from sparsegate import cli
from sparsegate.memo import ObjectMemo, OperatorMemo


def _operator_memo() -> OperatorMemo:
    memo = OperatorMemo()
    memo.kube = object()
    memo.pool = object()
    return memo


def test_an_objects_memo_reads_the_operators_keys_and_keeps_its_own() -> None:
    shared = _operator_memo()
    one, other = copy.copy(shared), copy.copy(shared)
    assert isinstance(one, ObjectMemo) and len(one) == 0
    assert one.kube is other.kube is shared.kube
    one.cache = ["mine"]
    assert one.cache == ["mine"] and getattr(other, "cache", None) is None
    assert "cache" not in shared and one["cache"] == ["mine"]
    shared.late = 3  # set on the operator's memo after the copy: seen through it
    assert one.late == 3
    one.kube = "own"  # an object's own key hides the shared one for that object only
    assert one.kube == "own" and other.kube is shared.kube


def test_a_missing_key_is_an_attribute_error_as_with_kopfs_memo() -> None:
    one = copy.copy(_operator_memo())
    with pytest.raises(AttributeError, match="nope"):
        _ = one.nope
    assert getattr(one, "nope", None) is None
    assert not hasattr(one, "nope")


def test_copying_an_objects_memo_keeps_its_keys_and_the_shared_ones() -> None:
    shared = _operator_memo()
    one = copy.copy(shared)
    one.cache = 1
    again = copy.copy(one)
    assert isinstance(again, ObjectMemo) and again.cache == 1 and again.kube is shared.kube
    again.cache = 2
    assert one.cache == 1


def test_kopf_gives_each_object_an_empty_memo_that_reads_through() -> None:
    """Through Kopf's own per-object record, as its watch processing makes it."""
    shared = _operator_memo()
    memories = inventory.ResourceMemories()

    async def recall(uid: str) -> Any:
        return await memories.recall({"metadata": {"uid": uid}}, memobase=shared)

    first = asyncio.run(recall(str(uuid.uuid4())))
    second = asyncio.run(recall(str(uuid.uuid4())))
    assert isinstance(first.memo, ObjectMemo) and first.memo is not second.memo
    assert first.memo.pool is shared.pool and len(first.memo) == 0
    # Far smaller than Kopf's copy of the same memo, which holds every shared key.
    plain = kopf.Memo(shared)
    assert sys.getsizeof(first.memo) < sys.getsizeof(copy.copy(plain))


def test_sparsegate_run_gives_kopf_an_operator_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(kopf, "run", lambda **kwargs: seen.update(kwargs))
    assert cli.main(["run", "--standalone", "-n", "x"]) == 0
    assert isinstance(seen["memo"], OperatorMemo)
