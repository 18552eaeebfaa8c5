"""The model's admin Secret (``<model>-admin``: token, TLS certificate and key): created, and
replaced when it is not this model's or no longer usable. Shared by the SparseModel reconcile
(``handlers.modelsync``) and the rollout and access loops (``controllers.rollout``), which renew a
certificate nobody changed before it ends."""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable, Mapping

from sparsegate.clients.kube import Kube
from sparsegate.domain import admin_tls, render

# (body of the object the event is about, type Normal|Warning, reason, message)
EventSink = Callable[[Mapping[str, Any], str, str, str], None]


def ensure_admin_secret(kube: Kube, model: Mapping[str, Any], *, events: EventSink,
                        logger: logging.Logger) -> None:
    """Secret ``<model>-admin`` exists and holds a token and a certificate for this model.

    Created once with fresh material (random: never re-applied). An existing Secret is replaced
    (PUT, carrying its resourceVersion) only when it is not this model's (``secret_owner_problem``:
    left by a deleted model of the same name, which the garbage collector would then remove from
    under this one, or orphaned) or ``admin_tls.secret_problem`` finds it unusable: made by an
    operator before the TLS admin channel (token only), a certificate for another name, or one
    ending within 30 days. Running pods pick the new files up without a restart."""
    name = render.admin_secret_name(model["metadata"]["name"])
    server_name = render.admin_server_name(model)
    now = datetime.datetime.now(datetime.timezone.utc)

    def fresh_secret() -> dict[str, Any]:
        return render.render_secret(model, material=admin_tls.new_material(server_name=server_name, now=now))

    def create() -> bool:
        created = kube.create_if_absent(fresh_secret())
        if created:
            logger.info("created admin Secret %s", name)
        return created

    # Never reconciled: there is most likely no Secret yet, so create first (one request) and read
    # only if one exists (a 409).
    if not (model.get("status") or {}).get("observedGeneration") and create():
        return
    existing = kube.get("Secret", namespace=model["metadata"]["namespace"], name=name)
    if existing is None:
        create()
        return
    problem = (secret_owner_problem(existing, model)
               or admin_tls.secret_problem(existing, server_name=server_name, now=now))
    if problem is None:
        return
    secret = fresh_secret()
    secret["metadata"]["resourceVersion"] = existing["metadata"].get("resourceVersion")
    kube.replace(secret)
    events(model, "Normal", "AdminSecretReplaced", f"Secret {name} replaced with a new token and certificate: {problem}")
    logger.info("replaced admin Secret %s: %s", name, problem)


def secret_owner_problem(secret: Mapping[str, Any], model: Mapping[str, Any]) -> str | None:
    """Why ``secret`` is not this model's own (None: its controller is this model, by uid)."""
    refs = (secret.get("metadata") or {}).get("ownerReferences") or []
    controller = next((ref for ref in refs if ref.get("controller")), None)
    if controller is None:
        return "it has no owner"
    if controller.get("uid") != model["metadata"].get("uid"):
        return f"it belongs to {controller.get('kind')} uid {controller.get('uid')}, not this one"
    return None
