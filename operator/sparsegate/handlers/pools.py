"""Where blocking SparseModel work runs: Kopf's handler thread pool, not asyncio's default one.

The model handlers are async (they read the Kopf indexes on the event loop, where Kopf writes
them) and hand their blocking API calls to :func:`run_model_work`. That pool
(``settings.execution.executor``, ``max_workers`` set in ``sparsegate.main``) is the one they ran in
when they were sync handlers; the rollout and access loops' short calls (``asyncio.to_thread``)
keep the default pool to themselves, so a burst of thousands of model reconciles cannot queue a
rollout tick behind it (bench_scale at 1,000 models: rollout tick p50 over 10 s with one pool,
1.5 s with two). Status refreshes (a model's Deployment or pods changed) have a small pool of their
own (:func:`run_status_work`), so a model whose Deployment became available is marked Ready without
waiting for every reconcile queued before it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Callable
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
    ``sparsegate_operator_model_pool_wait_seconds{pool="model",work=<func's name>}``."""
    return await _run_in(memo.model_pool, "model", func, args, kwargs)


# (namespace, model) -> its lock and how many hold or wait for it (the entry goes with the last).
_model_turns: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}


@contextlib.asynccontextmanager
async def model_turn(namespace: str, name: str) -> AsyncIterator[None]:
    """One reconcile of a model at a time. Kopf serialises its own handlers per object, but a
    re-render (``handlers.gatebinding``) runs beside them: each reads the model, renders and applies
    it, so interleaved, the older read could be applied last (a Deployment from the previous spec)."""
    key = (namespace, name)
    lock, users = _model_turns.get(key, (None, 0))
    lock = lock or asyncio.Lock()
    _model_turns[key] = (lock, users + 1)
    try:
        async with lock:
            yield
    finally:
        lock, users = _model_turns[key]
        if users == 1:
            del _model_turns[key]
        else:
            _model_turns[key] = (lock, users - 1)


async def run_status_work(memo: kopf.Memo, func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """As :func:`run_model_work`, in the status pool: a model's status refresh from its Deployment
    or pods (a GET and a status PATCH, ~0.07 s) never queues behind other models' reconciles (~1.3 s
    each at 10,000 models). bench_scale at 10,000 models, one FIFO pool: a refresh waited p50 153 s,
    p99 1,180 s, and at the cut 6,199 models with an available Deployment were not Ready yet."""
    return await _run_in(memo.status_pool, "status", func, args, kwargs)


async def _run_in(pool: concurrent.futures.Executor, name: str, func: Callable[..., T],
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    context = contextvars.copy_context()
    queued = time.monotonic()
    wait = metrics.POOL_WAIT.labels(pool=name, work=func.__name__.lstrip("_"))

    def call() -> T:
        wait.observe(time.monotonic() - queued)
        return context.run(func, *args, **kwargs)

    return await asyncio.get_running_loop().run_in_executor(pool, call)


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
