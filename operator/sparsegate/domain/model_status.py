"""SparseModel ``status`` as a pure function of what one reconcile or one Deployment event saw.

Two writers share one shape: the reconcile (after rendering and applying) owns observedGeneration,
the gate fields and Degraded; the Deployment watcher refreshes replica counts, Ready, Progressing,
Reconciling and Stalled and carries the rest over. Both go through ``workload_conditions`` and
``kstatus_conditions`` (Stalled: Degraded, or pods that cannot run, or the Deployment's progress
deadline) so Ready and Stalled mean the same thing whichever wrote last.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from sparsegate.domain import conditions as c
from sparsegate.domain import default_gate, render
from sparsegate.domain.gate import GateResolution


def desired_replicas(model: Mapping[str, Any]) -> int:
    return int(model["spec"].get("replicas", 1))


def pod_selector(model: Mapping[str, Any]) -> str:
    """``status.selector``: the model's pods as a label selector string, which the CRD's scale
    subresource serves (``labelSelectorPath``) and a HorizontalPodAutoscaler needs."""
    return ",".join(f"{k}={v}" for k, v in sorted(render.selector_labels(model["metadata"]["name"]).items()))


# What of a Deployment and the model's pods a status computation reads (besides the model itself):
# equal inputs and an unchanged model give an equal status. ``controllers.status_inputs`` keys on it.
WorkloadInputs = tuple[Any, ...]


def workload_inputs(deployment: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]]) -> WorkloadInputs:
    """The Deployment's uid, generation, replica counts and progress deadline (as
    ``c.workload_conditions`` and ``_replica_counts`` read them) and the pods' container problems;
    the Deployment may be the object or its ``domain.fleet_view.deployment_view``."""
    problems = tuple(c.container_problems(pods))
    if deployment is None:
        return (None, problems)
    meta, st = deployment.get("metadata") or {}, deployment.get("status") or {}
    deadline = c.progress_deadline(deployment)
    return ((meta.get("uid"), meta.get("generation"), st.get("observedGeneration", 0),
             st.get("replicas") or 0, st.get("readyReplicas") or 0, st.get("updatedReplicas") or 0,
             None if deadline is None else str(deadline.get("message") or "")), problems)


def workload_settled(deployment: Mapping[str, Any] | None) -> bool:
    """Whether the Deployment controller is done with ``deployment`` (the object or its view): it has
    observed the current spec, its pods number what the spec asks (when the object carries
    ``spec.replicas``) and every one is updated and ready — ``kubectl rollout status``'s test. Until
    then its status moves again within moments (observed → some ready → all ready), which
    ``handlers.sparsemodel`` lets settle before refreshing the model. Without the count, a new or
    scaled Deployment looked settled at its first status (observed, counts not yet moved: 0 of 0
    at creation, 2 of 2 on the way to 3), and its model's status was refreshed once more."""
    if deployment is None:
        return True
    generation = (deployment.get("metadata") or {}).get("generation") or 0
    st = deployment.get("status") or {}
    replicas = st.get("replicas") or 0
    wanted = (deployment.get("spec") or {}).get("replicas")
    return (st.get("observedGeneration") or 0) >= generation and (wanted is None or replicas == wanted) and \
        (st.get("readyReplicas") or 0) == replicas and (st.get("updatedReplicas") or 0) == replicas


def _replica_counts(deployment: Mapping[str, Any] | None) -> dict[str, int]:
    st = (deployment or {}).get("status") or {}
    return {"replicas": int(st.get("replicas") or 0), "readyReplicas": int(st.get("readyReplicas") or 0)}


def after_reconcile(*, model: Mapping[str, Any], generation: int | None, gate: GateResolution,
                    deployment: Mapping[str, Any] | None, apply_error: str | None,
                    now: str, problems: Sequence[str] = (), service_applied: bool = True,
                    gate_applied: bool | None = None) -> dict[str, Any]:
    """Full status after a reconcile that rendered ``generation`` of the (now current) ``model``;
    ``service_applied``: whether the model's Service is applied (``c.workload_conditions``).
    ``gate_applied``: whether the gate's ConfigMap and the Deployment landed, so status names the
    gate (default: no ``apply_error``; a Service's error alone leaves the gate applied)."""
    previous = (model.get("status") or {})
    degraded = c.degraded_condition(gate_error=gate.error, gate_source=gate.source,
                                    apply_error=apply_error)
    workload = c.workload_conditions(desired=desired_replicas(model), deployment=deployment,
                                     gate_unavailable=gate.document is None, problems=problems,
                                     service_applied=service_applied)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        **_replica_counts(deployment),
        "selector": pod_selector(model),
        "conditions": c.set_conditions(
            previous.get("conditions") or [],
            [*workload, degraded, *c.kstatus_conditions(workload, degraded=degraded)],
            now=now, observed_generation=generation),
    }
    written = gate.document is not None and (apply_error is None if gate_applied is None else gate_applied)
    if written:
        status["gateVersion"] = gate.document.version
        status["gateChecksum"] = gate.document.checksum
    # The default gate written over another: its running pods get it pushed (``domain.default_gate``).
    status["conditions"] = default_gate.reconcile_conditions(previous, status["conditions"], gate=gate,
                                                             gate_written=written, now=now, generation=generation)
    return status


def after_deployment_event(*, model: Mapping[str, Any], deployment: Mapping[str, Any] | None,
                           now: str, problems: Sequence[str] = (),
                           service_applied: bool = True) -> dict[str, Any] | None:
    """Status patch after the model's Deployment changed; None when nothing would change."""
    previous = model.get("status") or {}
    prev_conditions = previous.get("conditions") or []
    workload = c.workload_conditions(desired=desired_replicas(model), deployment=deployment,
                                     gate_unavailable=c.gate_unavailable(prev_conditions), problems=problems,
                                     service_applied=service_applied)
    observed = previous.get("observedGeneration")
    # Degraded is the reconcile's to decide: Stalled is derived from the one it last wrote.
    degraded = c.observed_condition(prev_conditions, c.ConditionType.DEGRADED)
    merged = c.set_conditions(prev_conditions, [*workload, *c.kstatus_conditions(workload, degraded=degraded)],
                              now=now, observed_generation=observed)
    patch = {**_replica_counts(deployment), "conditions": merged}
    if all(previous.get(k) == v for k, v in patch.items() if k != "conditions") and \
            _same_conditions(prev_conditions, merged):
        return None
    return patch


def _same_conditions(a: list[Mapping[str, Any]], b: list[Mapping[str, Any]]) -> bool:
    keys = ("type", "status", "reason", "message")
    return [tuple(x.get(k) for k in keys) for x in a] == [tuple(x.get(k) for k in keys) for x in b]
