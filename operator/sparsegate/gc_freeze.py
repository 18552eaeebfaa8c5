"""Keep the operator's long-lived objects out of Python's full garbage collections.

Most of the operator's heap lives as long as the objects it watches: Kopf's per-object records,
the fleet indexes' views, the status inputs (about 850,000 tracked objects at 10,000 models). A
full (generation 2) collection walks all of it while every thread waits for the GIL: at 1,000
models ``bench_scale.py`` measured 35 full collections during the create burst (6.9 s in all, p99
0.49 s) and 6 in the 20-second steady phase (1.25 s), each stalling every reconcile in flight.

``gc.freeze()`` moves every object alive at that moment into a permanent generation that
collections skip (a constant-time list splice). Done every ``freeze_s``, a full collection walks
only what was allocated since the last freeze. The price: a reference cycle frozen while alive is
not reclaimed when it later becomes garbage (acyclic objects still are, by reference counting).
So every ``refresh_s`` everything frozen is unfrozen, collected once (one full pause) and frozen
again, which bounds such leftovers to what one interval leaves.

``set_young_threshold`` (``--gc-young-threshold``) sets how many net container allocations start a
young collection; the default stays Python's 700 (a larger one trades memory held by garbage
cycles for fewer collections: see ``sparsegate run --help``).
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from typing import Callable, Literal

import prometheus_client

logger = logging.getLogger(__name__)

FROZEN = prometheus_client.Gauge(
    "sparsegate_operator_gc_frozen_objects",
    "Objects in Python's permanent generation (skipped by garbage collections) after the last freeze.")

Action = Literal["freeze", "refresh"]


def check_intervals(freeze_s: float, refresh_s: float) -> None:
    """ValueError unless the freeze interval is 0 (off) or positive and at most the refresh interval."""
    if not (math.isfinite(freeze_s) and math.isfinite(refresh_s)):
        raise ValueError(f"the freeze and refresh intervals must be finite numbers, not {freeze_s}, {refresh_s}")
    if freeze_s < 0:
        raise ValueError(f"the freeze interval must be 0 (off) or positive, not {freeze_s}")
    if freeze_s and refresh_s < freeze_s:
        raise ValueError(f"the refresh interval ({refresh_s}) must be at least the freeze interval ({freeze_s})")


class FreezeSchedule:
    """Which action is due at ``now`` (seconds on a monotonic clock); a refresh restarts both timers."""

    def __init__(self, *, freeze_s: float, refresh_s: float, now: float) -> None:
        check_intervals(freeze_s, refresh_s)
        if freeze_s == 0:
            raise ValueError("a freeze schedule needs a positive freeze interval (0 is off: start nothing)")
        self.freeze_s, self.refresh_s = freeze_s, refresh_s
        self.next_freeze, self.next_refresh = now + freeze_s, now + refresh_s

    def due(self, now: float) -> Action | None:
        if now >= self.next_refresh:
            self.next_refresh, self.next_freeze = now + self.refresh_s, now + self.freeze_s
            return "refresh"
        if now >= self.next_freeze:
            self.next_freeze = now + self.freeze_s
            return "freeze"
        return None


def set_young_threshold(threshold0: int) -> None:
    """Collect generation 0 after ``threshold0`` net container allocations (Python's default: 700);
    the older generations' thresholds stay as they are."""
    if threshold0 < 1:
        raise ValueError(f"the young-generation threshold must be at least 1, not {threshold0}")
    _, threshold1, threshold2 = gc.get_threshold()
    gc.set_threshold(threshold0, threshold1, threshold2)


def act(action: Action) -> None:
    if action == "refresh":
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    FROZEN.set(gc.get_freeze_count())


def start(*, freeze_s: float, refresh_s: float,
          clock: Callable[[], float] = time.monotonic) -> threading.Thread | None:
    """A daemon thread that freezes every ``freeze_s`` and refreshes every ``refresh_s``; None
    (nothing started) when ``freeze_s`` is 0."""
    if freeze_s == 0:
        return None
    schedule = FreezeSchedule(freeze_s=freeze_s, refresh_s=refresh_s, now=clock())

    def run() -> None:
        while True:
            time.sleep(max(0.05, min(schedule.next_freeze, schedule.next_refresh) - clock()))
            action = schedule.due(clock())
            if action is not None:
                act(action)

    thread = threading.Thread(target=run, name="sparsegate-gc-freeze", daemon=True)
    thread.start()
    logger.info("freezing long-lived objects out of garbage collection every %gs (full refresh every %gs)",
                freeze_s, refresh_s)
    return thread
