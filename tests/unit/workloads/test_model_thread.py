"""The model thread counts the calls queued behind the running one: what lets a generation job
run several decode steps and still end at a step boundary when another model call waits."""

import concurrent.futures
import threading

from sparsegate_workload.model_thread import ModelThread


def test_queued_counts_submitted_calls_not_yet_started():
    release = threading.Event()
    running = threading.Event()
    seen: list[int] = []
    with ModelThread() as thread:
        assert thread.queued == 0
        first = thread.submit(lambda: (running.set(), release.wait(5)))
        running.wait(5)
        assert thread.queued == 0  # the running call is not queued
        later = [thread.submit(lambda: seen.append(thread.queued)) for _ in range(3)]
        assert thread.queued == 3
        release.set()
        concurrent.futures.wait([first, *later], timeout=5)
    assert seen == [2, 1, 0]  # each call, once started, no longer counts itself
    assert thread.queued == 0
    assert all(f.result() is None for f in later)


def test_a_call_cancelled_before_it_starts_is_counted_out():
    release = threading.Event()
    running = threading.Event()
    with ModelThread() as thread:
        thread.submit(lambda: (running.set(), release.wait(5)))
        running.wait(5)
        doomed = thread.submit(lambda: None)
        assert thread.queued == 1 and doomed.cancel()
        assert thread.queued == 0
        release.set()


def test_a_failing_call_raises_to_its_caller_and_is_counted_out():
    with ModelThread() as thread:
        future = thread.submit(lambda: 1 / 0)
        assert isinstance(future.exception(timeout=5), ZeroDivisionError)
        assert thread.queued == 0


def test_busy_for_is_how_long_the_running_call_has_run():
    release = threading.Event()
    running = threading.Event()
    with ModelThread() as thread:
        assert thread.busy_for == 0.0
        done = thread.submit(lambda: (running.set(), release.wait(5)))
        running.wait(5)
        first = thread.busy_for
        release.wait(0.05)
        assert 0.0 < first < thread.busy_for  # grows while the call runs
        release.set()
        done.result(timeout=5)
        assert thread.busy_for == 0.0
