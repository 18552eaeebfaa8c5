"""Lease-based leader election around the Kopf operator (decisions in domain.lease)."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading

from sparsegate.clients.kube import Conflict, Kube, KubeError
from sparsegate.domain import lease

logger = logging.getLogger(__name__)


class LeaderElector:
    def __init__(self, kube: Kube, *, name: str, namespace: str, identity: str,
                 duration_s: int = 15) -> None:
        self.kube, self.name, self.namespace = kube, name, namespace
        self.identity, self.duration_s = identity, duration_s

    def _try(self) -> bool:
        now = datetime.datetime.now(datetime.timezone.utc)
        current = self.kube.get("Lease", namespace=self.namespace, name=self.name)
        if current is not None and not lease.can_acquire(current, identity=self.identity, now=now):
            return False
        body = lease.claimed(current, name=self.name, namespace=self.namespace,
                             identity=self.identity, duration_s=self.duration_s, now=now)
        try:
            (self.kube.replace if current else self.kube.create)(body)
        except Conflict:
            return False
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Block until leading (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            try:
                if self._try():
                    logger.info("leading as %s (Lease %s/%s)", self.identity, self.namespace, self.name)
                    return True
            except KubeError as e:
                logger.warning("leader election: %s", e)
            stop.wait(self.duration_s / 3)
        return False

    def keep(self, lost: threading.Event) -> threading.Thread:
        """Renew in the background; on loss set ``lost`` and SIGTERM this process.

        A signal, not Kopf's ``stop_flag``: Kopf waits on a threading flag in an executor thread
        that nothing wakes on a normal SIGTERM, which would block shutdown forever.
        """
        def run() -> None:
            deadline = datetime.datetime.now(datetime.timezone.utc) + \
                datetime.timedelta(seconds=self.duration_s)
            while not lost.is_set():
                lost.wait(self.duration_s / 3)
                try:
                    if self._try():
                        deadline = datetime.datetime.now(datetime.timezone.utc) + \
                            datetime.timedelta(seconds=self.duration_s)
                        continue
                    logger.error("lost the leader Lease to another holder")
                    lost.set()
                except KubeError as e:
                    logger.warning("leader renewal failed: %s", e)
                    if datetime.datetime.now(datetime.timezone.utc) >= deadline:
                        lost.set()
            os.kill(os.getpid(), signal.SIGTERM)  # Kopf stops gracefully; the pod restarts
        thread = threading.Thread(target=run, name="lease-renewer", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Hand the Lease over at once on a clean exit (standbys need not wait for expiry)."""
        try:
            current = self.kube.get("Lease", namespace=self.namespace, name=self.name)
            if current and (current.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {**current["spec"], "holderIdentity": None, "leaseDurationSeconds": 1}
                self.kube.replace({**current, "spec": spec})
        except KubeError as e:
            logger.warning("could not release the Lease: %s", e)
