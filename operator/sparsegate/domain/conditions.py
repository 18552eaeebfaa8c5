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
    """kstatus: True while the model is not Ready and not Stalled (instances starting, rolling), or
    while an apply that failed in passing is retried (Degraded ApplyRetrying)."""
    STALLED = "Stalled"
    """kstatus: True while Degraded is True for a reason that needs a person (nothing moves until the
    spec, its GateConfig or the cluster changes; not ApplyRetrying, which the operator's retry may get
    past), or while Ready is False for a reason in :data:`WORKLOAD_STALLS` (pods that cannot run, the
    Deployment past its progress deadline)."""


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
    CONTAINERS_FAILING = "ContainersFailing"
    """Ready=False and Stalled=True: pods cannot run their containers (missing image, crash loop,
    ...; :func:`failing_container`); the message names the pod, the container and the kubelet's reason."""
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    """Ready=False, Progressing=False and Stalled=True: the Deployment says its rollout has made no
    progress within its progressDeadlineSeconds (kstatus reads such a Deployment as Failed)."""
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
    """Degraded=True and Stalled=True: the API server refused the rendered objects (invalid,
    forbidden, someone else's object of that name: a 4xx that a retry of the same apply gets again)."""
    APPLY_RETRYING = "ApplyRetrying"
    """Degraded=True, Stalled=False and Reconciling=True: an apply failed in passing (API server 5xx,
    429 too many requests, 409 conflict, 408 or no answer in time); the operator retries it
    (:func:`apply_error_passes`)."""


class Status(str, enum.Enum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


@dataclasses.dataclass(frozen=True)
class Condition:
    type: ConditionType
    status: Status
    reason: Reason | str  # a str only as read back from a status (``observed_condition``)
    message: str = ""

    def to_json(self, *, now: str, observed_generation: int | None) -> dict[str, Any]:
        reason = self.reason.value if isinstance(self.reason, Reason) else self.reason
        out: dict[str, Any] = {"type": self.type.value, "status": self.status.value,
                               "reason": reason, "message": self.message,
                               "lastTransitionTime": now}
        if observed_generation is not None:
            out["observedGeneration"] = observed_generation
        return out


LISTED = 5  # names a condition message shows; the rest are counted


def listed(items: Sequence[str], limit: int = LISTED) -> str:
    """The first ``limit`` of ``items`` joined, and how many more there are."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


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


# HTTP answers to an apply that a retry of the same apply may not get again: the API server busy or
# failing (5xx), throttling (429), a write that raced another (409 Conflict), a request timeout (408).
_PASSING_STATUSES = frozenset({408, 409, 429})


def apply_error_passes(error: str) -> bool:
    """Whether an apply error, as the reconcile reports it (``str(KubeError)``: ``"<status> <reason>:
    <message>"``; or ``"<exception type>: <message>"`` for a request that got no HTTP answer), is one
    the operator's retry may get past (Degraded ApplyRetrying), rather than one that needs a person
    (ApplyFailed: 400/422 invalid, 401/403 forbidden, 404, and the 409 ``AlreadyExists`` the operator
    raises for an object of the model's name that is someone else's)."""
    head, _, rest = error.partition(" ")
    if len(head) == 3 and head.isdigit():
        status = int(head)
        if status == 409:
            return not rest.startswith("AlreadyExists")
        return status >= 500 or status in _PASSING_STATUSES
    name = head.rstrip(":")
    return "Timeout" in name or "Connection" in name or name in ("MaxRetryError", "ProtocolError")


def degraded_condition(*, gate_error: str | None, gate_source: str,
                       apply_error: str | None) -> Condition:
    if apply_error:
        reason = Reason.APPLY_RETRYING if apply_error_passes(apply_error) else Reason.APPLY_FAILED
        return Condition(ConditionType.DEGRADED, Status.TRUE, reason, apply_error)
    if gate_error:
        reason = (Reason.GATE_CONFIG_NOT_FOUND if gate_source == "missing"
                  else Reason.GATE_CONFIG_INVALID)
        return Condition(ConditionType.DEGRADED, Status.TRUE, reason, gate_error)
    return Condition(ConditionType.DEGRADED, Status.FALSE, Reason.AS_EXPECTED,
                     f"gate from {gate_source}")


# Waiting reasons a kubelet reports when a container cannot start by itself: they stall the model
# (ContainerCreating and PodInitializing just take time).
STUCK_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerError", "CreateContainerConfigError", "RunContainerError",
})


def failing_container(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The first container status of ``pod`` (the object or its ``fleet_view.pod_view``) whose
    container cannot run by itself, cut to what :func:`container_problems` reads; None normally.

    Failing: waiting with a :data:`STUCK_REASONS` reason, or terminated with a non-zero exit code
    after at least one restart (it failed before too). A container running again between two
    crashes is not: it may be the run that works, and the kubelet's CrashLoopBackOff follows the
    next crash within moments."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        state = cs.get("state") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
        if waiting.get("reason") in STUCK_REASONS:
            return {"name": cs.get("name"), "state": {"waiting": {
                "reason": waiting["reason"], "message": str(waiting.get("message") or "")[:200]}}}
        if (terminated.get("exitCode") or 0) != 0 and (cs.get("restartCount") or 0) >= 1:
            return {"name": cs.get("name"), "restartCount": cs["restartCount"], "state": {"terminated": {
                "exitCode": terminated["exitCode"], "reason": str(terminated.get("reason") or "Error")[:64]}}}
    return None


def is_stuck(pod: Mapping[str, Any]) -> bool:
    """Whether a container of ``pod`` is failing (:func:`failing_container`); a pod being deleted
    counts too, so its last events still refresh the model (whose problems then leave it out)."""
    return failing_container(pod) is not None


def container_problems(pods: Iterable[Mapping[str, Any]], *, limit: int = 3) -> list[str]:
    """``pod/container: Reason: message`` for each pod's :func:`failing_container`; pods being
    deleted are left out (a rollback or a fixed spec replaces them: they stall nothing)."""
    found = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        failing = None if meta.get("deletionTimestamp") else failing_container(pod)
        if failing is None:
            continue
        state = failing["state"]
        if "waiting" in state:
            reason, message = state["waiting"]["reason"], state["waiting"]["message"]
        else:
            reason, message = state["terminated"]["reason"], f"exit code {state['terminated']['exitCode']}"
        found.append(f"{meta.get('name')}/{failing['name']}: {reason}" + (f": {message}" if message else ""))
    return sorted(found)[:limit]


DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"  # the Deployment controller's reason, as kstatus reads it


def progress_deadline(deployment: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The Deployment's ``Progressing`` condition (the object or its ``fleet_view.deployment_view``)
    when its reason is ProgressDeadlineExceeded, else None."""
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == DEADLINE_EXCEEDED:
            return cond
    return None


GATE_REASONS = frozenset({Reason.GATE_CONFIG_NOT_FOUND.value, Reason.GATE_CONFIG_INVALID.value})


def gate_unavailable(conditions: Iterable[Mapping[str, Any]]) -> bool:
    """Whether Degraded is True because the model has no usable gate (not, e.g., ApplyFailed)."""
    return any(cond.get("type") == ConditionType.DEGRADED.value and cond.get("status") == Status.TRUE.value
               and cond.get("reason") in GATE_REASONS for cond in conditions)


def workload_conditions(*, desired: int, deployment: Mapping[str, Any] | None,
                        gate_unavailable: bool, problems: Sequence[str] = (),
                        service_applied: bool = True) -> list[Condition]:
    """Ready and Progressing from the Deployment (None when it does not exist) and, while it is
    not done, the ``problems`` of its pods (:func:`container_problems`) and its progress deadline:
    either makes Ready's reason one of :data:`WORKLOAD_STALLS` (the model is Stalled,
    :func:`kstatus_conditions`). A done Deployment is not Ready while ``service_applied`` is
    False: callers find the model through its Service. ``gate_unavailable``: no usable gate, so a
    missing Deployment was never rendered."""
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
    # A deadline the controller set for an earlier spec is not this one's (kstatus checks
    # observedGeneration first too).
    deadline = progress_deadline(deployment) if observed else None
    if problems or deadline is not None:
        details = [*problems, *([str(deadline.get("message") or DEADLINE_EXCEEDED)] if deadline is not None else [])]
        # The pods name the cause; the deadline only says the controller gave up waiting.
        reason = Reason.CONTAINERS_FAILING if problems else Reason.PROGRESS_DEADLINE_EXCEEDED
        progressing = (Condition(ConditionType.PROGRESSING, Status.FALSE, Reason.PROGRESS_DEADLINE_EXCEEDED, counts)
                       if deadline is not None else
                       Condition(ConditionType.PROGRESSING, Status.TRUE, Reason.REPLICAS_NOT_READY, counts))
        return [Condition(ConditionType.READY, Status.FALSE, reason, f"{counts}; {'; '.join(details)}"), progressing]
    return [Condition(ConditionType.READY, Status.FALSE, Reason.REPLICAS_NOT_READY, counts),
            Condition(ConditionType.PROGRESSING, Status.TRUE, Reason.REPLICAS_NOT_READY, counts)]


# Ready reasons that stall the model: the pods or the Deployment controller will not get further
# without a change (a fixed spec, image or Secret; a rollback), so kstatus reads Failed, not
# InProgress (a kubelet's CrashLoopBackOff makes kstatus call the Pod itself Failed too).
WORKLOAD_STALLS = frozenset({Reason.CONTAINERS_FAILING, Reason.PROGRESS_DEADLINE_EXCEEDED})


def kstatus_conditions(workload: Sequence[Condition], *, degraded: Condition | None) -> list[Condition]:
    """Reconciling and Stalled from :func:`workload_conditions`' Ready and ``degraded`` (the
    reconcile's own; the Deployment watcher passes the last one written, :func:`observed_condition`,
    None if there is none). Stalled mirrors Degraded while it is True (but for ApplyRetrying), else
    Ready while its reason is a :data:`WORKLOAD_STALLS`, else Degraded (False); Reconciling is True
    while neither Ready nor Stalled is, or while Degraded is ApplyRetrying (the spec not applied yet,
    the operator retrying: kstatus InProgress, not Failed nor Current). Both writers derive Stalled
    alike, so neither undoes the other's."""
    ready = next(cond for cond in workload if cond.type is ConditionType.READY)
    retrying = degraded is not None and degraded.status is Status.TRUE and degraded.reason == Reason.APPLY_RETRYING
    if degraded is not None and degraded.status is Status.TRUE and not retrying:
        stalled = Condition(ConditionType.STALLED, Status.TRUE, degraded.reason, degraded.message)
    elif ready.reason in WORKLOAD_STALLS:
        stalled = Condition(ConditionType.STALLED, Status.TRUE, ready.reason, ready.message)
    elif degraded is not None:
        stalled = Condition(ConditionType.STALLED, Status.FALSE, degraded.reason, degraded.message)
    else:
        stalled = Condition(ConditionType.STALLED, Status.FALSE, ready.reason, ready.message)
    if retrying and stalled.status is not Status.TRUE:
        assert degraded is not None
        return [Condition(ConditionType.RECONCILING, Status.TRUE, degraded.reason, degraded.message), stalled]
    reconciling = ready.status is not Status.TRUE and stalled.status is not Status.TRUE
    return [Condition(ConditionType.RECONCILING, Status.TRUE if reconciling else Status.FALSE,
                      ready.reason, ready.message), stalled]


def observed_condition(conditions: Iterable[Mapping[str, Any]], type_: ConditionType) -> Condition | None:
    """The condition of ``type_`` as written in a status, or None. A reason this version does not
    know is kept as its string (``Condition.to_json`` writes it back unchanged)."""
    for cond in conditions:
        if cond.get("type") != type_.value:
            continue
        reason: Reason | str = str(cond.get("reason") or "")
        try:
            reason = Reason(reason)
        except ValueError:
            pass
        try:
            status = Status(cond.get("status"))
        except ValueError:
            status = Status.UNKNOWN
        return Condition(type_, status, reason, str(cond.get("message") or ""))
    return None


# Conditions that restate others for kstatus: their transitions are not posted as Events twice.
KSTATUS_MIRRORS = frozenset({ConditionType.RECONCILING.value, ConditionType.STALLED.value})
_WORKLOAD_STALL_VALUES = frozenset(r.value for r in WORKLOAD_STALLS)


def is_degraded(conditions: Iterable[Mapping[str, Any]]) -> bool:
    return any(c.get("type") == ConditionType.DEGRADED.value and c.get("status") == Status.TRUE.value
               for c in conditions)


def transitions(previous: Iterable[Mapping[str, Any]],
                current: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Conditions whose status changed (or appeared): these become Kubernetes Events (the
    :data:`KSTATUS_MIRRORS` left out: their change is the Ready/Degraded change already listed).
    Except Stalled turning True on the workload while Ready does not change: Ready is False
    already while pods start, so nothing else would say that they now cannot."""
    current = list(current)
    before = {c.get("type"): c.get("status") for c in previous}
    changed = [c for c in current if before.get(c.get("type")) != c.get("status")]
    ready_changed = any(c.get("type") == ConditionType.READY.value for c in changed)
    return [c for c in changed
            if c.get("type") not in KSTATUS_MIRRORS
            or (c.get("type") == ConditionType.STALLED.value and c.get("status") == Status.TRUE.value
                and c.get("reason") in _WORKLOAD_STALL_VALUES and not ready_changed)]
