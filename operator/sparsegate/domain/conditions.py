"""SparseModel status conditions, derived (never stored twice) from what the operator observed.

Three condition types follow the Kubernetes convention (a list keyed by ``type``):
Ready, Progressing and Degraded; two more, Reconciling and Stalled, restate them in the terms
kstatus (sigs.k8s.io/cli-utils, used by Flux and kpt) reads, so their health checks need no
configuration. Each is a pure function of the Deployment's status and the last reconcile's result;
``set_conditions`` keeps ``lastTransitionTime`` stable across writes.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterable, Mapping, Sequence


class ConditionType(str, enum.Enum):
    READY = "Ready"
    """All desired instances are up and serve the resolved gate."""
    PROGRESSING = "Progressing"
    """The Deployment is rolling out or scaling toward the desired instances."""
    DEGRADED = "Degraded"
    """The operator cannot render the model as asked (missing or invalid gate, apply failure)."""
    RECONCILING = "Reconciling"
    """kstatus: True while the model is not Ready and not Stalled (instances starting, rolling)."""
    STALLED = "Stalled"
    """kstatus: True while Degraded is True: nothing moves until the spec or its GateConfig changes."""


class Reason(str, enum.Enum):
    ALL_REPLICAS_READY = "AllReplicasReady"
    """Ready=True: every desired instance is ready and updated."""
    SCALED_TO_ZERO = "ScaledToZero"
    """Ready=True: zero instances were asked for and none run."""
    REPLICAS_NOT_READY = "ReplicasNotReady"
    """Ready=False or Progressing=True: fewer ready/updated instances than desired."""
    DEPLOYMENT_MISSING = "DeploymentMissing"
    """Ready=False: the Deployment has not been created (yet)."""
    GATE_UNAVAILABLE = "GateUnavailable"
    """Ready=False: no usable gate, so nothing was rendered for this generation."""
    CONTAINERS_WAITING = "ContainersWaiting"
    """Ready=False: pods cannot start their containers (missing image, crash loop, ...); the
    message names the pod, the container and the kubelet's reason."""
    SERVICE_NOT_APPLIED = "ServiceNotApplied"
    """Ready=False: the replicas are ready, but the model's Service is not applied yet (its apply is
    in flight) or the API server refused it (Degraded says why)."""
    ROLLOUT_COMPLETE = "RolloutComplete"
    """Progressing=False: the Deployment reached its desired state."""
    AS_EXPECTED = "AsExpected"
    """Degraded=False: the last reconcile rendered and applied everything."""
    GATE_CONFIG_NOT_FOUND = "GateConfigNotFound"
    """Degraded=True: spec.gateConfigRef names a GateConfig that does not exist."""
    GATE_CONFIG_INVALID = "GateConfigInvalid"
    """Degraded=True: the GateConfig's gate does not fit the model or fails its checksum."""
    APPLY_FAILED = "ApplyFailed"
    """Degraded=True: the API server refused the rendered objects."""


class Status(str, enum.Enum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


@dataclasses.dataclass(frozen=True)
class Condition:
    type: ConditionType
    status: Status
    reason: Reason
    message: str = ""

    def to_json(self, *, now: str, observed_generation: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type.value, "status": self.status.value,
                               "reason": self.reason.value, "message": self.message,
                               "lastTransitionTime": now}
        if observed_generation is not None:
            out["observedGeneration"] = observed_generation
        return out


def merge_conditions(previous: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]], *, now: str,
                     observed_generation: int | None = None, order: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Merge condition dicts into ``previous`` by type (the one merge every status here uses).

    ``lastTransitionTime`` moves only when a condition's status changes, as Kubernetes conventions
    ask; types listed in ``order`` come first, in that order.
    """
    by_type = {c.get("type"): dict(c) for c in previous}
    for cond in new:
        old = by_type.get(cond["type"])
        kept = old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime")
        merged = {**cond, "lastTransitionTime": old["lastTransitionTime"] if kept else now}
        if observed_generation is not None:
            merged["observedGeneration"] = observed_generation
        by_type[cond["type"]] = merged
    rank = {t: i for i, t in enumerate(order)}
    return sorted(by_type.values(), key=lambda c: rank.get(c["type"], len(rank)))


def set_conditions(previous: Iterable[Mapping[str, Any]], new: Iterable[Condition], *,
                   now: str, observed_generation: int | None) -> list[dict[str, Any]]:
    """Merge ``new`` into ``previous`` by type; keep lastTransitionTime when status is unchanged."""
    return merge_conditions(previous, [c.to_json(now=now, observed_generation=None) for c in new], now=now,
                            observed_generation=observed_generation, order=[t.value for t in ConditionType])


def degraded_condition(*, gate_error: str | None, gate_source: str,
                       apply_error: str | None) -> Condition:
    if apply_error:
        return Condition(ConditionType.DEGRADED, Status.TRUE, Reason.APPLY_FAILED, apply_error)
    if gate_error:
        reason = (Reason.GATE_CONFIG_NOT_FOUND if gate_source == "missing"
                  else Reason.GATE_CONFIG_INVALID)
        return Condition(ConditionType.DEGRADED, Status.TRUE, reason, gate_error)
    return Condition(ConditionType.DEGRADED, Status.FALSE, Reason.AS_EXPECTED,
                     f"gate from {gate_source}")


# Waiting reasons a kubelet reports when a container cannot start by itself: worth naming in
# the model's Ready condition (ContainerCreating and PodInitializing just take time).
STUCK_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerError", "CreateContainerConfigError", "RunContainerError",
})


def is_stuck(pod: Mapping[str, Any]) -> bool:
    return bool(container_problems([pod]))


def container_problems(pods: Iterable[Mapping[str, Any]], *, limit: int = 3) -> list[str]:
    """``pod/container: Reason: message`` for containers waiting with a :data:`STUCK_REASONS` reason."""
    found = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name")
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_REASONS:
                message = str(waiting.get("message") or "")[:200]
                found.append(f"{name}/{cs.get('name')}: {waiting['reason']}" + (f": {message}" if message else ""))
    return sorted(found)[:limit]


GATE_REASONS = frozenset({Reason.GATE_CONFIG_NOT_FOUND.value, Reason.GATE_CONFIG_INVALID.value})


def gate_unavailable(conditions: Iterable[Mapping[str, Any]]) -> bool:
    """Whether Degraded is True because the model has no usable gate (not, e.g., ApplyFailed)."""
    return any(cond.get("type") == ConditionType.DEGRADED.value and cond.get("status") == Status.TRUE.value
               and cond.get("reason") in GATE_REASONS for cond in conditions)


def workload_conditions(*, desired: int, deployment: Mapping[str, Any] | None,
                        gate_unavailable: bool, problems: Sequence[str] = (),
                        service_applied: bool = True) -> list[Condition]:
    """Ready and Progressing from the Deployment (None when it does not exist) and, while it is
    not done, the ``problems`` of its pods (:func:`container_problems`). A done Deployment is not
    Ready while ``service_applied`` is False: callers find the model through its Service.
    ``gate_unavailable``: no usable gate, so a missing Deployment was never rendered."""
    if deployment is None:
        reason = Reason.GATE_UNAVAILABLE if gate_unavailable else Reason.DEPLOYMENT_MISSING
        return [Condition(ConditionType.READY, Status.FALSE, reason, "no Deployment"),
                Condition(ConditionType.PROGRESSING, Status.FALSE, reason, "no Deployment")]
    meta = deployment.get("metadata") or {}
    st = deployment.get("status") or {}
    observed = st.get("observedGeneration", 0) >= meta.get("generation", 0)
    ready = st.get("readyReplicas", 0) or 0
    updated = st.get("updatedReplicas", 0) or 0
    total = st.get("replicas", 0) or 0
    done = observed and ready >= desired and updated >= desired and total == desired
    counts = f"{ready}/{desired} ready, {updated} updated"
    if done and not service_applied:
        message = f"{counts}; the model's Service is not applied yet"
        return [Condition(ConditionType.READY, Status.FALSE, Reason.SERVICE_NOT_APPLIED, message),
                Condition(ConditionType.PROGRESSING, Status.TRUE, Reason.SERVICE_NOT_APPLIED, message)]
    if done:
        reason = Reason.SCALED_TO_ZERO if desired == 0 else Reason.ALL_REPLICAS_READY
        return [Condition(ConditionType.READY, Status.TRUE, reason, counts),
                Condition(ConditionType.PROGRESSING, Status.FALSE, Reason.ROLLOUT_COMPLETE, counts)]
    if problems:
        return [Condition(ConditionType.READY, Status.FALSE, Reason.CONTAINERS_WAITING,
                          f"{counts}; {'; '.join(problems)}"),
                Condition(ConditionType.PROGRESSING, Status.TRUE, Reason.REPLICAS_NOT_READY, counts)]
    return [Condition(ConditionType.READY, Status.FALSE, Reason.REPLICAS_NOT_READY, counts),
            Condition(ConditionType.PROGRESSING, Status.TRUE, Reason.REPLICAS_NOT_READY, counts)]


def kstatus_conditions(workload: Sequence[Condition], *, degraded: Condition | None,
                       stalled: bool) -> list[Condition]:
    """Reconciling (from :func:`workload_conditions`' Ready) and, when ``degraded`` is this
    writer's to give, Stalled (mirroring it). ``stalled``: whether the model is Stalled now (the
    Deployment watcher passes the last reconcile's Degraded, which it does not recompute)."""
    ready = next(cond for cond in workload if cond.type is ConditionType.READY)
    reconciling = ready.status is not Status.TRUE and not stalled
    out = [Condition(ConditionType.RECONCILING, Status.TRUE if reconciling else Status.FALSE,
                     ready.reason, ready.message)]
    if degraded is not None:
        out.append(Condition(ConditionType.STALLED, degraded.status, degraded.reason, degraded.message))
    return out


# Conditions that restate others for kstatus: their transitions are not posted as Events twice.
KSTATUS_MIRRORS = frozenset({ConditionType.RECONCILING.value, ConditionType.STALLED.value})


def is_degraded(conditions: Iterable[Mapping[str, Any]]) -> bool:
    return any(c.get("type") == ConditionType.DEGRADED.value and c.get("status") == Status.TRUE.value
               for c in conditions)


def transitions(previous: Iterable[Mapping[str, Any]],
                current: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Conditions whose status changed (or appeared): these become Kubernetes Events (the
    :data:`KSTATUS_MIRRORS` left out: their change is the Ready/Degraded change already listed)."""
    before = {c.get("type"): c.get("status") for c in previous}
    return [c for c in current
            if before.get(c.get("type")) != c.get("status") and c.get("type") not in KSTATUS_MIRRORS]
