"""Periodic work per object, without a finalizer.

Kopf timers and daemons make Kopf put its finalizer on every object they serve, so deleting a
GateConfig or a RoutingPolicy hung for as long as the operator was down. Nothing we do needs to
happen *before* such an object goes (the rollout state lives in the object itself; the allow-list
is narrowed after a policy is gone, by the operator and by the agents), so the periodic work is
driven by watch events instead: an object's first event starts its loop, its DELETED event (or a
deletionTimestamp) cancels it, and each event hands the loop the latest body.

`kopf.on.event` handlers run only after Kopf has populated every index, as timers do, and they
also see the initial listing, so a restarted operator resumes every loop. Kopf removes the
finalizer left on objects by earlier operator versions once no handler requires it.

A round may say when the next one is needed (its tick returns seconds; None: ``interval_s``): a
resting GateConfig sleeps until its safety-net check instead of waking every interval to find
nothing to do (2,000 of them at a 1 s tick were a fifth of the operator's CPU samples). An event
of the object, or :meth:`ObjectLoops.nudge`, brings its next round within ``interval_s`` again;
:meth:`ObjectLoops.wake` runs it at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
# A round: the object's latest body → seconds until the next round is needed (None: the interval).
Tick = Callable[[Mapping[str, Any]], Awaitable[float | None]]


@dataclasses.dataclass
class _Entry:
    body: Mapping[str, Any]
    tick: Tick
    logger: logging.Logger | logging.LoggerAdapter
    task: asyncio.Task[None] | None = None
    due: float = math.inf  # event-loop time of the next round (inf while a round runs)
    woken: bool = False  # run the next round at once
    signal: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # `due` or `woken` moved
    failing: str | None = None  # the error the last round failed with (None: it did not fail)


def _gone(event_type: str | None, body: Mapping[str, Any]) -> bool:
    return event_type == "DELETED" or bool((body.get("metadata") or {}).get("deletionTimestamp"))


def _uid(body: Mapping[str, Any]) -> str | None:
    return (body.get("metadata") or {}).get("uid")


class ObjectLoops:
    """One asyncio task per live object, calling the latest ``tick`` every ``interval_s`` (or
    later, when a round says so)."""

    def __init__(self, *, kind: str, interval_s: float, initial_delay_s: float = 0.0) -> None:
        self.kind = kind
        self.interval_s = interval_s
        self.initial_delay_s = initial_delay_s
        self._entries: dict[Key, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def seen(self, *, key: Key, event_type: str | None, body: Mapping[str, Any], tick: Tick,
             logger: logging.Logger | logging.LoggerAdapter = log) -> bool:
        """Record an event; returns True while the object's loop runs (False: it is gone).

        Must be called from the event loop (Kopf's async handlers are).
        """
        if _gone(event_type, body):
            entry = self._entries.get(key)
            if entry is not None and _uid(entry.body) not in (None, _uid(body)):
                # Another object of the name (deleted and created again): Kopf queues events per
                # uid, so the old one's DELETED can come after the new one's first event, and
                # must not end the new one's loop (nothing else would start it again).
                return False
            self.discard(key)
            return False
        entry = self._entries.get(key)
        if entry is not None:
            entry.body, entry.tick, entry.logger = body, tick, logger
            self._soon(entry)
            return True
        entry = self._entries[key] = _Entry(body=body, tick=tick, logger=logger)
        entry.task = asyncio.create_task(self._run(key, entry), name=f"{self.kind} {key[0]}/{key[1]}")
        return True

    def discard(self, key: Key, *, uid: str | None = None) -> None:
        """End the object's loop, if any, while the object lives on (it needs no periodic work now;
        its next ``seen`` starts one again). ``uid``: only if the loop is that object's (a late
        event of an earlier object of the name must not end a re-created one's loop)."""
        entry = self._entries.get(key)
        if entry is None or (uid is not None and _uid(entry.body) not in (None, uid)):
            return
        del self._entries[key]
        if entry.task is not None:
            entry.task.cancel()

    def keys(self) -> list[Key]:
        return list(self._entries)

    def wake(self, keys: list[Key] | None = None) -> int:
        """Run these objects' next round now rather than at the end of their interval (None: every
        object's); returns how many loops were woken. A round in progress finishes first and the
        next one follows at once."""
        entries = list(self._entries.values()) if keys is None else self._live(keys)
        for entry in entries:
            entry.woken = True
            entry.signal.set()
        return len(entries)

    def nudge(self, keys: list[Key]) -> int:
        """Run these objects' next round within ``interval_s`` (sooner if it was due sooner): unlike
        :meth:`wake`, a burst of nudges costs an object at most one round per interval. Returns how
        many loops were nudged."""
        entries = self._live(keys)
        for entry in entries:
            self._soon(entry)
        return len(entries)

    def _live(self, keys: list[Key]) -> list[_Entry]:
        # By key, not by scanning every loop: a model pod's event wakes one model of thousands.
        return [e for e in map(self._entries.get, dict.fromkeys(keys)) if e is not None]

    def _soon(self, entry: _Entry) -> None:
        due = asyncio.get_running_loop().time() + self.interval_s
        if due < entry.due:  # a round in progress (due inf) takes it as its next round's bound
            entry.due = due
            entry.signal.set()

    async def _run(self, key: Key, entry: _Entry) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.initial_delay_s)
        while self._entries.get(key) is entry:
            entry.woken, entry.due = False, math.inf
            after: float | None = None
            try:
                after = await entry.tick(entry.body)
                entry.failing = None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 (one bad round must not end the object's loop)
                # A failure that persists (the API server or OPA down) fails every round: logged with
                # its traceback when it starts or changes, the same one again at DEBUG only.
                error = f"{type(e).__name__}: {e}"
                if entry.failing == error:
                    entry.logger.debug("periodic %s work for %s/%s failed again (%s); next round in %.1fs",
                                       self.kind, key[0], key[1], error, self.interval_s)
                else:
                    entry.logger.exception("periodic %s work for %s/%s failed; next round in %.1fs",
                                           self.kind, key[0], key[1], self.interval_s)
                entry.failing = error
            wait = self.interval_s if after is None else max(0.0, after)
            entry.due = min(entry.due, loop.time() + wait)  # an event during the round may have set it
            await self._until_due(entry, loop)

    @staticmethod
    async def _until_due(entry: _Entry, loop: asyncio.AbstractEventLoop) -> None:
        # One timer handle per wait, no task (asyncio.wait_for made one per round per object).
        while not entry.woken and entry.due - loop.time() > 0.001:
            entry.signal.clear()
            timer = loop.call_at(entry.due, entry.signal.set)
            try:
                await entry.signal.wait()
            finally:
                timer.cancel()

    async def stop(self) -> None:
        """Cancel every loop and wait for them (operator shutdown)."""
        tasks = [e.task for e in self._entries.values() if e.task is not None]
        self._entries.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Retries:
    """One-off syncs Kopf will not retry, tried again in the background until one succeeds: an event
    handler's (Kopf never retries those), and a deleted object's above all, which sends no later event
    to try again from. One task per key (a key already retrying keeps its task: each attempt reads
    the state as it is then); :meth:`stop`, from the operator's cleanup, cancels them."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._tasks: dict[Hashable, asyncio.Task[None]] = {}

    def start(self, key: Hashable, attempt: Callable[[], Awaitable[bool]], *, delay_s: float,
              max_delay_s: float | None = None) -> None:
        """Run ``attempt`` after ``delay_s``, and again after each failure (False or an exception,
        logged), the delay doubling up to ``max_delay_s`` (None: constant), until it returns True."""
        task = self._tasks.get(key)
        if task is None or task.done():
            self._tasks[key] = asyncio.create_task(
                self._run(key, attempt, delay_s=delay_s, max_delay_s=max_delay_s), name=f"{self.what} retry {key}")

    async def _run(self, key: Hashable, attempt: Callable[[], Awaitable[bool]], *, delay_s: float,
                   max_delay_s: float | None) -> None:
        delay = delay_s
        try:
            while True:
                await asyncio.sleep(delay)
                try:
                    if await attempt():
                        return
                except Exception:  # noqa: BLE001 (still failing, e.g. the API server: next delay)
                    log.warning("%s %s failed again; retrying", self.what, key, exc_info=True)
                if max_delay_s is not None:
                    delay = min(delay * 2, max_delay_s)
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]

    def pending(self) -> list[Hashable]:
        return [k for k, t in self._tasks.items() if not t.done()]

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
