"""Is this pod one of the model's? Decided by owner references, never by labels alone.

Labels are free for anyone who can create a pod: a pod labelled ``sparsegate.dev/model=<m>`` would
otherwise receive model m's admin token. Before a token is sent, the pod's controller chain must
lead to the model: pod → ReplicaSet (controller) → the model's Deployment (controller, by uid) →
the SparseModel (controller, by uid).

What this does not stop: someone allowed to create pods in the namespace can also write an
ownerReference by hand, and mount Secret ``<model>-admin`` outright; the namespace stays the trust
boundary. Against a pod that cannot read the Secret, the TLS pinning of the admin channel (the
server must hold the model's private key) is the second lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparsegate_contracts.names import API_VERSION


def controller_ref(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ownerReference with ``controller: true`` (Kubernetes allows at most one)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


def ownership_problem(pod: Mapping[str, Any], *, replicasets: Mapping[str, Mapping[str, Any]],
                      deployment: Mapping[str, Any] | None, model: Mapping[str, Any]) -> str | None:
    """None when ``pod`` belongs to ``model``; else why not, for an Event or a log line.

    ``replicasets``: the namespace's ReplicaSets by uid (one LIST serves every pod);
    ``deployment``: the model's Deployment (None: not found); ``model``: the SparseModel."""
    model_meta = model.get("metadata") or {}
    if deployment is None:
        return f"Deployment {model_meta.get('name')} not found"
    dep_meta = deployment.get("metadata") or {}
    owner = controller_ref(deployment)
    if not owner or owner.get("kind") != "SparseModel" or owner.get("apiVersion") != API_VERSION \
            or owner.get("uid") != model_meta.get("uid"):
        return f"Deployment {dep_meta.get('name')} is not controlled by SparseModel {model_meta.get('name')}"
    ref = controller_ref(pod)
    if not ref or ref.get("kind") != "ReplicaSet" or ref.get("apiVersion") != "apps/v1":
        return "no controller ReplicaSet"
    rs = replicasets.get(ref.get("uid") or "")
    if rs is None:
        return f"controller ReplicaSet {ref.get('name')} ({ref.get('uid')}) not found"
    rs_owner = controller_ref(rs)
    if not rs_owner or rs_owner.get("kind") != "Deployment" or rs_owner.get("uid") != dep_meta.get("uid"):
        return (f"ReplicaSet {(rs.get('metadata') or {}).get('name')} is not controlled by "
                f"Deployment {dep_meta.get('name')}")
    return None
