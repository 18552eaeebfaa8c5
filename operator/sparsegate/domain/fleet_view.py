"""Small projections of the objects a model's fleet is made of, as the operator's watches keep them.

The rollout controller needs, per tick, each referencing SparseModel, its Deployment, the
ReplicaSets and the pods — only their names, uids, controller references, pod addresses and ports.
Reading them from the API server cost one GET per model and object kind and a pod and a
ReplicaSet LIST per GateConfig on every check (at 2,000 GateConfigs, tens of thousands of
requests a minute). The Kopf indexes in ``handlers.fleetindex`` keep these projections of the
watched objects instead, so a tick reads its fleet from memory.

A projection keeps the object's shape (``metadata``/``spec``/``status``) with only the fields read
by ``domain.pod_ownership``, ``controllers.rollout``, ``domain.conditions.container_problems``
(a pod's first failing container, kept only while it fails), the gate binding
(``handlers.modelsync.stale_models``), for a Deployment the model's status (``domain.model_status``:
generation, replica counts, a ProgressDeadlineExceeded condition), and for a GateConfig the model's
gate (``domain.gate.resolve``),
so those read a projection exactly as they read the full object; and it is small (a pod's is a
few hundred bytes where the object is several KiB), its strings interned (``domain.interned``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparsegate_contracts import names

from sparsegate.domain import interned, render
from sparsegate.domain.conditions import ConditionType, failing_container, progress_deadline
from sparsegate.domain.pod_ownership import controller_ref

_REF_FIELDS = ("apiVersion", "kind", "name", "uid", "controller")


def _meta(obj: Mapping[str, Any], *, labels: tuple[str, ...] = ()) -> dict[str, Any]:
    """name, namespace, uid, the controller reference alone, the given labels, deletionTimestamp."""
    meta = obj.get("metadata") or {}
    out: dict[str, Any] = {k: meta[k] for k in ("name", "namespace", "uid", "deletionTimestamp") if meta.get(k)}
    ref = controller_ref(obj)
    if ref is not None:
        out["ownerReferences"] = [{k: ref[k] for k in _REF_FIELDS if k in ref}]
    kept = {k: v for k, v in (meta.get("labels") or {}).items() if k in labels}
    if kept:
        out["labels"] = kept
    return out


def pod_view(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A model pod: owner chain, model label, phase and IP, the server container's admin port, and
    its first failing container (``conditions.failing_container``: none normally) for the
    model's status."""
    status = pod.get("status") or {}
    view: dict[str, Any] = {"metadata": _meta(pod, labels=(names.MODEL_LABEL,)),
                            "status": {k: status[k] for k in ("phase", "podIP") if status.get(k)}}
    failing = failing_container(pod)
    if failing is not None:
        view["status"]["containerStatuses"] = [failing]
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") != render.CONTAINER_NAME:
            continue
        ports = [{"name": p["name"], "containerPort": p["containerPort"]} for p in c.get("ports") or []
                 if p.get("name") == names.ADMIN_PORT_NAME and p.get("containerPort")]
        view["spec"] = {"containers": [{"name": c["name"], "ports": ports}]}
    return interned.deep(view)


def owner_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A ReplicaSet or Deployment: who it is and who controls it."""
    return interned.deep({"metadata": _meta(obj)})


# What a model's status reads of its Deployment (``domain.conditions.workload_conditions`` and the
# replica counts): the spec generation the controller has observed and three counts, and the
# Progressing condition only while it says ProgressDeadlineExceeded (its other reasons change
# with every rollout step and decide nothing, so keeping them would cost memory and refreshes).
DEPLOYMENT_STATUS_FIELDS = ("observedGeneration", "replicas", "readyReplicas", "updatedReplicas")


def deployment_view(deployment: Mapping[str, Any]) -> dict[str, Any]:
    """A model-server Deployment: who controls it (owner checks) and what the model's status is
    computed from, so a status refresh needs no Deployment GET."""
    view = owner_view(deployment)
    generation = (deployment.get("metadata") or {}).get("generation")
    if generation is not None:
        view["metadata"]["generation"] = generation
    status = deployment.get("status") or {}
    view["status"] = {k: status[k] for k in DEPLOYMENT_STATUS_FIELDS if status.get(k) is not None}
    deadline = progress_deadline(deployment)
    if deadline is not None:
        view["status"]["conditions"] = [interned.deep(
            {k: deadline[k] for k in ("type", "status", "reason", "message") if deadline.get(k) is not None})]
    return view


def model_view(model: Mapping[str, Any]) -> dict[str, Any]:
    """A SparseModel: who it is, what the fleet needs of its spec (the serving port), the GateConfig
    it references (a model pod's event finds its GateConfig), and what the gate binding compares
    (expert count; the gate version it renders and whether it is Degraded, and why)."""
    spec, status = model.get("spec") or {}, model.get("status") or {}
    view: dict[str, Any] = {"metadata": _meta(model), "spec": {k: spec[k] for k in ("servingPort",) if spec.get(k)},
                            "status": {k: status[k] for k in ("gateVersion",) if status.get(k)}}
    ref = (spec.get("gateConfigRef") or {}).get("name")
    if ref:
        view["spec"]["gateConfigRef"] = {"name": ref}
    experts = (spec.get("model") or {}).get("experts")
    if experts is not None:
        view["spec"]["model"] = {"experts": experts}
    # Degraded's reason only while True: the binding tells a model without a gate from one whose
    # apply was refused (``conditions.gate_unavailable``).
    degraded = [{"type": c["type"], "status": c.get("status"),
                 **({"reason": c.get("reason")} if c.get("status") == "True" else {})}
                for c in status.get("conditions") or [] if c.get("type") == ConditionType.DEGRADED.value]
    if degraded:
        view["status"]["conditions"] = degraded
    return interned.deep(view)


def gate_view(gate_config: Mapping[str, Any]) -> dict[str, Any]:
    """A GateConfig as a model's reconcile resolves it (``domain.gate.resolve``): its spec params and
    the stable document in its status; the rollout's own state and history stay out."""
    spec, status = gate_config.get("spec") or {}, gate_config.get("status") or {}
    view: dict[str, Any] = {"metadata": _meta(gate_config), "spec": {}, "status": {}}
    if "params" in spec:
        view["spec"]["params"] = spec["params"]
    if status.get("stable"):
        view["status"]["stable"] = status["stable"]
    return interned.deep(view)


def pod_serving(pod: Mapping[str, Any]) -> bool:
    """Ready, addressed and not going: a pod a gate can be pushed to now. A resting GateConfig
    checks its pods again only on such a pod's event (a new pod, or one back from a restart,
    becomes Ready), not on each of the several status events every pod goes through."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
