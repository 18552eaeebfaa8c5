"""SparseModel access rules → every pod's ``/admin/access`` (``spec.access.requestAuth: Enforce``).

A loop per SparseModel (``handlers.periodic``: no finalizer) runs :meth:`AccessSync.tick`: compile
the model's access document from the RoutingPolicies Kopf indexes (``handlers.routingpolicy``),
read what each pod holds (``GET /admin/access``), ``PUT`` the document to every pod that holds
another revision or none, and write condition ``AccessRulesApplied`` and ``status.accessRevision``
(``domain.access_sync``). Pods get the admin token only after the owner checks of the rollout
controller (``RolloutLoop.fleet``), over the same pinned TLS channel.

A model that neither enforces nor still reports the condition has no loop at all. The loop runs
every ``SPARSEGATE_ACCESS_RESYNC_S`` (default 5) and at once when the model changes,
a RoutingPolicy of its namespace changes or goes, or one of its pods changes (a new or restarted
pod holds no rules). Errors become the condition (or a log line when even status cannot be
written); a model that does not enforce only has the condition removed.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import kopf
import prometheus_client

from sparsegate_contracts import names

from sparsegate import envvars
from sparsegate.clients.kube import Kube, KubeError
from sparsegate.clients.podadmin import PodAdmin
from sparsegate.domain import access_sync
from sparsegate.domain.policy import DEFAULT_TRUST_DOMAIN, PolicySource
from sparsegate.controllers.inventory import Inventory
from sparsegate.controllers.rollout import FleetCache, RolloutLoop
from sparsegate.handlers.periodic import ObjectLoops

GROUP, VERSION = names.GROUP, names.VERSION
TICK_S = envvars.seconds("SPARSEGATE_ACCESS_RESYNC_S", 5.0)

PUSHES = prometheus_client.Counter(
    "sparsegate_access_pushes_total", "PUT /admin/access calls by result (ok, error).", ["result"])

log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class AccessSync:
    def __init__(self, *, kube: Kube, admin: PodAdmin | None = None,
                 trust_domain: str = DEFAULT_TRUST_DOMAIN) -> None:
        self.kube = kube
        self.admin = admin or PodAdmin()
        self.fleets = RolloutLoop(kube=kube, admin=self.admin)
        self.trust_domain = trust_domain

    async def tick(self, *, namespace: str, name: str, sources: Iterable[PolicySource], cache: FleetCache,
                   inventory: Inventory,
                   logger: logging.Logger | logging.LoggerAdapter = log) -> dict[str, str] | None:
        """One round for one model; returns the condition written (None: the model does not enforce)."""
        model = await asyncio.to_thread(self.kube.get, "SparseModel", namespace=namespace, name=name)
        if model is None or model["metadata"].get("deletionTimestamp"):
            return None
        if not access_sync.enforced(model):
            await self._write(model, wanted=None, revision=None)
            return None
        try:
            document = access_sync.model_document(model, sources, trust_domain=self.trust_domain)
        except (ValueError, KeyError, TypeError) as e:
            wanted = access_sync.condition(revision=None, pods=(), held={}, error=f"{type(e).__name__}: {e}")
            await self._write(model, wanted=wanted, revision=None)
            return wanted
        revision = document["revision"]
        fleet = await self.fleets.fleet(namespace=namespace, models=[name], inventory=inventory)
        targets = await self.fleets.credentials(namespace=namespace, fleet=fleet, pods=fleet.targets, cache=cache)
        answers = await self.admin.access(list(targets.values()))
        held = {p: access_sync.PodAccess(name=p, revision=a.revision, error=a.error) for p, a in answers.items()}
        push = access_sync.pods_to_push(revision, reachable=sorted(targets), held=held)
        if push:
            # ifSequence: applied only over what the pod answered above, so this PUT arriving late
            # (after a newer round's push) is refused rather than put older rules back.
            pushed = await self.admin.push_access(
                [(targets[p], document if (seq := answers[p].sequence) is None else {**document, "ifSequence": seq})
                 for p in push])
            for p, a in pushed.items():
                PUSHES.labels(result="ok" if a.revision == revision else "error").inc()
                held[p] = access_sync.PodAccess(name=p, revision=a.revision, error=a.error)
        # A pod that keeps refusing is pushed again every round: warned about when it starts or its
        # error changes, at DEBUG after (the rollout's pushes are logged alike).
        RolloutLoop.log_push_failures(
            [(p, None if a.revision == revision else (a.error or f"it holds {a.revision}"))
             for p, a in held.items() if p in push or (p in targets and a.revision == revision)],
            pods=fleet.targets, cache=cache, logger=logger, what=f"access rules for {namespace}/{name} on pod %s")
        wanted = access_sync.condition(revision=revision, rules=len(document["rules"]), pods=fleet.all_pods,
                                       held=held, withheld={p: why for p, (_, why) in fleet.withheld.items()})
        await self._write(model, wanted=wanted, revision=revision)
        return wanted

    async def _write(self, model: Mapping[str, Any], *, wanted: Mapping[str, str] | None,
                     revision: str | None) -> None:
        meta = model["metadata"]

        def mutate(current: dict[str, Any]) -> dict[str, Any] | None:
            if current["metadata"].get("uid") != meta.get("uid"):
                return None  # re-created under the same name: its own loop writes it
            return access_sync.status_patch(current.get("status") or {}, wanted=wanted, revision=revision,
                                            generation=current["metadata"].get("generation"), now=_now())

        await asyncio.to_thread(self.kube.update_status, "SparseModel", namespace=meta["namespace"],
                                name=meta["name"], mutate=mutate)


# ---------------------------------------------------------------- Kopf wiring

_loops = ObjectLoops(kind="SparseModel access", interval_s=TICK_S)


def new_access_sync(kube: Kube) -> AccessSync:
    """The one access controller of every model's loop (``sparsegate.main`` puts it in the
    operator's memo at startup); each model's FleetCache stays in its own memo."""
    return AccessSync(kube=kube, trust_domain=os.environ.get("SPARSEGATE_TRUST_DOMAIN", DEFAULT_TRUST_DOMAIN))


def _sync(memo: kopf.Memo) -> AccessSync:
    sync = getattr(memo, "access_sync", None)
    if sync is None:  # a memo made before startup ran (tests)
        sync = memo.access_sync = new_access_sync(memo.kube)
    if getattr(memo, "access_cache", None) is None:  # this model's own
        memo.access_cache = FleetCache()
    return sync


def _sources(index: kopf.Index, namespace: str) -> list[PolicySource]:
    return [p for store in index.values() for p in store if p.namespace == namespace]


@kopf.on.event(GROUP, VERSION, names.SPARSEMODELS)
async def sparsemodel_access_loop(type: str | None, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                                  sparsegate_routing_policies: kopf.Index, logger: logging.Logger,
                                  **kwargs: Any) -> None:
    """Runs the model's access round every TICK_S, and at once after each change of the model."""
    inventory = Inventory.from_kopf(kwargs)

    async def tick(seen: Mapping[str, Any]) -> None:
        if not access_sync.enforced(seen) and not access_sync.reported(seen):
            return  # not enforcing, nothing to remove: not even a GET
        sync = _sync(memo)
        try:
            await sync.tick(namespace=namespace, name=name, cache=memo.access_cache, inventory=inventory,
                            logger=logger, sources=_sources(sparsegate_routing_policies, namespace))
        except KubeError as e:
            logger.warning("access rules round for %s/%s: %s", namespace, name, e)

    if not access_sync.enforced(body) and not access_sync.reported(body):
        # Nothing to apply or remove: no loop and no copy of the body (most models, at 10,000 of them).
        # By uid: an earlier model of the name (its DELETED handled late) leaves a re-created one's loop.
        _loops.discard((namespace, name), uid=body.get("metadata", {}).get("uid"))
        return
    if _loops.seen(key=(namespace, name), event_type=type, body=dict(body), tick=tick, logger=logger):
        _loops.wake([(namespace, name)])


@kopf.on.event(GROUP, VERSION, names.ROUTINGPOLICIES)
async def routing_policy_changed_access(namespace: str, **_: Any) -> None:
    """A RoutingPolicy was created, changed or deleted: every model of its namespace recompiles now
    (the index already holds the change when this runs)."""
    _loops.wake([k for k in _loops.keys() if k[0] == namespace])


@kopf.on.event("", "v1", "pods", labels={names.NAME_LABEL: names.MODEL_SERVER_NAME})
async def model_pod_changed_access(body: kopf.Body, namespace: str, **_: Any) -> None:
    """A model pod appeared, got its address, restarted or went: its model's round runs now."""
    model = (body.get("metadata", {}).get("labels") or {}).get(names.MODEL_LABEL)
    if model:
        _loops.wake([(namespace, model)])


@kopf.on.cleanup()
async def stop_access_loops(**_: Any) -> None:
    await _loops.stop()
