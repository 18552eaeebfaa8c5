"""Leader election over a coordination.k8s.io Lease: the pure decision part.

Kopf's peering pauses operators by priority but elects nobody (equal priorities all pause), so
HA replicas use a Lease like client-go's leaderelection: whoever holds an unexpired Lease leads.
"""

from __future__ import annotations

import datetime
from typing import Any, Mapping

MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"


def format_time(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).strftime(MICROTIME)


def parse_time(s: str) -> datetime.datetime:
    s = s.rstrip("Z")
    fmt = "%Y-%m-%dT%H:%M:%S.%f" if "." in s else "%Y-%m-%dT%H:%M:%S"
    return datetime.datetime.strptime(s, fmt).replace(tzinfo=datetime.timezone.utc)


def can_acquire(lease: Mapping[str, Any], *, identity: str, now: datetime.datetime) -> bool:
    """True if ``identity`` holds the Lease or its holder let it expire."""
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if not holder or holder == identity:
        return True
    renewed = spec.get("renewTime") or spec.get("acquireTime")
    if not renewed:
        return True
    duration = int(spec.get("leaseDurationSeconds") or 0)
    return parse_time(renewed) + datetime.timedelta(seconds=duration) < now


def claimed(lease: Mapping[str, Any] | None, *, name: str, namespace: str, identity: str,
            duration_s: int, now: datetime.datetime) -> dict[str, Any]:
    """The Lease after ``identity`` claims or renews it (keeps resourceVersion for the PUT)."""
    old = dict(lease or {})
    spec = dict(old.get("spec") or {})
    stamp = format_time(now)
    if spec.get("holderIdentity") != identity:
        spec["acquireTime"] = stamp
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if lease else 0)
    spec.update(holderIdentity=identity, leaseDurationSeconds=duration_s, renewTime=stamp)
    metadata = {"name": name, "namespace": namespace}
    if lease:
        metadata["resourceVersion"] = lease["metadata"]["resourceVersion"]
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": spec}
