"""Operator entry for Kopf: registers every handler and configures the framework.

Settings chosen here:
- persistence under ``sparsegate.dev`` annotations (not ``status.kopf``: the CRD schemas are
  structural and would prune unknown status fields) for handler progress, which is written only
  while a handler retries; the last handled essence is kept in this process
  (``handlers.diffbase``), so a handled change costs no write of Kopf's own;
- scanning disabled: the CRDs come from the chart before the operator starts, so the operator
  needs no cluster-wide CRD/namespace watch permissions (least privilege);
- peering: off with ``sparsegate run --standalone`` (the chart always passes it); a single active
  replica is kept by the chart (replicas 1, Recreate) or, for HA, by the Lease in
  ``sparsegate.clients.leader``;
- events from logs only at WARNING+ (explicit transition events are posted by the handlers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

import kopf

from sparsegate_contracts.names import FINALIZER, KOPF_ANNOTATION_PREFIX

import sparsegate.handlers  # noqa: F401  (registers handlers)
from sparsegate.clients.kube import Kube
from sparsegate.controllers.applied_objects import DEFAULT_INTERVAL_S, AppliedObjects
from sparsegate.controllers.deferred_refresh import DeferredRefreshes
from sparsegate.controllers.status_inputs import StatusInputs
from sparsegate.handlers import accesssync, defaultgate, diffbase, gateconfig, modelsync, progress, sparsemodel

# Threads for model status refreshes (handlers.pools.run_status_work); reconciles keep Kopf's 8.
STATUS_POOL_THREADS = 4


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # No handler needs a finalizer any more; naming ours lets Kopf remove it from objects that
    # earlier operator versions marked (their deletion would otherwise wait for us).
    settings.persistence.finalizer = FINALIZER
    # Kopf's annotation storage, a malformed record read as none (handlers.progress: it stopped the operator).
    settings.persistence.progress_storage = progress.ProgressStorage(prefix=KOPF_ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = diffbase.STORAGE  # in this process, not an annotation per change
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "sparsegate"
    settings.execution.max_workers = 8
    settings.watching.server_timeout = 300
    # Services and ConfigMaps are watched only for a model's own being deleted or written by someone else
    # (sparsemodel.owned_object_deleted, owned_object_changed): the API server sends only those, not every
    # Service and ConfigMap of the served namespaces.
    for plural in ("services", "configmaps"):
        settings.watching.label_selectors["", "v1", plural] = sparsemodel.OWNED_SELECTOR
    memo.kube = Kube.from_environment()
    memo.model_pool = settings.execution.executor  # handlers.pools: the model handlers' blocking work
    # handlers.pools.run_status_work: status refreshes, never queued behind reconciles.
    memo.status_pool = concurrent.futures.ThreadPoolExecutor(max_workers=STATUS_POOL_THREADS,
                                                             thread_name_prefix="sparsegate-status")
    memo.status_inputs = StatusInputs()  # what each model's status was last written from
    # What each model's reconcile last applied (`sparsegate run --reapply-interval` sets the interval).
    memo.applied_objects = AppliedObjects(interval_s=memo.get("reapply_interval_s", DEFAULT_INTERVAL_S))
    memo.deferred_refreshes = DeferredRefreshes(delay_s=sparsemodel.STATUS_SETTLE_S)
    # One controller each, shared by every object's loop (each object's memo reads through to this one:
    # sparsegate.memo).
    memo.rollout_loop = gateconfig.new_rollout_loop(memo.kube)
    memo.access_sync = accesssync.new_access_sync(memo.kube)
    memo.default_gate_sync = defaultgate.DefaultGateSync(kube=memo.kube)


def drain_pools(pools: list[concurrent.futures.Executor]) -> None:
    """Wait for the work already running in ``pools``; drop what is only queued (nobody awaits it)."""
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)


@kopf.on.cleanup()
async def finish_pool_work(memo: kopf.Memo, **_: Any) -> None:
    """When Kopf stops, it cancels the handlers awaiting the model and status pools, not the work
    they handed to those threads: a reconcile or status refresh already running went on writing
    after ``kopf.run`` returned, when ``sparsegate run --leader-elect`` had already handed the
    Lease to a standby, which then acted beside it. Wait for it here, while the event loop still
    answers the pool threads' index reads (``handlers.pools.loop_reader``), so nothing of this
    process writes once Kopf has returned (the Lease is renewed meanwhile)."""
    pools = [p for p in (memo.get("model_pool"), memo.get("status_pool")) if p is not None]
    await asyncio.to_thread(drain_pools, pools)
    # The models' Service applies, which no reconcile waits for (started by those just drained too).
    await asyncio.to_thread(modelsync.drain_service_applies)


@kopf.on.probe(id="handlers")
def probe_handlers(**_: Any) -> str:
    """Liveness detail: the probe only answers while Kopf's event loop is responsive."""
    return "ok"
