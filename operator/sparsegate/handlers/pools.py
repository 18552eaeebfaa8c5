"""Where blocking SparseModel work runs: Kopf's handler thread pool, not asyncio's default one.

The model handlers are async (they read the Kopf indexes on the event loop, where Kopf writes
them) and hand their blocking API calls to :func:`run_model_work`. That pool
(``settings.execution.executor``, ``max_workers`` set in ``sparsegate.main``) is the one they ran in
when they were sync handlers; the rollout and access loops' short calls (``asyncio.to_thread``)
keep the default pool to themselves, so a burst of thousands of model reconciles cannot queue a
rollout tick behind it (bench_scale at 1,000 models: rollout tick p50 over 10 s with one pool,
1.5 s with two).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import kopf

from sparsegate import metrics

T = TypeVar("T")
P = ParamSpec("P")

# Bound on one read through :func:`loop_reader` (the loop answers in microseconds unless blocked).
LOOP_READ_TIMEOUT_S = 30.0


async def run_model_work(memo: kopf.Memo, func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``func(*args, **kwargs)`` in the model pool, with the caller's context variables (Kopf posts
    Events through them); the time it waited for a thread is observed in
    ``sparsegate_operator_model_pool_wait_seconds{work=<func's name>}``."""
    context = contextvars.copy_context()
    queued = time.monotonic()
    wait = metrics.POOL_WAIT.labels(work=func.__name__.lstrip("_"))

    def call() -> T:
        wait.observe(time.monotonic() - queued)
        return context.run(func, *args, **kwargs)

    return await asyncio.get_running_loop().run_in_executor(memo.model_pool, call)


def loop_reader(read: Callable[P, T]) -> Callable[P, T]:
    """``read`` made callable from a pool thread: each call runs it (with the call's arguments) on
    this event loop (where Kopf updates its indexes, so a read never sees an index mid-update) and
    waits for the answer."""
    loop = asyncio.get_running_loop()

    async def on_loop(*args: P.args, **kwargs: P.kwargs) -> T:
        return read(*args, **kwargs)

    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            if asyncio.get_running_loop() is loop:
                return read(*args, **kwargs)  # already on the loop (not from a pool thread)
        except RuntimeError:
            pass
        return asyncio.run_coroutine_threadsafe(on_loop(*args, **kwargs), loop).result(timeout=LOOP_READ_TIMEOUT_S)

    return call
