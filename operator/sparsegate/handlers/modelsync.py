"""SparseModel reconcile steps: resolve gate → render → apply → status. Kopf-free, so the
Kopf handlers stay one-liners and this reads top to bottom.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import datetime
import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from sparsegate_contracts import names

from sparsegate import metrics
from sparsegate.clients.kube import Kube, KubeError
from sparsegate.controllers.admin_secret import EventSink, ensure_admin_secret, secret_owner_problem  # noqa: F401
from sparsegate.controllers.applied_objects import AppliedObjects
from sparsegate.controllers.status_inputs import StatusInputs
from sparsegate.domain import conditions, gate, model_status, render
from sparsegate.domain.pod_ownership import controller_ref

# Threads for the applies of one reconcile that run at once (``apply_owned``): three for each of
# the model pool's threads (``sparsegate.main`` gives it 8).
_APPLY_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=24, thread_name_prefix="sparsegate-apply")
# Threads for models' Service applies, which no reconcile waits for (``reconcile``, ``PendingService``):
# their own pool, so Services slow to create cannot take the threads the other applies need.
_SERVICE_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="sparsegate-service")
# Its applies queued or running: no handler waits for them at shutdown (``drain_service_applies``).
_service_applies: set[concurrent.futures.Future[str | None]] = set()
_service_applies_lock = threading.Lock()
# The model's Deployment as the operator's watch last delivered it (``handlers.pools.loop_reader``
# over the fleet index), or None if it has not seen one.
WatchedDeployment = Callable[[], Mapping[str, Any] | None]
# (namespace, name) → that GateConfig as the operator's watch last delivered it
# (``domain.fleet_view.gate_view``, read through ``handlers.pools.loop_reader``), or None.
WatchedGate = Callable[[str, str], Mapping[str, Any] | None]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def gate_ref(model: Mapping[str, Any]) -> str | None:
    return ((model.get("spec") or {}).get("gateConfigRef") or {}).get("name")


def resolve_gate(model: Mapping[str, Any], watched_gate: WatchedGate) -> gate.GateResolution:
    """The model's gate from its GateConfig as watched: no GET (at 10,000 models a GET per reconcile
    was a quarter of the operator's requests). A GateConfig that changes after this read is caught
    by the gate binding, or by the model's own next event (``handlers.gatebinding``)."""
    ref = gate_ref(model)
    body = watched_gate(model["metadata"]["namespace"], ref) if ref else None
    experts = int(model["spec"]["model"]["experts"])
    return gate.resolve(body, referenced=ref is not None, num_experts=experts)


def container_problems(pods: Iterable[Mapping[str, Any]], *, deployment: Mapping[str, Any] | None) -> list[str]:
    """Why the model's pods cannot run (``conditions.container_problems``); none without a
    Deployment. ``pods``: the model's pods as the operator watches them (``handlers.fleetindex``;
    no LIST per reconcile). They count whenever the Deployment is not done
    (``conditions.workload_conditions``), even while the old pods of a rollout still serve every
    replica: a new revision whose pods cannot run stalls the rollout, and waiting for the
    Deployment's progress deadline (600 s by default) would only say so later and say less."""
    if deployment is None:
        return []
    return conditions.container_problems(pods)


def newest_deployment(applied: Mapping[str, Any] | None,
                      watched: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The model's Deployment as status should see it: the watched view once it has seen the
    generation our apply produced (it then also carries what the Deployment controller did since,
    which the apply's response predates), else the apply's response."""
    if applied is None or watched is None:
        return applied if applied is not None else watched
    a, w = applied.get("metadata") or {}, watched.get("metadata") or {}
    if a.get("uid") != w.get("uid") or (w.get("generation") or 0) < (a.get("generation") or 0):
        return applied
    return watched


def generation_reconciled(model: Mapping[str, Any]) -> bool:
    """True when status says the model's current generation was reconciled already: an event of it
    then changed no spec (a label or an annotation, e.g. touching it) or is Kopf's retry."""
    generation = (model.get("metadata") or {}).get("generation")
    return generation is not None and (model.get("status") or {}).get("observedGeneration") == generation


def admin_secret_check(model: Mapping[str, Any]) -> dict[str, Any]:
    """What ``ensure_admin_secret``'s verdict depends on besides the Secret itself, in the shape
    ``AppliedObjects`` records: a model (uid) and the name its certificate must carry."""
    meta = model["metadata"]
    return {"kind": "Secret", "metadata": {"name": render.admin_secret_name(meta["name"])},
            "check": {"owner": meta.get("uid"), "serverName": render.admin_server_name(model)}}


def claims_checked(model: Mapping[str, Any]) -> bool:
    """True once a reconcile of ``model`` applied its objects (status names the gate it rendered)
    and nothing is Degraded since (an apply refused, its Service's too): its ConfigMap and Service
    are its own, and are applied without a look first."""
    status = model.get("status") or {}
    degraded = any(cond.get("type") == conditions.ConditionType.DEGRADED.value and cond.get("status") == "True"
                   for cond in status.get("conditions") or [])
    return bool(status.get("gateVersion")) and not degraded


def check_not_foreign(kube: Kube, model: Mapping[str, Any], obj: Mapping[str, Any]) -> None:
    """Before a model's first apply of ``obj``: an object of that kind and name that already exists
    and is not this model's (a user's ConfigMap or Service: ``foreign_problem``) is refused, not
    taken over. A forced server-side apply would merge into it, take its fields (a
    Service's selector: its clients reach the model's pods) and add this model's ownerReference,
    so the garbage collector deleted the user's object with the model."""
    meta = obj["metadata"]
    existing = kube.get(obj["kind"], namespace=meta["namespace"], name=meta["name"])
    problem = foreign_problem(existing, model) if existing is not None else None
    if problem is not None:
        raise KubeError(409, "AlreadyExists", f"{obj['kind']} {meta['name']} already exists and is not this "
                                              f"SparseModel's ({problem}): not taken over; rename or delete it")


def foreign_problem(existing: Mapping[str, Any], model: Mapping[str, Any]) -> str | None:
    """Why ``existing`` is not ``model``'s to apply over (None: it is). Its own, or one a SparseModel
    of the same name left (deleted and created again before the garbage collector came; or
    orphaned, ``--cascade=orphan``: no owner, the operator's labels), is taken over as before."""
    meta = existing.get("metadata") or {}
    name = model["metadata"]["name"]
    controller = next((ref for ref in meta.get("ownerReferences") or [] if ref.get("controller")), None)
    if controller is None:
        labels = meta.get("labels") or {}
        if labels.get(names.MANAGED_BY_LABEL) == names.MANAGED_BY and labels.get(names.MODEL_LABEL) == name:
            return None
        return "it has no owner and is not the operator's"
    if controller.get("kind") != render.KIND or controller.get("name") != name \
            or str(controller.get("apiVersion", "")).split("/")[0] != names.GROUP:
        return f"it belongs to {controller.get('kind')} {controller.get('name')}"
    return None


def apply_new(kube: Kube, model: Mapping[str, Any], obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` applied, unless an object of its name is someone else's (``check_not_foreign``)."""
    check_not_foreign(kube, model, obj)
    return kube.apply(obj)


def apply_owned(kube: Kube, model: Mapping[str, Any], objects: Iterable[Mapping[str, Any]], *,
                events: EventSink, logger: logging.Logger,
                applied_objects: AppliedObjects | None = None) -> Mapping[str, Any] | None:
    """The admin Secret and every object of ``objects`` but the Deployment (the ConfigMap: the
    Service is applied beside, ``start_service_apply``) at once, then the Deployment (its pods
    mount the Secret and the ConfigMap); returns the Deployment as applied. Raises the first
    KubeError (the Deployment is then not applied). At once because a reconcile is a chain of API
    calls and these do not depend on each other.

    With ``applied_objects``, the Secret check and the objects other than the Deployment are
    skipped while unchanged since this process last did them (``controllers.applied_objects``);
    the Deployment is always applied (status reads its answer)."""
    objects = list(objects)
    key, started = (model["metadata"]["namespace"], model["metadata"]["name"]), time.monotonic()
    first: list[tuple[Mapping[str, Any], Callable[[], Any]]] = [
        (admin_secret_check(model), functools.partial(ensure_admin_secret, kube, model, events=events, logger=logger))]
    apply = kube.apply if claims_checked(model) else functools.partial(apply_new, kube, model)
    first += [(obj, functools.partial(apply, obj)) for obj in objects if obj["kind"] != "Deployment"]
    if applied_objects is not None:
        first = [(obj, call) for obj, call in first if not applied_objects.unchanged(key, obj, now=started)]

    def done(obj: Mapping[str, Any], call: Callable[[], Any]) -> None:
        answer = call()
        if applied_objects is not None:  # its resourceVersion: a later write by someone else (``foreign_write``)
            applied_objects.record(key, obj, now=started, answer=answer if isinstance(answer, Mapping) else None)

    # Each in a copy of this thread's context: Kopf posts Events through context variables.
    futures = [_APPLY_POOL.submit(contextvars.copy_context().run, done, obj, call) for obj, call in first]
    errors = [e for f in futures if isinstance(e := f.exception(), BaseException)]
    if errors:
        raise errors[0]
    deployment = None
    for obj in objects:
        if obj["kind"] == "Deployment":
            deployment = kube.apply(obj)
            if applied_objects is not None:
                applied_objects.record_deployment(key, deployment)  # a later foreign edit: ``foreign_edit``
    return deployment


@dataclasses.dataclass(frozen=True)
class PendingService:
    """The model's Service apply, started by ``reconcile`` and not waited for there.

    Nothing a reconcile does depends on the Service (the pods mount the ConfigMap and the admin
    Secret; status reads the Deployment), and a ClusterIP Service is the slowest apply of all: the
    API server allocates virtual IPs one at a time under one lock, taking longer the more Services
    exist (``bench_service_create.py``; bench_scale at 10,000 models, creating: Service apply p99
    4.2 s, every other request p99 under 0.45 s). So the reconcile applies the rest and writes
    status assuming the Service ends as its last apply did (``assumed``: that apply's error, None
    when it landed or there was none); ``finish`` then waits for it, writes status again only if
    it ended otherwise, and raises a failure so the handler is retried, as any failed apply is.
    Until it lands, status does not say Ready (``with_service``); a write that held Ready back for
    it is written again by ``finish``."""

    future: concurrent.futures.Future[str | None]  # the apply's error message; None once it landed
    assumed: str | None  # the Service error the reconcile's status write reported
    rewrite: Callable[[str | None], None]  # status again, with the given Service error (None: none)
    held: Callable[[], bool]  # True once if status held Ready back for the Service meanwhile (``with_service``)

    def outcome(self) -> tuple[str | None, bool]:
        """(the apply's error, whether status must be written again: it ended otherwise than
        assumed, or a write held Ready back meanwhile). Blocks until the apply ends; no request."""
        error = self.future.result()
        return error, self.held() or error != self.assumed

    def finish(self) -> None:
        """Blocks until the apply ends; status again if ``outcome`` says so; raises KubeError if it failed."""
        error, rewrite = self.outcome()
        if rewrite:
            self.rewrite(error)
        raise_failed(error)


def raise_failed(service_error: str | None) -> None:
    """A failed Service apply fails the handler, so Kopf retries it as any failed apply."""
    if service_error is not None:
        raise KubeError(500, "ApplyFailed", service_error)


@dataclasses.dataclass(frozen=True)
class Reconciled:
    outcome: str  # "success" | "degraded" (no usable gate: nothing applied)
    service: PendingService | None = None  # None: the Service was not applied (unchanged, or no gate)


def start_service_apply(kube: Kube, key: tuple[str, str], service: Mapping[str, Any],
                        applied_objects: AppliedObjects | None,
                        model: Mapping[str, Any] | None = None) -> concurrent.futures.Future[str | None] | None:
    """The model's Service applied in the Service pool, unless unchanged since this process last
    applied it; the future holds the apply's error message (None: it landed). The outcome is
    recorded in ``applied_objects`` by the apply itself, so it counts even if nobody waits.
    ``model``: a model whose objects may not be its own yet (``claims_checked``): a Service of
    that name that is someone else's is refused (``check_not_foreign``)."""
    started = time.monotonic()
    if applied_objects is not None:
        if applied_objects.unchanged(key, service, now=started):
            return None
        applied_objects.begin(key, service)  # status written meanwhile holds Ready back
    wait = metrics.POOL_WAIT.labels(pool="service", work="service_apply")

    def apply() -> str | None:
        wait.observe(time.monotonic() - started)
        with metrics.observe("Service") as outcome:
            try:
                if model is not None:
                    check_not_foreign(kube, model, service)
                answer = kube.apply(service)
            except Exception as e:  # noqa: BLE001 - any failure is the model's to report, and ends the in-flight mark
                outcome.value = "failed"
                error = str(e) if isinstance(e, KubeError) else f"{type(e).__name__}: {e}"
                if applied_objects is not None:
                    applied_objects.record_failure(key, service, error)
                return error
            if applied_objects is not None:
                applied_objects.record(key, service, now=started, answer=answer)
            return None

    future = _SERVICE_POOL.submit(apply)
    with _service_applies_lock:
        _service_applies.add(future)
    future.add_done_callback(_service_apply_done)
    return future


def _service_apply_done(future: concurrent.futures.Future[str | None]) -> None:
    with _service_applies_lock:
        _service_applies.discard(future)


def drain_service_applies() -> None:
    """Operator shutdown (``sparsegate.main.finish_pool_work``): drop the Service applies only
    queued, wait for those running, so none lands once Kopf has returned (and the Lease is handed
    over). Their handlers, cancelled by Kopf, no longer wait for them."""
    with _service_applies_lock:
        futures = list(_service_applies)
    for future in futures:
        future.cancel()  # only one that has not started
    concurrent.futures.wait(futures)


def service_ref(name: str) -> dict[str, Any]:
    """The kind and name ``controllers.applied_objects`` knows model ``name``'s Service by (``render.render_service``)."""
    return {"kind": "Service", "metadata": {"name": name}}


StatusCompute = Callable[[bool], dict[str, Any] | None]  # service_applied → the status patch (None: no change)


def with_service(applied_objects: AppliedObjects | None, key: tuple[str, str], compute: StatusCompute) -> dict[str, Any] | None:
    """``compute`` told whether the model's Service is applied. While its apply is in flight or the
    last one failed, Ready is held back (callers find the model through its Service): such a
    write is remembered (``AppliedObjects.hold``) so ``PendingService.finish`` writes status again
    once it lands; one that landed between the check and the hold is written as applied."""
    ref = service_ref(key[1])
    if applied_objects is None or not applied_objects.unapplied(key, ref):
        return compute(True)
    patch = compute(False)
    held = any(cond.get("type") == conditions.ConditionType.READY.value
               and cond.get("reason") == conditions.Reason.SERVICE_NOT_APPLIED.value
               for cond in (patch or {}).get("conditions") or [])
    if not held or applied_objects.hold(key, ref):
        return patch
    return compute(True)


def reconcile(kube: Kube, model: Mapping[str, Any], *, events: EventSink, logger: logging.Logger,
              watched_deployment: WatchedDeployment, watched_gate: WatchedGate, status_inputs: StatusInputs,
              pods: Iterable[Mapping[str, Any]] = (), default_image: render.DefaultImage | None = None,
              applied_objects: AppliedObjects | None = None) -> Reconciled:
    """Bring the owned objects and status in line with ``model`` (as the event delivered it or as
    just read); returns the outcome and the Service apply still in flight (``PendingService``: the
    caller finishes it).

    ``watched_deployment``: the model's Deployment as the operator's watch last delivered it
    (``domain.fleet_view.deployment_view``), read again at each status write attempt.
    ``watched_gate``: the GateConfigs as watched; the model's is read once, here.
    ``pods``: the model's pods as watched (their waiting reasons go into Ready). ``default_image``:
    for models without ``spec.image``; None reads the operator's env (SPARSEGATE_MODEL_IMAGE /
    _PULL_POLICY, set by the chart from modelServer.image). ``applied_objects``: what this process
    last applied (``apply_owned``); None applies everything."""
    meta = model["metadata"]
    key = (meta["namespace"], meta["name"])
    default_image = default_image or render.DefaultImage.from_env(os.environ)
    resolution = resolve_gate(model, watched_gate)
    applied: Mapping[str, Any] | None = None
    apply_error: str | None = None
    service_apply: concurrent.futures.Future[str | None] | None = None
    assumed: str | None = None
    if resolution.document is not None:
        objects = render.render_applied(model, resolution.document, default_image=default_image)
        service = next(obj for obj in objects if obj["kind"] == "Service")
        assumed = applied_objects.failure(key, service) if applied_objects is not None else None
        # Also while its last apply failed or is in flight: status may not say so yet.
        unclaimed = not claims_checked(model) or (applied_objects is not None and applied_objects.unapplied(key, service))
        service_apply = start_service_apply(kube, key, service, applied_objects, model=model if unclaimed else None)
        try:
            applied = apply_owned(kube, model, [obj for obj in objects if obj is not service],
                                  events=events, logger=logger, applied_objects=applied_objects)
        except KubeError as e:
            apply_error = str(e)

    def deployment_now() -> Mapping[str, Any] | None:
        if resolution.document is None:
            # No usable gate: what runs was left untouched (it keeps its last gate); report it as watched.
            return watched_deployment()
        # The Deployment controller may have observed our apply already, and the Deployment event
        # handler written Ready from it: the apply's response alone would overwrite that with a
        # stale "not observed yet". Read as late as possible, at each attempt. A refused apply
        # (``applied`` None) leaves the Deployment as it was: report it as watched.
        return newest_deployment(applied, watched_deployment())

    def write_status(current: Mapping[str, Any], service_error: str | None, *, rewrite: bool = False) -> None:
        error = apply_error or service_error

        def compute(current: dict[str, Any], deployment: Mapping[str, Any] | None,
                    problems: list[str]) -> dict[str, Any] | None:
            if rewrite and not _gate_written(current, resolution):
                # A newer reconcile (a re-render for another gate, ``handlers.gatebinding``) wrote
                # status since this one did: its gate and Degraded stand; only what the Service's
                # outcome moves (Ready, from the Deployment as now) is refreshed.
                return with_service(applied_objects, key, lambda service_applied: model_status.after_deployment_event(
                    model=current, deployment=deployment, now=now(), problems=problems,
                    service_applied=service_applied))
            return with_service(applied_objects, key, lambda service_applied: model_status.after_reconcile(
                model=current, generation=meta.get("generation"), gate=resolution,
                deployment=deployment, apply_error=error, now=now(), problems=problems,
                service_applied=service_applied, gate_applied=apply_error is None))

        with status_inputs.guard(meta["namespace"], meta["name"]):
            _write_status(kube, current, events=events, status_inputs=status_inputs, pods=pods,
                          deployment=deployment_now, compute=compute)

    def rewrite_status(service_error: str | None) -> None:
        current = kube.get("SparseModel", namespace=meta["namespace"], name=meta["name"])
        # Only the model this reconcile was for: ``_write_status`` checks the uid of the object it
        # is given, and this one was just read, so a model re-created under the name would pass.
        # Nor once its spec moved on: that generation's reconcile writes status (a re-render from
        # handlers.gatebinding runs beside Kopf's handler, which may have written it already), and
        # this one's would set observedGeneration back (kstatus InProgress for good).
        if current is not None and current["metadata"].get("uid") == meta.get("uid") \
                and current["metadata"].get("generation") == meta.get("generation"):
            write_status(current, service_error, rewrite=True)

    write_status(model, assumed)
    if apply_error:
        raise KubeError(500, "ApplyFailed", apply_error)
    if resolution.document is None:
        return Reconciled("degraded")
    held = (lambda: applied_objects.take_held(key, service_ref(meta["name"]))) if applied_objects is not None \
        else (lambda: False)
    pending = PendingService(service_apply, assumed, rewrite_status, held) if service_apply is not None else None
    return Reconciled("success", pending)


def _gate_written(model: Mapping[str, Any], resolution: gate.GateResolution) -> bool:
    """True if ``model``'s status names the gate ``resolution`` rendered (its reconcile's status
    write, or a later one's from the same gate)."""
    status = model.get("status") or {}
    document = resolution.document
    return document is not None and (status.get("gateVersion"), status.get("gateChecksum")) == \
        (document.version, document.checksum)


def live_owner(kube: Kube, *, namespace: str, name: str,
               owner_refs: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The SparseModel that owned a deleted Deployment, if it still exists and is not deleting."""
    model = kube.get("SparseModel", namespace=namespace, name=name)
    if model is None or model["metadata"].get("deletionTimestamp"):
        return None
    uids = {ref.get("uid") for ref in owner_refs if ref.get("kind") == render.KIND}
    return model if model["metadata"].get("uid") in uids else None


def model_uid(deployment: Mapping[str, Any] | None) -> str | None:
    """The uid of the SparseModel controlling ``deployment`` (the object or its view)."""
    ref = controller_ref(deployment) if deployment is not None else None
    return ref.get("uid") if ref is not None and ref.get("kind") == render.KIND else None


def refresh_from_deployment(kube: Kube, *, namespace: str, name: str, deployment: Mapping[str, Any] | None,
                            pods: Iterable[Mapping[str, Any]], events: EventSink,
                            status_inputs: StatusInputs, applied_objects: AppliedObjects | None = None) -> bool:
    """The model's Deployment (or one of its pods) changed: refresh replica counts, Ready,
    Progressing, Reconciling and Stalled. ``deployment``: the object or its watched view; None when it is gone. Returns
    False when the status was already written from these very inputs (no request sent).
    ``applied_objects``: whether the model's Service is applied (``with_service``)."""
    with status_inputs.guard(namespace, name):
        return _refresh(kube, namespace=namespace, name=name, deployment=deployment, pods=list(pods),
                        events=events, status_inputs=status_inputs, applied_objects=applied_objects)


def refresh_from_watched(kube: Kube, *, namespace: str, name: str, deployment: WatchedDeployment,
                         pods: Callable[[], Iterable[Mapping[str, Any]]], events: EventSink,
                         status_inputs: StatusInputs, applied_objects: AppliedObjects | None = None) -> bool:
    """A deferred refresh (``controllers.deferred_refresh``): as :func:`refresh_from_deployment`,
    with the Deployment view and the pods read under the model's guard. A deferred refresh runs
    beside the Deployment's own event handling, so inputs read before taking the guard could be
    older than those a write that took it first recorded, and would overwrite a newer status
    (seen at 1,000 models: a model left at 1/2 ready). Returns False when nothing was sent; a
    Deployment gone meanwhile is left to its DELETED event."""
    with status_inputs.guard(namespace, name):
        current = deployment()
        if current is None:
            return False
        return _refresh(kube, namespace=namespace, name=name, deployment=current, pods=list(pods()),
                        events=events, status_inputs=status_inputs, applied_objects=applied_objects)


def _refresh(kube: Kube, *, namespace: str, name: str, deployment: Mapping[str, Any] | None,
             pods: list[Mapping[str, Any]], events: EventSink, status_inputs: StatusInputs,
             applied_objects: AppliedObjects | None = None) -> bool:
    """The refresh itself; the caller holds the model's guard."""
    inputs = model_status.workload_inputs(deployment, pods)
    if status_inputs.matches(namespace, name, uid=model_uid(deployment), inputs=inputs):
        return False
    current = kube.get("SparseModel", namespace=namespace, name=name)
    if current is None:
        return True
    _write_status(kube, current, events=events, status_inputs=status_inputs, pods=pods,
                  deployment=lambda: deployment,
                  compute=lambda m, d, problems: with_service(
                      applied_objects, (namespace, name), lambda service_applied: model_status.after_deployment_event(
                          model=m, deployment=d, now=now(), problems=problems, service_applied=service_applied)))
    return True


def _write_status(kube: Kube, model: Mapping[str, Any], *, events: EventSink, status_inputs: StatusInputs,
                  pods: Iterable[Mapping[str, Any]], deployment: WatchedDeployment,
                  compute: Callable[[dict[str, Any], Mapping[str, Any] | None, list[str]], dict[str, Any] | None]) -> None:
    """Read-modify-write of the model's status; the caller holds ``status_inputs.guard`` for it.

    The first attempt starts from ``model`` as the caller has it (delivered or just read; a 409
    reads it again). Each attempt reads ``deployment()`` again and derives the pods' problems from
    it; the inputs of the attempt that landed (or found nothing to change) are recorded in
    ``status_inputs``."""
    meta = model["metadata"]
    pods = list(pods)
    seen: dict[str, Any] = {}

    def mutate(current: dict[str, Any]) -> dict[str, Any] | None:
        seen.clear()
        if current["metadata"].get("uid") != meta.get("uid"):
            return None  # deleted and re-created under the same name: not ours to write
        dep = deployment()
        problems = container_problems(pods, deployment=dep)
        patch = compute(current, dep, problems)
        seen["inputs"] = model_status.workload_inputs(dep, pods)
        seen["before"] = (current.get("status") or {}).get("conditions") or []
        seen["after"] = patch.get("conditions", []) if patch else seen["before"]
        return patch

    written = kube.update_status("SparseModel", namespace=meta["namespace"], name=meta["name"],
                                 mutate=mutate, current=dict(model))
    if written is None or "inputs" not in seen:
        return
    status_inputs.record(meta["namespace"], meta["name"], uid=meta.get("uid"), inputs=seen["inputs"])
    for cond in conditions.transitions(seen["before"], seen["after"]):
        warn = (cond["type"] in (conditions.ConditionType.DEGRADED.value, conditions.ConditionType.STALLED.value)
                and cond["status"] == "True") \
            or (cond["type"] == conditions.ConditionType.READY.value and cond["status"] != "True"
                and cond.get("reason") != conditions.Reason.REPLICAS_NOT_READY.value)
        events(written, "Warning" if warn else "Normal", f"{cond['type']}{cond['status']}",
               f"{cond.get('reason')}: {cond.get('message')}")


def stale_models(gate_config: Mapping[str, Any] | None, models: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names of the models (SparseModels or their ``domain.fleet_view`` views) referencing
    ``gate_config`` (None: it is gone) whose rendered gate differs from what it now resolves to, or
    whose Degraded condition no longer matches whether there is a gate at all (Degraded for want of a
    gate, ``conditions.gate_unavailable``: a model whose apply was refused has its gate, and is not
    stale for it, else every event of its GateConfig, a status write each rollout tick, re-applied it).

    A model never reconciled yet (neither a gate version nor Degraded in its status) is not
    stale: its own pending reconcile resolves the gate (reconciling it from here as well only
    repeated the same work during a mass create)."""
    out = []
    for model in models:
        status = model.get("status") or {}
        degraded = conditions.gate_unavailable(status.get("conditions") or [])
        if not status.get("gateVersion") and not degraded:
            continue
        experts = int(((model.get("spec") or {}).get("model") or {}).get("experts") or 0)
        resolution = gate.resolve(gate_config, referenced=True, num_experts=experts)
        want = resolution.document.version if resolution.document else None
        if want != status.get("gateVersion") or degraded != (want is None):
            out.append(model["metadata"]["name"])
    return sorted(out)
