"""controllers.deferred_refresh (one deferred refresh per model at a time, reading the newest state)
and domain.model_status.workload_settled (which Deployment events are deferred)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from sparsegate.controllers.deferred_refresh import DeferredRefreshes
from sparsegate.domain.model_status import workload_settled

DELAY = 0.05


def deployment(*, generation: int = 1, observed: int | None = 1, replicas: int = 2, ready: int = 2,
               updated: int = 2, spec_replicas: int | None = 2) -> dict:
    status = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated}
    if observed is not None:
        status["observedGeneration"] = observed
    body = {"metadata": {"generation": generation}, "status": status}
    if spec_replicas is not None:
        body["spec"] = {"replicas": spec_replicas}
    return body


@pytest.mark.parametrize(("body", "settled"), [
    (deployment(), True),
    (deployment(replicas=0, ready=0, updated=0, spec_replicas=0), True),  # scaled to zero
    (deployment(spec_replicas=None), True),  # a view without the spec: the counts alone
    (None, True),  # gone: nothing left to wait for
    ({"metadata": {"generation": 1}}, False),  # created, the controller has not looked yet
    (deployment(observed=None), False),
    (deployment(generation=2, observed=1), False),  # a spec change not observed yet
    (deployment(ready=0), False),
    (deployment(ready=1), False),
    (deployment(replicas=3, ready=2, updated=2), False),  # an old pod still terminating
    (deployment(updated=1), False),  # a rollout half way
    # Observed, but the ReplicaSet has not moved yet: no pods at creation, 2 of a new 3 when scaled.
    (deployment(replicas=0, ready=0, updated=0), False),
    (deployment(generation=2, observed=2, spec_replicas=3), False),
    (deployment(generation=2, observed=2, replicas=3, ready=3, updated=3, spec_replicas=3), True),
    (deployment(generation=2, observed=2, replicas=3, ready=3, updated=3, spec_replicas=2), False),  # scaling down
])
def test_workload_settled(body, settled):
    assert workload_settled(body) is settled


async def test_events_while_a_refresh_waits_join_it_and_it_reads_the_state_of_its_run():
    refreshes = DeferredRefreshes(delay_s=DELAY)
    state = {"ready": 0}
    seen: list[int] = []

    async def refresh() -> None:
        seen.append(state["ready"])

    assert refreshes.defer(("ns", "m"), refresh) is True
    state["ready"] = 1
    assert refreshes.defer(("ns", "m"), refresh) is False  # joins the waiting one
    assert refreshes.defer(("ns", "other"), refresh) is True  # another model: its own
    state["ready"] = 2
    assert refreshes.waiting() == 2
    await asyncio.sleep(DELAY * 4)
    assert seen == [2, 2]  # one per model, each reading the newest state
    assert refreshes.waiting() == 0


async def test_an_event_after_the_refresh_started_schedules_another():
    refreshes = DeferredRefreshes(delay_s=DELAY)
    started, release = asyncio.Event(), asyncio.Event()
    runs = []

    async def slow_refresh() -> None:
        runs.append("slow")
        started.set()
        await release.wait()

    async def refresh() -> None:
        runs.append("next")

    refreshes.defer("m", slow_refresh)
    await asyncio.wait_for(started.wait(), 1)
    # The first refresh has read its inputs: an event now must not be folded into it.
    assert refreshes.defer("m", refresh) is True
    release.set()
    await asyncio.sleep(DELAY * 4)
    assert runs == ["slow", "next"]


async def test_a_failing_refresh_is_logged_and_releases_its_model(caplog):
    refreshes = DeferredRefreshes(delay_s=DELAY)

    async def broken() -> None:
        raise RuntimeError("API server said no")

    with caplog.at_level(logging.ERROR):
        refreshes.defer("m", broken)
        await asyncio.sleep(DELAY * 4)
    assert "deferred status refresh of m failed" in caplog.text
    assert "API server said no" in caplog.text
    ran = []

    async def refresh() -> None:
        ran.append(True)

    assert refreshes.defer("m", refresh) is True
    await asyncio.sleep(DELAY * 4)
    assert ran == [True]


async def test_close_cancels_what_waits():
    refreshes = DeferredRefreshes(delay_s=10.0)
    ran = []

    async def refresh() -> None:
        ran.append(True)

    refreshes.defer("a", refresh)
    refreshes.defer("b", refresh)
    await asyncio.wait_for(refreshes.close(), 1)
    assert ran == [] and refreshes.waiting() == 0
