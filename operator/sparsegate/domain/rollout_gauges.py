"""What the rollout gauges say about one GateConfig, read from its ``status`` (pure).

The operator exports rollout state as Prometheus gauges (``sparsegate.metrics``) derived from
the GateConfig's status exactly as it stands in the API server, so a dashboard shows over time
what ``kubectl get gateconfig`` shows now. Only fields the CRD documents are read
(``status.stable.version``; ``status.rollout`` ``phase``, ``step``, ``steps``, ``canaryPercent``,
``canaryVersion``, ``canaryInstances``, ``podVersions``; and ``instances``, the pod count the
rollout controller records at every check, read when no canary is in flight): the rollout
controller's private bookkeeping may change shape without touching this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Role:
    """Which side of a rollout a gate version is on (the ``role`` label)."""

    STABLE = "stable"
    # status.stable.version: what new pods start with.
    CANARY = "canary"
    # status.rollout.canaryVersion while it differs from stable.
    OTHER = "other"
    # A pod reporting neither (an older version, or one the operator could not read).


@dataclass(frozen=True)
class RolloutGauges:
    phase: str | None  # status.rollout.phase; None before the operator first wrote it
    step: int  # current step, 1-based; 0 when no canary is in flight
    steps: int  # number of steps in the spec (0 when not recorded)
    canary_percent: int  # percent of requests (strategy requests) or of instances (strategy instances) the current step targets; 0 without a canary
    canary_instances: int  # pods assigned the canary at this step (from "a/b"); 0 without a canary
    instances: int | None  # all instances at the last check ("a/b", else status.rollout.instances); None when not recorded
    versions: dict[str, str] = field(default_factory=dict)  # role -> gate version
    pods: dict[str, int] = field(default_factory=dict)  # role -> pods reporting that role's version


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _fraction(text: Any) -> tuple[int, int | None]:
    """``"4/20"`` -> (4, 20); anything else -> (0, None)."""
    if isinstance(text, str):
        a, sep, b = text.partition("/")
        if sep and a.strip().isdigit() and b.strip().isdigit():
            return int(a), int(b)
    return 0, None


def rollout_gauges(status: Mapping[str, Any] | None) -> RolloutGauges:
    status = status or {}
    ro = status.get("rollout") or {}
    stable = (status.get("stable") or {}).get("version")
    canary = ro.get("canaryVersion")
    versions: dict[str, str] = {}
    if isinstance(stable, str) and stable:
        versions[Role.STABLE] = stable
    in_flight = isinstance(canary, str) and bool(canary) and canary != stable
    if in_flight:
        versions[Role.CANARY] = canary
    by_version = {v: role for role, v in versions.items()}
    pods = {Role.STABLE: 0, Role.CANARY: 0, Role.OTHER: 0}
    # Under strategy requests a pod reports its set key, stable + canary at a weight
    # (sparsegate_contracts.canary.set_key): it holds the canary, so it counts as a canary pod.
    held = f"{stable}+{canary}@" if in_flight else None
    for version in (ro.get("podVersions") or {}).values():
        role = Role.CANARY if held and isinstance(version, str) and version.startswith(held) else \
            by_version.get(version, Role.OTHER)
        pods[role] += 1
    canary_instances, instances = _fraction(ro.get("canaryInstances"))
    if instances is None and isinstance(ro.get("instances"), int) and not isinstance(ro.get("instances"), bool):
        # At rest there is no canaryInstances: the count the controller records at every check.
        instances = ro["instances"]
    phase = ro.get("phase")
    return RolloutGauges(
        phase=phase if isinstance(phase, str) and phase else None,
        step=_int(ro.get("step")) if in_flight else 0,
        steps=_int(ro.get("steps")),
        canary_percent=_int(ro.get("canaryPercent")) if in_flight else 0,
        canary_instances=canary_instances if in_flight else 0,
        instances=instances,
        versions=versions,
        pods=pods,
    )
