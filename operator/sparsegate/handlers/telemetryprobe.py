"""TelemetryProbe → per-node agent configuration, and probe status from the agents' reports.

Every probe and every node feed one configuration ConfigMap (``clients.probe_config``), so each
handler recomputes the whole plan (``domain.telemetry_probe.plan``, pure) from Kopf's in-memory
indexes and publishes it when it changed; node events (added, relabelled, removed) and probe
events both trigger it, and a node event also arrives for every node when the operator starts,
so a probe deleted while the operator was down leaves the configuration then. A loop per probe
(``handlers.periodic``, no finalizer: deleting a probe never waits for the operator) reads the
agents' reports every ``SPARSEGATE_PROBE_RESYNC_SECONDS`` and writes that probe's status; its
sync also compares the configuration ConfigMap with the plan once per interval (shared by all
probes) and publishes again when it was deleted or edited by another writer; a deletion's sync
that fails (after the last probe, no loop is left to sync) is tried again every interval until one
lands. Node events also drop
the reports of nodes that left (agents only add their own key).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import kopf

from sparsegate_contracts import names

from sparsegate import envvars
from sparsegate.clients.kube import Kube
from sparsegate.clients.probe_config import ProbeConfigMaps
from sparsegate.domain.telemetry_probe import (
    NodeInfo,
    Plan,
    ProbeSource,
    node_info,
    observe,
    plan,
    probe_source,
    status_changed,
    status_patch,
)
from sparsegate.handlers.periodic import ObjectLoops, Retries

GROUP, VERSION, PLURAL = names.GROUP, names.VERSION, names.TELEMETRYPROBES
log = logging.getLogger(__name__)
PUBLISH_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    namespace: str  # where the configuration and report ConfigMaps live (the operator's namespace)
    resync_seconds: float

    @classmethod
    def from_env(cls) -> Settings:
        return cls(namespace=os.environ.get("SPARSEGATE_NAMESPACE", "sparsegate-system"),
                   resync_seconds=envvars.seconds("SPARSEGATE_PROBE_RESYNC_SECONDS", 5.0))


class ProbeSync:
    def __init__(self, *, store: ProbeConfigMaps, kube: Kube, recheck_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.kube = kube
        self.lock = asyncio.Lock()
        self.published: dict[str, Any] | None = None  # configs last written or found unchanged
        self.reports_pruned_for: frozenset[str] | None = None  # node names at the last prune
        self.recheck_s = recheck_s  # how often an unchanged plan is compared with the ConfigMap
        self.clock = clock
        self.checked_at: float | None = None
        self.check_error: str | None = None  # the last check's failure, logged once (``_drifted``)

    async def _drifted(self, configs: dict[str, Any]) -> bool:
        """Whether the ConfigMap no longer holds what was published (deleted, edited by hand, pruned
        by a GitOps tool). At most one GET per ``recheck_s`` for all probes together: every probe's
        loop syncs, so a check per sync would cost a GET per probe per interval."""
        now = self.clock()
        if self.checked_at is not None and now - self.checked_at < self.recheck_s:
            return False
        self.checked_at = now
        try:
            drifted = not await self.store.holds(configs)
        except Exception as e:  # the status write still runs; the next interval checks again
            # The API server down fails every check (each recheck_s): a WARNING with the traceback
            # when it starts or changes, the same again at DEBUG.
            error = f"{type(e).__name__}: {e}"
            if error == self.check_error:
                log.debug("cannot read the probe configuration ConfigMap to check it, again: %s", error)
            else:
                log.warning("cannot read the probe configuration ConfigMap to check it", exc_info=True)
            self.check_error = error
            return False
        self.check_error = None
        return drifted

    async def sync(self, *, probes: list[ProbeSource], nodes: list[NodeInfo]) -> Plan:
        async with self.lock:
            current = plan(probes=probes, nodes=nodes)
            if current.too_large:
                # Not publishable: the agents keep the last configuration; every probe's status says why.
                if current.configs != self.published:
                    log.warning("not publishing the probe configuration: %s", current.too_large)
                return current
            # Level-triggered: the cache alone would never write again after someone else's write.
            if current.configs == self.published and await self._drifted(current.configs):
                log.warning("the probe configuration ConfigMap was deleted or changed by another writer; "
                            "publishing it again")
                self.published = None
            if current.configs != self.published:
                # A few quick retries: after the last probe goes no loop is left to try again (until
                # the next node event), and a 409 from a concurrent write clears on a re-read.
                for attempt in range(PUBLISH_ATTEMPTS):
                    try:
                        if await self.store.publish(current.configs):
                            log.info("published the probe configuration for %d node(s)", len(current.configs))
                        break
                    except Exception:
                        if attempt == PUBLISH_ATTEMPTS - 1:
                            raise
                        log.warning("publishing the probe configuration failed; retrying", exc_info=True)
                        await asyncio.sleep(1.0 + attempt)
                self.published = current.configs
                self.checked_at = self.clock()  # just written: no need to read it back soon
            return current

    async def prune_reports(self, node_names: Callable[[], Iterable[str]]) -> None:
        """Drop the report keys of nodes that left; reads the reports only when a node left since the
        last prune (or on the first call: nodes deleted while the operator was down)."""
        async with self.lock:
            names = frozenset(node_names())  # read under the lock, just before the reports
            if self.reports_pruned_for is not None and self.reports_pruned_for <= names:
                self.reports_pruned_for = names  # only additions: nothing to drop
                return
            dropped = await self.store.prune_reports(names)
            if dropped is None:
                return  # an agent wrote meanwhile: the next node event tries again
            if dropped:
                log.info("dropped the probe reports of %d node(s) that left", len(dropped))
            self.reports_pruned_for = names

    async def write_status(self, *, probe: ProbeSource, current: Plan) -> None:
        reports = await self.store.reports()
        observation = observe(probe=probe, plan=current, reports=reports)
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

        def mutate(obj: dict[str, Any]) -> dict[str, Any] | None:
            previous = dict(obj.get("status") or {})
            new = status_patch(probe=probe, observation=observation, previous=previous, now=now)
            return new if status_changed(previous=previous, patch=new) else None

        await asyncio.to_thread(self.kube.update_status, "TelemetryProbe", namespace=probe.namespace,
                                name=probe.name, mutate=mutate)


_sync: ProbeSync | None = None
_settings = Settings.from_env()


def _state() -> ProbeSync:
    global _sync
    if _sync is None:
        kube = Kube.from_environment()
        _sync = ProbeSync(store=ProbeConfigMaps(kube=kube, namespace=_settings.namespace), kube=kube,
                          recheck_s=_settings.resync_seconds)
    return _sync


def _values(index: kopf.Index) -> Iterable[Any]:
    for store in index.values():
        yield from store


def _inputs(kwargs: dict[str, Any]) -> tuple[list[ProbeSource], list[NodeInfo]]:
    probes = sorted(_values(kwargs["sparsegate_telemetry_probes"]), key=lambda p: p.key)
    nodes = sorted(_values(kwargs["sparsegate_probe_nodes"]), key=lambda n: n.name)
    return probes, nodes


@kopf.index(GROUP, VERSION, PLURAL)
async def sparsegate_telemetry_probes(namespace: str, name: str, meta: kopf.Meta, body: kopf.Body, **_: Any) -> dict:
    if meta.get("deletionTimestamp"):
        return {}
    return {(namespace, name): probe_source(dict(body))}


@kopf.index("", "v1", "nodes")
async def sparsegate_probe_nodes(name: str, body: kopf.Body, **_: Any) -> dict:
    return {name: node_info(dict(body))}


@kopf.on.event("", "v1", "nodes")
async def probe_node_event(**kwargs: Any) -> None:
    """A node came, went or changed labels: re-plan (writes only when the configuration changed),
    and drop the reports of nodes that left."""
    probes, nodes = _inputs(kwargs)
    await _state().sync(probes=probes, nodes=nodes)
    await _state().prune_reports(lambda: (n.name for n in _values(kwargs["sparsegate_probe_nodes"])))


_loops = ObjectLoops(kind="TelemetryProbe", interval_s=_settings.resync_seconds, initial_delay_s=0.5)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def telemetry_probe_event(type: str | None, namespace: str, name: str, body: kopf.Body,
                                logger: kopf.Logger, **kwargs: Any) -> None:
    """Re-plan on every change of a probe; its loop then keeps its status current from the reports."""
    picked = {k: kwargs[k] for k in ("sparsegate_telemetry_probes", "sparsegate_probe_nodes")}

    async def refresh(_: Any) -> None:
        probes, nodes = _inputs(picked)
        current = await _state().sync(probes=probes, nodes=nodes)
        mine = next((p for p in probes if p.namespace == namespace and p.name == name), None)
        if mine is not None:
            await _state().write_status(probe=mine, current=current)

    if _loops.seen(key=(namespace, name), event_type=type, body=body, tick=refresh, logger=logger):
        await refresh(body)
        return
    probes, nodes = _inputs(picked)
    try:
        await _state().sync(probes=probes, nodes=nodes)  # deleted: its interfaces leave the configuration
    except Exception as e:  # noqa: BLE001 (retried below)
        # After the last probe no loop is left to sync again: its XDP would stay attached until
        # some node changed (minutes). Sync again until one lands.
        logger.warning(f"publishing the probe configuration after a deletion failed ({e}); retrying "
                       f"every {_settings.resync_seconds:g}s")
        _retries.start("publish", lambda: _published(picked), delay_s=_settings.resync_seconds)


_retries = Retries("TelemetryProbe deletion publish")  # one key: each publish reads every probe


async def _published(picked: dict[str, Any]) -> bool:
    """A deletion's sync again, from the indexes as they are now (raises while publishing fails)."""
    probes, nodes = _inputs(picked)
    await _state().sync(probes=probes, nodes=nodes)
    return True


@kopf.on.cleanup()
async def stop_probe_loops(**_: Any) -> None:
    await _loops.stop()
    await _retries.stop()
