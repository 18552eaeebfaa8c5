"""SparseModel reconcile steps: resolve gate → render → apply → status. Kopf-free, so the
Kopf handlers stay one-liners and this reads top to bottom.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Callable, Iterable, Mapping

from sparsegate.clients.kube import Kube, KubeError
from sparsegate.domain import admin_tls, conditions, gate, model_status, render

# (body of the object the event is about, type Normal|Warning, reason, message)
EventSink = Callable[[Mapping[str, Any], str, str, str], None]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def gate_ref(model: Mapping[str, Any]) -> str | None:
    return ((model.get("spec") or {}).get("gateConfigRef") or {}).get("name")


def resolve_gate(kube: Kube, model: Mapping[str, Any]) -> gate.GateResolution:
    ref = gate_ref(model)
    body = kube.get("GateConfig", namespace=model["metadata"]["namespace"], name=ref) if ref else None
    experts = int(model["spec"]["model"]["experts"])
    return gate.resolve(body, referenced=ref is not None, num_experts=experts)


def container_problems(pods: Iterable[Mapping[str, Any]], *, deployment: Mapping[str, Any] | None,
                       desired: int) -> list[str]:
    """Why the model's pods cannot start, while some are not ready. ``pods``: the model's pods as
    the operator watches them (``handlers.fleetindex``; no LIST per reconcile)."""
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    if deployment is None or ready >= desired:
        return []
    return conditions.container_problems(pods)


def reconcile(kube: Kube, model: Mapping[str, Any], *, events: EventSink,
              logger: logging.Logger, pods: Iterable[Mapping[str, Any]] = (),
              default_image: render.DefaultImage | None = None) -> str:
    """Bring the owned objects and status in line with ``model``; returns the outcome label.

    ``pods``: the model's pods as watched (their waiting reasons go into Ready). ``default_image``:
    for models without ``spec.image``; None reads the operator's env (SPARSEGATE_MODEL_IMAGE /
    _PULL_POLICY, set by the chart from modelServer.image)."""
    meta = model["metadata"]
    default_image = default_image or render.DefaultImage.from_env(os.environ)
    resolution = resolve_gate(kube, model)
    deployment: Mapping[str, Any] | None = None
    apply_error: str | None = None
    if resolution.document is not None:
        try:
            ensure_admin_secret(kube, model, events=events, logger=logger)
            for obj in render.render_applied(model, resolution.document, default_image=default_image):
                applied = kube.apply(obj)
                if obj["kind"] == "Deployment":
                    deployment = applied
        except KubeError as e:
            apply_error = str(e)
    else:
        # No usable gate: leave what runs untouched (it keeps its last gate) and report why.
        deployment = kube.get("Deployment", namespace=meta["namespace"], name=meta["name"])
    if deployment is not None and resolution.document is not None:
        # The Deployment controller may have observed our apply already, and the Deployment event
        # handler written Ready from it: computing from the apply's response would overwrite that
        # with a stale "not observed yet". Read it again, as late as possible.
        deployment = kube.get("Deployment", namespace=meta["namespace"], name=meta["name"]) or deployment
    problems = container_problems(pods, deployment=deployment, desired=model_status.desired_replicas(model))
    write_status(kube, model, events=events,
                 compute=lambda current: model_status.after_reconcile(
                     model=current, generation=meta.get("generation"), gate=resolution,
                     deployment=deployment,
                     apply_error=apply_error, now=now(), problems=problems))
    if apply_error:
        raise KubeError(500, "ApplyFailed", apply_error)
    return "degraded" if resolution.document is None else "success"


def ensure_admin_secret(kube: Kube, model: Mapping[str, Any], *, events: EventSink,
                        logger: logging.Logger) -> None:
    """Secret ``<model>-admin`` exists and holds a token and a certificate for this model.

    Created once with fresh material (random: never re-applied). An existing Secret is replaced
    (PUT, carrying its resourceVersion) only when ``admin_tls.secret_problem`` finds it unusable:
    made by an operator before the TLS admin channel (token only), a certificate for another name,
    or one ending within 30 days. Running pods pick the new files up without a restart."""
    name = render.admin_secret_name(model["metadata"]["name"])
    server_name = render.admin_server_name(model)
    now = datetime.datetime.now(datetime.timezone.utc)
    existing = kube.get("Secret", namespace=model["metadata"]["namespace"], name=name)
    if existing is None:
        secret = render.render_secret(model, material=admin_tls.new_material(server_name=server_name, now=now))
        if kube.create_if_absent(secret):
            logger.info("created admin Secret %s", name)
        return
    problem = admin_tls.secret_problem(existing, server_name=server_name, now=now)
    if problem is None:
        return
    secret = render.render_secret(model, material=admin_tls.new_material(server_name=server_name, now=now))
    secret["metadata"]["resourceVersion"] = existing["metadata"].get("resourceVersion")
    kube.replace(secret)
    events(model, "Normal", "AdminSecretReplaced", f"Secret {name} replaced with a new token and certificate: {problem}")
    logger.info("replaced admin Secret %s: %s", name, problem)


def live_owner(kube: Kube, *, namespace: str, name: str,
               owner_refs: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The SparseModel that owned a deleted Deployment, if it still exists and is not deleting."""
    model = kube.get("SparseModel", namespace=namespace, name=name)
    if model is None or model["metadata"].get("deletionTimestamp"):
        return None
    uids = {ref.get("uid") for ref in owner_refs if ref.get("kind") == render.KIND}
    return model if model["metadata"].get("uid") in uids else None


def refresh_from_deployment(kube: Kube, *, namespace: str, name: str, deployment: Mapping[str, Any] | None,
                            pods: Iterable[Mapping[str, Any]], events: EventSink) -> None:
    """The model's Deployment (or one of its pods) changed: refresh replica counts, Ready and Progressing."""
    current = kube.get("SparseModel", namespace=namespace, name=name)
    if current is None:
        return
    problems = container_problems(pods, deployment=deployment, desired=model_status.desired_replicas(current))
    write_status(kube, current, events=events, fresh=True,
                 compute=lambda m: model_status.after_deployment_event(
                     model=m, deployment=deployment, now=now(), problems=problems))


def write_status(kube: Kube, model: Mapping[str, Any], *, events: EventSink,
                 compute: Callable[[dict[str, Any]], dict[str, Any] | None], fresh: bool = False) -> None:
    """``fresh``: ``model`` was just read, so the first write attempt starts from it (no second GET)."""
    meta = model["metadata"]
    seen: dict[str, Any] = {}

    def mutate(current: dict[str, Any]) -> dict[str, Any] | None:
        if current["metadata"].get("uid") != meta.get("uid"):
            return None  # deleted and re-created under the same name: not ours to write
        patch = compute(current)
        seen["before"] = (current.get("status") or {}).get("conditions") or []
        seen["after"] = patch.get("conditions", []) if patch else seen["before"]
        return patch

    written = kube.update_status("SparseModel", namespace=meta["namespace"], name=meta["name"],
                                 mutate=mutate, current=dict(model) if fresh else None)
    if written is None:
        return
    for cond in conditions.transitions(seen.get("before", []), seen.get("after", [])):
        warn = (cond["type"] == conditions.ConditionType.DEGRADED.value and cond["status"] == "True") \
            or (cond["type"] == conditions.ConditionType.READY.value and cond["status"] != "True"
                and cond.get("reason") != conditions.Reason.REPLICAS_NOT_READY.value)
        events(written, "Warning" if warn else "Normal", f"{cond['type']}{cond['status']}",
               f"{cond.get('reason')}: {cond.get('message')}")


def stale_models(gate_config: Mapping[str, Any] | None, models: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names of the models (SparseModels or their ``domain.fleet_view`` views) referencing
    ``gate_config`` (None: it is gone) whose rendered gate differs from what it now resolves to, or
    whose Degraded condition no longer matches whether there is a gate at all.

    A model never reconciled yet (neither a gate version nor Degraded in its status) is not
    stale: its own pending reconcile resolves the gate (reconciling it from here as well only
    repeated the same work during a mass create)."""
    out = []
    for model in models:
        status = model.get("status") or {}
        degraded = conditions.is_degraded(status.get("conditions") or [])
        if not status.get("gateVersion") and not degraded:
            continue
        experts = int(((model.get("spec") or {}).get("model") or {}).get("experts") or 0)
        resolution = gate.resolve(gate_config, referenced=True, num_experts=experts)
        want = resolution.document.version if resolution.document else None
        if want != status.get("gateVersion") or degraded != (want is None):
            out.append(model["metadata"]["name"])
    return sorted(out)
