"""What each SparseModel's status was last computed from, so a Deployment event that changes none
of it costs no API request.

Two writers share a model's status (``handlers.modelsync``): the reconcile and the Deployment
watcher. Both derive Ready, Progressing, Reconciling and the replica counts from the same inputs
(``domain.model_status.workload_inputs``: the Deployment's generation, replica counts and
progress deadline, the pods' container problems) and from the model's own status, which only these writers change. At
scale most Deployment events change none of the inputs: in a 1,000-model create, about half of
~5,000 Deployment events read the SparseModel and then wrote nothing. This keeps, per model, the
inputs its status was last written from (or found to match already); a refresh with the same
inputs is skipped.

A check and a write for one model hold the same lock (striped: a fixed set shared by hash), so a
check never passes while a write from other inputs is in flight, and the record always names the
inputs of the write that landed last. The Deployment handler also checks once on the event loop,
before handing the event to a pool thread (:meth:`StatusInputs.settled`): that check passes only
while no write of the model is in flight, and a write that starts later reads the Deployment view
after the event's own index update, so it cannot record older inputs than the event's. A restarted
operator starts with nothing recorded: the first event of each model reads and writes as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sparsegate.domain.model_status import WorkloadInputs

Key = tuple[str, str]


class StatusInputs:
    """Thread-safe: used from the model handlers' pool threads."""

    def __init__(self, *, stripes: int = 64) -> None:
        self._locks = [threading.Lock() for _ in range(stripes)]
        self._seen: dict[Key, tuple[str, WorkloadInputs]] = {}
        self._busy: set[Key] = set()  # models whose guard is held (set ops are atomic under the GIL)

    @contextmanager
    def guard(self, namespace: str, name: str) -> Iterator[None]:
        """Held around one model's check-or-write (not re-entrant)."""
        key = (namespace, name)
        with self._locks[hash(key) % len(self._locks)]:
            self._busy.add(key)
            try:
                yield
            finally:
                self._busy.discard(key)

    def settled(self, namespace: str, name: str, *, uid: str | None, inputs: WorkloadInputs) -> bool:
        """:meth:`matches`, and no check or write of the model in flight: safe without the guard."""
        return (namespace, name) not in self._busy and self.matches(namespace, name, uid=uid, inputs=inputs)

    def matches(self, namespace: str, name: str, *, uid: str | None, inputs: WorkloadInputs) -> bool:
        """True if the status of model ``uid`` was last written from (or found to match) ``inputs``."""
        return uid is not None and self._seen.get((namespace, name)) == (uid, inputs)

    def record(self, namespace: str, name: str, *, uid: str | None, inputs: WorkloadInputs) -> None:
        if uid is None:
            self._seen.pop((namespace, name), None)
        else:
            self._seen[(namespace, name)] = (uid, inputs)

    def known(self, namespace: str, name: str) -> bool:
        """True if this process has written (or checked) the model's status since its start."""
        return (namespace, name) in self._seen

    def forget(self, namespace: str, name: str) -> None:
        self._seen.pop((namespace, name), None)
