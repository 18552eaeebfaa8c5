"""The model server's one model thread.

Every model call (load, gate swap, a ``/v1/infer`` batch, a generation engine job) runs on one
thread, in submission order, so a swap lands between two calls, never inside one. This executor
also says how many calls are queued behind the running one: a generation job that runs several
decode steps in a row (`batch_engine`) ends at the next step boundary when one is, so a swap or a
batch waits at most one step, as it did when every job was one step.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class ModelThread(concurrent.futures.ThreadPoolExecutor):
    """A one-worker executor that counts the calls submitted and not yet started."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="model")
        self._lock = threading.Lock()
        self._queued = 0
        self._busy_since: float | None = None

    @property
    def busy_for(self) -> float:
        """Seconds the running call has run (0 when idle): a call that never returns (a hung
        kernel, a deadlock) keeps growing it, and every model call behind it waits."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def queued(self) -> int:
        """Calls waiting to start (the running one is not counted)."""
        return self._queued

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[T]:
        with self._lock:
            self._queued += 1
        started = [False]  # set once, under the lock: counted out exactly once

        def call() -> T:
            self._dequeue(started)
            self._busy_since = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self._busy_since = None
        try:
            future = super().submit(call)
        except BaseException:
            self._dequeue(started)
            raise
        # Cancelled before it started (shutdown with cancel_futures, a caller gave up): it never runs.
        future.add_done_callback(lambda f: f.cancelled() and self._dequeue(started))
        return future

    def _dequeue(self, started: list[bool]) -> None:
        with self._lock:
            if not started[0]:
                started[0] = True
                self._queued -= 1
