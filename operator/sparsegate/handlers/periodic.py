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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
Tick = Callable[[Mapping[str, Any]], Awaitable[None]]


@dataclasses.dataclass
class _Entry:
    body: Mapping[str, Any]
    tick: Tick
    logger: logging.Logger | logging.LoggerAdapter
    task: asyncio.Task[None] | None = None
    woken: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


def _gone(event_type: str | None, body: Mapping[str, Any]) -> bool:
    return event_type == "DELETED" or bool((body.get("metadata") or {}).get("deletionTimestamp"))


class ObjectLoops:
    """One asyncio task per live object, calling the latest ``tick`` every ``interval_s``."""

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
            self.discard(key)
            return False
        entry = self._entries.get(key)
        if entry is not None:
            entry.body, entry.tick, entry.logger = body, tick, logger
            return True
        entry = self._entries[key] = _Entry(body=body, tick=tick, logger=logger)
        entry.task = asyncio.create_task(self._run(key, entry), name=f"{self.kind} {key[0]}/{key[1]}")
        return True

    def discard(self, key: Key) -> None:
        """End the object's loop, if any, while the object lives on (it needs no periodic work now;
        its next ``seen`` starts one again)."""
        entry = self._entries.pop(key, None)
        if entry is not None and entry.task is not None:
            entry.task.cancel()

    def keys(self) -> list[Key]:
        return list(self._entries)

    def wake(self, keys: list[Key] | None = None) -> int:
        """Run these objects' next round now rather than at the end of their interval (None: every
        object's); returns how many loops were woken. A round in progress finishes first and the
        next one follows at once."""
        # By key, not by scanning every loop: a model pod's event wakes one model of thousands.
        entries = list(self._entries.values()) if keys is None else \
            [e for e in map(self._entries.get, dict.fromkeys(keys)) if e is not None]
        for entry in entries:
            entry.woken.set()
        return len(entries)

    async def _run(self, key: Key, entry: _Entry) -> None:
        await asyncio.sleep(self.initial_delay_s)
        while self._entries.get(key) is entry:
            entry.woken.clear()
            try:
                await entry.tick(entry.body)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 (one bad round must not end the object's loop)
                entry.logger.exception("periodic %s work for %s/%s failed; next round in %.1fs",
                                       self.kind, key[0], key[1], self.interval_s)
            try:
                await asyncio.wait_for(entry.woken.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> None:
        """Cancel every loop and wait for them (operator shutdown)."""
        tasks = [e.task for e in self._entries.values() if e.task is not None]
        self._entries.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
