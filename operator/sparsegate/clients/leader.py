"""Lease-based leader election around the Kopf operator (decisions in domain.lease).

Two operators must never act at once. The leader therefore:

- gives every election request a timeout no longer than the time left before its renew
  deadline (urllib3 may still retry a broken connection inside one call, which is why the
  deadline is enforced by the watchdog below, not by the requests);
- treats *any* exception of an attempt (API error, refused or reset connection, timeout, TLS
  error, a bug) as one failed attempt: the renewer thread logs it and tries again, it never dies;
- runs a separate watchdog thread that wakes at the deadline, so a request hung in a socket
  cannot delay the decision: without a renewal started within ``renew_deadline`` of the last
  successful one, or as soon as the Lease names another holder, the process logs the loss and
  leaves with ``os._exit`` (like controller-runtime's exit on "leader election lost"). A hard
  exit, not a signal: Kopf's graceful stop would let in-flight handlers keep writing while a
  standby takes over. The pod's container restarts and the new process waits as a standby.

A clean stop (SIGTERM → Kopf returns) keeps renewing until Kopf has finished, then stops the
threads and hands the Lease back, so a standby leads at once.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import sys
import threading
import time
from typing import Any, Callable

from sparsegate.clients.kube import REQUEST_TIMEOUT_S, Conflict, Kube, NotFound, path_for
from sparsegate.domain import lease

logger = logging.getLogger(__name__)

# Exit status after losing the Lease (controller-runtime exits 1 too); the pod restarts as a standby.
LOST_EXIT_CODE = 1
# Longest a loss waits for its log line to be written before the process ends anyway.
EXIT_BACKSTOP_S = 1.0
# Below this much time left a request is not worth starting: it would be cut short anyway.
MIN_REQUEST_S = 0.05


class DeadlineReached(Exception):
    """No time is left for another attempt before the renew deadline."""


def _now_utc() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _hard_exit(code: int) -> None:
    # Flush what the loss logged: os._exit skips every atexit hook and buffer flush.
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 (nothing may stop the exit)
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


class LeaderElector:
    """acquire() blocks until leading; keep() guards the leadership; release() hands it back.

    ``clock`` (monotonic seconds), ``wall`` (only for the Lease's informational stamps) and
    ``exit`` are injectable for tests; ``exit`` must not return in production (os._exit).
    """

    def __init__(self, kube: Kube, *, name: str, namespace: str, identity: str,
                 timing: lease.Timing | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime.datetime] = _now_utc,
                 exit: Callable[[int], None] = _hard_exit) -> None:
        self.kube, self.name, self.namespace, self.identity = kube, name, namespace, identity
        self.timing = timing or lease.Timing()
        self._clock, self._wall, self._exit = clock, wall, exit
        self.observation: lease.Observation | None = None
        # Monotonic start of the last successful acquire/renew request (None: not leading).
        self.renewed_at: float | None = None
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- one attempt (synchronous; the threads below loop over these) ----------------------

    def _timeout(self, until: float | None) -> float:
        if until is None:
            return min(REQUEST_TIMEOUT_S, self.timing.renew_deadline_s)
        left = until - self._clock()
        if left < MIN_REQUEST_S:
            raise DeadlineReached(f"renew deadline passed {-left:.2f}s ago" if left < 0 else
                                  "renew deadline too close for another request")
        return min(REQUEST_TIMEOUT_S, left)

    def _read(self, until: float | None) -> dict[str, Any] | None:
        try:
            return self.kube.request("GET", path_for("Lease", namespace=self.namespace, name=self.name),
                                     timeout=self._timeout(until))
        except NotFound:
            return None

    def try_acquire_or_renew(self, *, until: float | None = None) -> bool:
        """One attempt: True if we hold the Lease after it, False if another holder keeps it.

        ``until`` (monotonic) bounds each request's timeout; None for a standby (no deadline).
        Raises whatever the requests raise; a 409 (someone wrote in between) is a plain False.
        """
        started = self._clock()
        current = self._read(until)
        self.observation = lease.observe(self.observation, current, now=self._clock())
        if not lease.may_acquire(self.observation, identity=self.identity, now=self._clock()):
            return False
        body = lease.claimed(current, name=self.name, namespace=self.namespace, identity=self.identity,
                             duration_s=int(self.timing.lease_duration_s), now=self._wall())
        path = path_for("Lease", namespace=self.namespace,
                        name=self.name if current is not None else None)
        try:
            written = self.kube.request("PUT" if current is not None else "POST", path, body=body,
                                        timeout=self._timeout(until))
        except Conflict:
            return False
        # Our own write is a change we observed; the deadline counts from the request's start
        # (the API server stored it later, and standbys can only have seen it later still).
        self.observation = lease.observe(self.observation, written, now=self._clock())
        self.renewed_at = started
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Block until leading (True) or ``stop`` is set (False)."""
        holder_seen: str | None = None
        while not stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    logger.info("leading as %s (Lease %s/%s)", self.identity, self.namespace, self.name)
                    return True
                record = self.observation.record if self.observation else None
                if record is not None and record.holder != holder_seen:
                    holder_seen = record.holder
                    logger.info("standing by: Lease %s/%s held by %s (ours once unchanged for %ss)",
                                self.namespace, self.name, holder_seen, record.lease_duration_s)
            except Exception as e:  # noqa: BLE001 (a standby just retries)
                logger.warning("leader election: %s: %s", type(e).__name__, e)
            stop.wait(self.timing.retry_period_s * random.uniform(1.0, lease.JITTER_FACTOR))
        return False

    def deadline(self) -> float:
        assert self.renewed_at is not None, "deadline() before acquire()"
        return lease.renew_deadline(self.renewed_at, self.timing)

    def renew_once(self) -> bool:
        """One renewal; False means leadership is lost (another holder, or the deadline passed).

        Every exception of the attempt is logged and counts as a failed attempt: only the
        deadline decides, so a failure the code did not foresee cannot end renewal silently.
        """
        deadline = self.deadline()
        try:
            if self.try_acquire_or_renew(until=deadline):
                return True
            record = self.observation.record if self.observation else None
            if record is not None and record.holder and record.holder != self.identity:
                self.lose(f"the Lease is held by {record.holder!r}")
                return False
            # A 409: the Lease changed between our read and write; the next read tells by whom.
            logger.warning("leader renewal conflicted (%.1fs left before the renew deadline)",
                           deadline - self._clock())
        except Exception as e:  # noqa: BLE001 (see docstring)
            logger.warning("leader renewal failed (%.1fs left before the renew deadline): %s: %s",
                           deadline - self._clock(), type(e).__name__, e)
        if self._clock() >= self.deadline():
            self.lose(f"no renewal within the renew deadline ({self.timing.renew_deadline_s:g}s)")
            return False
        return True

    def check_deadline(self) -> bool:
        """The watchdog's test: False (and lose()) once the renew deadline has passed."""
        if self._clock() >= self.deadline():
            self.lose(f"no renewal within the renew deadline ({self.timing.renew_deadline_s:g}s)")
            return False
        return True

    def lose(self, reason: str) -> None:
        """Leadership is over: stop acting now (hard exit), unless a clean stop already began."""
        if self._lost.is_set():
            return
        self._lost.set()
        if self._exit is _hard_exit:
            # Logging can block (a stalled stderr pipe holds its handler's lock): exit regardless.
            backstop = threading.Timer(EXIT_BACKSTOP_S, os._exit, args=(LOST_EXIT_CODE,))
            backstop.daemon = True
            backstop.start()
        logger.error("leader election lost (%s): exiting at once so nothing more is written", reason)
        self._exit(LOST_EXIT_CODE)

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    # -- the guard threads ------------------------------------------------------------------

    def keep(self) -> None:
        """Start the renewer and the deadline watchdog (daemon threads)."""
        assert self.renewed_at is not None, "keep() before acquire()"

        def renewer() -> None:
            while not self._stop.wait(self.timing.retry_period_s):
                try:
                    if not self.renew_once():
                        return
                except BaseException as e:  # noqa: BLE001 (never die silently; the watchdog decides)
                    logger.exception("lease renewer: unexpected %s", type(e).__name__)

        def watchdog() -> None:
            while True:
                # Wake at the deadline (renewals move it on; re-read it after each wake).
                if self._stop.wait(max(0.0, self.deadline() - self._clock())):
                    return
                if not self.check_deadline():
                    return

        self._threads = [threading.Thread(target=renewer, name="lease-renewer", daemon=True),
                         threading.Thread(target=watchdog, name="lease-watchdog", daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop renewing (a clean shutdown, before release()); waits for an in-flight attempt."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timing.renew_deadline_s)

    def release(self) -> None:
        """Hand the Lease over at once on a clean exit (standbys need not wait for expiry).

        Only while still inside the renew deadline: past it a standby may already lead.
        """
        if self.renewed_at is None or self._lost.is_set():
            return
        try:
            current = self._read(self.deadline())
            if current and (current.get("spec") or {}).get("holderIdentity") == self.identity:
                self.kube.request("PUT", path_for("Lease", namespace=self.namespace, name=self.name),
                                  body=lease.released(current, now=self._wall()),
                                  timeout=self._timeout(self.deadline()))
                logger.info("released the Lease %s/%s", self.namespace, self.name)
        except Exception as e:  # noqa: BLE001 (the Lease then expires on its own)
            logger.warning("could not release the Lease: %s: %s", type(e).__name__, e)
