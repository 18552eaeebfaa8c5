"""Kopf wiring of the GateConfig rollout: one watch-driven loop per GateConfig (no finalizer).

The controller itself (observe → decide → persist → act) is ``controllers.rollout.RolloutLoop``;
this module only builds it from the environment, feeds it the models of the Kopf index
``models_by_gate`` and the fleet's watched objects (``handlers.fleetindex``) every
``SPARSEGATE_ROLLOUT_TICK_S`` (default 5) seconds, and turns a conflict or an API error of one
tick into a log line (the next tick starts from a fresh read). A resting GateConfig's loop sleeps
until its safety-net check (``SPARSEGATE_ROLLOUT_RESTING_CHECK_S``, default 300); an event of the
GateConfig, one of its models' pods seen Ready, or a model's ``spec.gateConfigRef`` edited to name
it (``model_gate_changed``: its pods hold the previous GateConfig's gate), brings its next tick
within the tick interval (that tick checks the pods).
``SPARSEGATE_PROMETHEUS_URL`` makes the builtin analysis use Prometheus' HTTP API instead of
scraping pods directly, and is the address of declared ``prometheus`` checks that name none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import envvars
from sparsegate.clients.kube import Conflict, Kube, KubeError
from sparsegate.clients.metrics_source import PrometheusAPI
from sparsegate.controllers.inventory import Inventory
from sparsegate.controllers.rollout import FleetCache, RolloutCache, RolloutLoop
from sparsegate.domain import fleet_view
from sparsegate.handlers import modelsync
from sparsegate.handlers.periodic import ObjectLoops
from sparsegate.repeated_failures import repeats

__all__ = ["FleetCache", "RolloutLoop", "new_rollout_loop"]  # handlers.accesssync builds its fleets with the same loop

GROUP, VERSION = names.GROUP, names.VERSION
TICK_S = envvars.seconds("SPARSEGATE_ROLLOUT_TICK_S", 5.0)
_TICK_ERROR = "rollout_tick_error"  # the GateConfig memo's key of its tick's last failure
PROMETHEUS_URL = os.environ.get("SPARSEGATE_PROMETHEUS_URL") or None


def new_rollout_loop(kube: Kube) -> RolloutLoop:
    """The one rollout controller every GateConfig's loop uses (stateless apart from its clients;
    per-GateConfig state lives in each loop's RolloutCache): ``sparsegate.main`` puts it in the
    operator's memo at startup, which every object's memo reads through to (``sparsegate.memo``)."""
    prometheus = PrometheusAPI(PROMETHEUS_URL) if PROMETHEUS_URL else None
    return RolloutLoop(kube=kube, prometheus=prometheus, prometheus_url=PROMETHEUS_URL)


def _loop(memo: kopf.Memo) -> RolloutLoop:
    loop = getattr(memo, "rollout_loop", None)
    if loop is None:  # a memo made before startup ran (tests)
        loop = memo.rollout_loop = new_rollout_loop(memo.kube)
    return loop


_loops = ObjectLoops(kind="GateConfig", interval_s=TICK_S)
# Watch events of serving model pods per GateConfig (namespace, name): a resting GateConfig
# checks its pods again when its count moves (``RolloutLoop.tick(pod_changes=)``), not on a timer.
_pod_changes: dict[tuple[str, str], int] = {}


@kopf.on.event(GROUP, VERSION, names.GATECONFIGS)
async def gateconfig_rollout_loop(type: str | None, body: kopf.Body, namespace: str, name: str, memo: kopf.Memo,
                                  models_by_gate: kopf.Index, logger: logging.Logger, **kwargs: Any) -> None:
    """Runs the GateConfig's rollout tick every TICK_S, a resting one's only when something may
    have changed (a loop, not a Kopf timer: no finalizer, so deleting a GateConfig never waits for
    the operator; its rollout state lives in the object)."""
    inventory = Inventory.from_kopf(kwargs)

    async def tick(seen: Mapping[str, Any]) -> float | None:
        return await rollout_tick(seen=seen, namespace=namespace, name=name, memo=memo,
                                  models_by_gate=models_by_gate, inventory=inventory, logger=logger)

    if not _loops.seen(key=(namespace, name), event_type=type, body=RolloutLoop.quiet_view(body), tick=tick,
                       logger=logger):
        _pod_changes.pop((namespace, name), None)
        # Gone: its loop is cancelled (a tick waiting on a check too, not the check's request) and Kopf
        # forgets this memo, so nothing else would cancel its declared checks' measurements in flight.
        cache = getattr(memo, "rollout_cache", None)
        if cache is not None:
            cache.cancel_measurements()


@kopf.on.event("", "v1", "pods", labels={names.NAME_LABEL: names.MODEL_SERVER_NAME})
async def model_pod_changed_rollout(body: kopf.Body, namespace: str, sparsegate_model_views: kopf.Index,
                                    **_: Any) -> None:
    """A model pod is serving (new, back from a restart, or changed while Ready): its GateConfig's
    next tick (within TICK_S) checks the pods even when resting. A nudge, not a wake: a burst of
    pods becoming Ready costs each GateConfig at most one check per tick."""
    model = (body.get("metadata", {}).get("labels") or {}).get(names.MODEL_LABEL)
    if not model or not fleet_view.pod_serving(body):
        return
    gates = {modelsync.gate_ref(view) for view in sparsegate_model_views.get((namespace, model), ())}
    keys = [(namespace, gate) for gate in gates if gate is not None]
    for key in keys:
        _pod_changes[key] = _pod_changes.get(key, 0) + 1
    if len(_pod_changes) > 2 * len(_loops) + 64:
        # Counts of GateConfigs without a loop (deleted, or never created, while models still name
        # them) are read by no tick, and a loop started later checks its pods at its first tick:
        # dropped, or each such name stayed here for the operator's life.
        for stale in [k for k in _pod_changes if k not in _loops]:
            del _pod_changes[stale]
    _loops.nudge(keys)


def model_gate_changed(namespace: str, *, old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> None:
    """A model's ``spec.gateConfigRef`` now names another GateConfig: its running pods still hold the
    gate of the one before (a canary, mid-rollout) and no pod of theirs becomes Ready again, so the
    new GateConfig's next tick (within TICK_S) checks its pods, as after a pod change; a resting one
    would otherwise leave them on the old gate until its safety-net check (RESTING_CHECK_S).
    ``old``: the model as last handled (None: first handled by this process, which checks every
    GateConfig's pods at its first tick anyway)."""
    ref = modelsync.gate_ref(new)
    if old is None or not ref or ref == modelsync.gate_ref(old):
        return
    key = (namespace, ref)
    _pod_changes[key] = _pod_changes.get(key, 0) + 1
    _loops.nudge([key])


async def rollout_tick(*, seen: Mapping[str, Any], namespace: str, name: str, memo: kopf.Memo,
                       models_by_gate: kopf.Index, inventory: Inventory, logger: logging.Logger) -> float | None:
    """One tick; returns how long the loop may sleep before the next (None: TICK_S)."""
    cache = getattr(memo, "rollout_cache", None)
    if cache is None:
        cache = memo.rollout_cache = RolloutCache()
    models = sorted(set(models_by_gate.get((namespace, name), [])))
    loop = _loop(memo)
    try:
        await loop.tick(namespace=namespace, name=name, models=models, cache=cache, inventory=inventory,
                               seen=seen, pod_changes=_pod_changes.get((namespace, name), 0), logger=logger)
    except Conflict:
        logger.debug("GateConfig %s/%s changed during the tick; next tick retries", namespace, name)
    except KubeError as e:
        # A persistent failure (a status write refused by an admission policy or quota, RBAC) fails
        # every tick: a WARNING when it starts or changes, the same one again at DEBUG.
        repeated = repeats(memo, _TICK_ERROR, str(e))
        (logger.debug if repeated else logger.warning)("rollout tick for %s/%s%s: %s", namespace, name,
                                                       " failed again" if repeated else "", e)
        return None
    repeats(memo, _TICK_ERROR, None)  # (the key goes: one on every GateConfig's memo would cost memory)
    return loop.next_tick_in(seen, cache=cache, interval_s=TICK_S)


@kopf.on.cleanup()
async def stop_rollout_loops(**_: Any) -> None:
    await _loops.stop()
