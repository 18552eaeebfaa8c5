"""The operator's Kopf memo, whose per-object copies stay small.

Kopf gives every object it watches a memo of its own, made with ``copy.copy`` of the operator's
memo: a dict holding every shared key (API client, pools, controllers), once per pod, Deployment,
ReplicaSet, SparseModel and GateConfig — about 380 bytes each, 20 MiB at 10,000 models
(``tests/bench/bench_operator_memory.py``). An :class:`OperatorMemo`'s copy is an empty
:class:`ObjectMemo` that reads the shared keys through to it; what a handler sets on an object's
memo (a model's fleet cache, a GateConfig's rollout cache) stays that object's own.
"""

from __future__ import annotations

from typing import Any

import kopf


class ObjectMemo(kopf.Memo):
    """One object's memo: its own keys first, then the operator's."""

    __slots__ = ("_shared",)

    def __init__(self, shared: kopf.Memo) -> None:
        super().__init__()
        object.__setattr__(self, "_shared", shared)

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            pass
        try:
            return self._shared[key]
        except KeyError as e:
            raise AttributeError(str(e)) from None

    def __copy__(self) -> ObjectMemo:
        copied = ObjectMemo(self._shared)
        copied.update(self)
        return copied


class OperatorMemo(kopf.Memo):
    """The memo ``sparsegate run`` gives Kopf (``kopf.run(memo=...)``): startup fills it."""

    def __copy__(self) -> ObjectMemo:
        return ObjectMemo(self)
