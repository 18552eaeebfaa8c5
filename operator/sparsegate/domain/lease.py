"""Leader election over a coordination.k8s.io Lease: the pure decision part.

Kopf's peering pauses operators by priority but elects nobody (equal priorities all pause), so
HA replicas use a Lease with client-go's leaderelection semantics:

- A candidate never compares the holder's timestamps with its own wall clock (the two machines'
  clocks may disagree by hours). It remembers the last Lease record it *observed* and the local
  monotonic time at which that record last *changed*; another holder's Lease counts as expired
  only once ``monotonic_now - observed_at > leaseDurationSeconds``. A live leader changes the
  record at every renewal, so a standby keeps seeing fresh changes and keeps waiting.
- The leader gives up when it has not renewed within ``renew_deadline`` of the *start* of its
  last successful renewal. The API server stored that renewal after the request started, and a
  standby can only have seen it after that, so the standby waits at least ``lease_duration`` from
  a later instant: the leader stops ``lease_duration - renew_deadline`` seconds (5 s by default)
  before any standby may take over, as measured on each one's monotonic clock.

Durations default to controller-runtime's (15 s / 10 s / 2 s).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any, Mapping

MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"

LEASE_DURATION_S = 15
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 2.0
# Standbys retry after retry_period · U(1, JITTER_FACTOR) (client-go's wait.Jitter spreads them
# the same way); the leader must fit at least one jittered retry inside its renew deadline.
JITTER_FACTOR = 1.2


def format_time(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).strftime(MICROTIME)


def parse_time(s: str) -> datetime.datetime:
    s = s.rstrip("Z")
    fmt = "%Y-%m-%dT%H:%M:%S.%f" if "." in s else "%Y-%m-%dT%H:%M:%S"
    return datetime.datetime.strptime(s, fmt).replace(tzinfo=datetime.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Timing:
    """The three durations of an election; construction validates them (ValueError)."""

    lease_duration_s: int = LEASE_DURATION_S
    # How long the leader keeps acting without a successful renewal (from that renewal's start).
    renew_deadline_s: float = RENEW_DEADLINE_S
    # Pause between attempts, for the leader's renewals and the standbys' acquisitions.
    retry_period_s: float = RETRY_PERIOD_S

    def __post_init__(self) -> None:
        # Same rules as client-go's NewLeaderElector; a NaN passes every comparison, so first finite.
        if not all(math.isfinite(x) for x in (self.lease_duration_s, self.renew_deadline_s, self.retry_period_s)):
            raise ValueError(f"lease duration, renew deadline and retry period must be finite numbers, got "
                             f"{self.lease_duration_s}, {self.renew_deadline_s}, {self.retry_period_s}")
        if int(self.lease_duration_s) != self.lease_duration_s or self.lease_duration_s < 1:
            raise ValueError(f"lease duration must be a whole number of seconds >= 1 "
                             f"(Lease.spec.leaseDurationSeconds), got {self.lease_duration_s}")
        if self.retry_period_s <= 0 or self.renew_deadline_s <= 0:
            raise ValueError("renew deadline and retry period must be positive")
        if self.renew_deadline_s >= self.lease_duration_s:
            raise ValueError(f"renew deadline ({self.renew_deadline_s:g}s) must be shorter than the "
                             f"lease duration ({self.lease_duration_s}s)")
        if self.renew_deadline_s <= JITTER_FACTOR * self.retry_period_s:
            raise ValueError(f"renew deadline ({self.renew_deadline_s:g}s) must be longer than "
                             f"{JITTER_FACTOR:g} x retry period ({self.retry_period_s:g}s)")


@dataclasses.dataclass(frozen=True)
class Record:
    """The Lease fields an election reads; equality is "nothing changed" (resourceVersion too)."""

    holder: str | None
    lease_duration_s: int
    renew_time: str | None
    acquire_time: str | None
    transitions: int
    resource_version: str | None

    @classmethod
    def of(cls, lease: Mapping[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        return cls(holder=spec.get("holderIdentity") or None,
                   lease_duration_s=int(spec.get("leaseDurationSeconds") or 0),
                   renew_time=spec.get("renewTime"), acquire_time=spec.get("acquireTime"),
                   transitions=int(spec.get("leaseTransitions") or 0),
                   resource_version=(lease.get("metadata") or {}).get("resourceVersion"))


@dataclasses.dataclass(frozen=True)
class Observation:
    """What a candidate last saw of the Lease and when (local monotonic seconds) that changed."""

    record: Record | None  # None: no Lease object exists
    observed_at: float


def observe(previous: Observation | None, lease: Mapping[str, Any] | None, *,
            now: float) -> Observation:
    """The observation after reading ``lease`` at monotonic ``now``: the clock restarts only on change."""
    record = Record.of(lease) if lease is not None else None
    if previous is not None and previous.record == record:
        return previous
    return Observation(record=record, observed_at=now)


def may_acquire(observation: Observation, *, identity: str, now: float) -> bool:
    """True if ``identity`` may write the Lease: it is absent, free, ours, or unchanged for longer
    than its own leaseDurationSeconds on our monotonic clock (never by the holder's timestamps)."""
    record = observation.record
    if record is None or not record.holder or record.holder == identity:
        return True
    return now - observation.observed_at > record.lease_duration_s


def expires_in(observation: Observation, *, now: float) -> float:
    """Seconds until another holder's Lease counts as expired for us (0 if it already does)."""
    record = observation.record
    if record is None or not record.holder:
        return 0.0
    return max(0.0, observation.observed_at + record.lease_duration_s - now)


def renew_deadline(renewed_at: float, timing: Timing) -> float:
    """Monotonic instant by which the leader stops acting unless it renews again."""
    return renewed_at + timing.renew_deadline_s


def claimed(lease: Mapping[str, Any] | None, *, name: str, namespace: str, identity: str,
            duration_s: int, now: datetime.datetime) -> dict[str, Any]:
    """The Lease after ``identity`` claims or renews it (keeps resourceVersion for the PUT).

    The stamps are informational (no candidate here trusts them), but every renewal must change
    the record, or a standby would see nothing change and take over from a live leader: a
    renewTime equal to the current one (coarse or stepped-back clock) is moved on by 1 µs.
    """
    old = dict(lease or {})
    spec = dict(old.get("spec") or {})
    stamp = format_time(now)
    if stamp == spec.get("renewTime"):
        stamp = format_time(parse_time(stamp) + datetime.timedelta(microseconds=1))
    if spec.get("holderIdentity") != identity:
        spec["acquireTime"] = stamp
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if lease else 0)
    spec.update(holderIdentity=identity, leaseDurationSeconds=duration_s, renewTime=stamp)
    metadata = {"name": name, "namespace": namespace}
    if lease:
        metadata["resourceVersion"] = lease["metadata"]["resourceVersion"]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": spec}


def released(lease: Mapping[str, Any], *, now: datetime.datetime) -> dict[str, Any]:
    """The Lease handed back on a clean stop: no holder, so a standby may take it at once."""
    spec = {**(lease.get("spec") or {}), "holderIdentity": None, "leaseDurationSeconds": 1,
            "renewTime": format_time(now)}
    return {**lease, "spec": spec}
