"""handlers.pools: run_model_work observes how long each piece of model work waited for a thread
(``sparsegate_operator_model_pool_wait_seconds{pool,work}``): with the reconcile durations it tells
a slow reconcile from a long queue (bench_scale at 10,000 models); status refreshes run in a pool
of their own, so they never wait behind reconciles."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import kopf
import prometheus_client

from sparsegate.handlers.pools import run_model_work, run_status_work


def _refresh_under_test(value: int) -> int:
    return value * 2


def sample(name: str, pool: str = "model") -> float:
    return prometheus_client.REGISTRY.get_sample_value(
        f"sparsegate_operator_model_pool_wait_seconds_{name}", {"pool": pool, "work": "refresh_under_test"}) or 0.0


def test_the_wait_for_a_thread_is_observed_by_work_name() -> None:
    memo = kopf.Memo()
    memo.model_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    count0, sum0 = sample("count"), sample("sum")

    async def main() -> list[int]:
        busy = threading.Event()
        memo.model_pool.submit(busy.wait, 5)  # the one thread is taken: the work queues
        queued = asyncio.ensure_future(run_model_work(memo, _refresh_under_test, 21))
        await asyncio.sleep(0.2)
        busy.set()
        return [await queued, await run_model_work(memo, _refresh_under_test, 1)]

    assert asyncio.run(main()) == [42, 2]
    assert sample("count") - count0 == 2
    assert sample("sum") - sum0 >= 0.2  # the first waited for the busy thread


def test_status_work_runs_while_every_model_thread_is_busy() -> None:
    memo = kopf.Memo()
    memo.model_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    memo.status_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    count0 = sample("count", "status")

    async def main() -> int:
        busy = threading.Event()
        memo.model_pool.submit(busy.wait, 5)  # a long reconcile holds the model pool
        reconcile = asyncio.ensure_future(run_model_work(memo, _refresh_under_test, 1))
        try:
            return await asyncio.wait_for(run_status_work(memo, _refresh_under_test, 4), timeout=2)
        finally:
            busy.set()
            await reconcile

    assert asyncio.run(main()) == 8
    assert sample("count", "status") - count0 == 1
