"""handlers.sparsemodel.finish_service: the Kopf handler's wait for a model's Service apply
(``modelsync.PendingService``) holds no thread, and a second status write runs in the status pool,
never on the event loop, only when the apply ended otherwise than the reconcile assumed or a write
held Ready back for it meanwhile; a failed apply fails the handler."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import kopf
import pytest

from sparsegate.clients.kube import KubeError
from sparsegate.handlers import modelsync
from sparsegate.handlers.sparsemodel import finish_service


def pending(*, assumed: str | None, held: bool,
            writes: list[tuple[str | None, bool]]) -> tuple[modelsync.PendingService, concurrent.futures.Future]:
    future: concurrent.futures.Future[str | None] = concurrent.futures.Future()
    taken = [held]

    def take() -> bool:
        was, taken[0] = taken[0], False
        return was

    def rewrite(service_error: str | None) -> None:
        writes.append((service_error, threading.current_thread() is threading.main_thread()))
    return modelsync.PendingService(future, assumed, rewrite, take), future


def memo() -> kopf.Memo:
    m = kopf.Memo()
    m.status_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    return m


@pytest.mark.parametrize(("error", "assumed", "held", "written"), [
    (None, None, False, []),  # landed as assumed: nothing more to write
    (None, None, True, [None]),  # Ready was held back meanwhile: written again now that it landed
    (None, "refused", False, [None]),  # the last one had failed, this one landed: cleared
    ("refused", None, False, ["refused"]),  # failed where success was assumed: reported
    ("refused", "refused", False, []),  # failed again: status already says so
])
def test_a_second_write_only_when_the_outcome_or_a_hold_asks_for_it_and_never_on_the_loop(
        error: str | None, assumed: str | None, held: bool, written: list[str | None]) -> None:
    writes: list[tuple[str | None, bool]] = []
    service, future = pending(assumed=assumed, held=held, writes=writes)

    async def main() -> None:
        waiting = asyncio.ensure_future(finish_service(memo(), service))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # waits for the apply without blocking the loop
        future.set_result(error)
        await waiting

    if error is None:
        asyncio.run(main())
    else:
        with pytest.raises(KubeError, match="ApplyFailed"):
            asyncio.run(main())
    assert [e for e, _ in writes] == written
    assert not any(on_loop for _, on_loop in writes)  # the loop runs in the main thread here
