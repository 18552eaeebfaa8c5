"""Operator metrics (Prometheus): reconciles by kind and outcome, errors, durations, and the
rollout state of every GateConfig.

Served by prometheus-client's own HTTP server on ``--metrics-port``; Kopf's liveness endpoint
is separate (``--liveness``), so a wedged metrics scrape never fails the liveness probe.

The ``sparsegate_rollout_*`` gauges are derived from each GateConfig's status as the watch
delivers it (``handlers.rollout_metrics``; the reading itself is ``domain.rollout_gauges``), so
they show what the API server holds, including status written by a previous operator process.
They carry the GateConfig's ``namespace``: scrape the operator with ``honor_labels`` (the chart's
monitors do) or Prometheus renames it ``exported_namespace``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
from collections.abc import Mapping
from typing import Any, Iterator

import prometheus_client
from prometheus_client.core import GaugeMetricFamily

from sparsegate.domain import interned
from sparsegate.domain.rollout import Phase
from sparsegate.domain.rollout_gauges import Role, RolloutGauges, rollout_gauges

RECONCILES = prometheus_client.Counter(
    "sparsegate_operator_reconciles_total", "Reconciles by resource kind and outcome.",
    ["kind", "outcome"])
ERRORS = prometheus_client.Counter(
    "sparsegate_operator_reconcile_errors_total", "Reconciles that raised, by kind.", ["kind"])
# How long model work waited before a thread of its pool took it (handlers.pools: "model" for
# reconciles, "status" for status refreshes), by pool and the work's name: with the reconcile
# duration it tells a slow reconcile from a long queue.
POOL_WAIT = prometheus_client.Histogram(
    "sparsegate_operator_model_pool_wait_seconds",
    "Time model work (reconciles, status refreshes, Service applies) waited for a thread of its pool, by pool and work.",
    ["pool", "work"], buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200))
# Up to minutes: at 10,000 models a SparseModel reconcile took p99 ~9 s (tests/bench/HISTORY-bench_scale.md)
# and a GateConfig's re-renders all its models in turn; above the last finite bucket histogram_quantile
# can only answer that bucket's bound.
DURATION = prometheus_client.Histogram(
    "sparsegate_operator_reconcile_duration_seconds", "Reconcile wall time by kind.", ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))


# Python's cyclic garbage collections: each holds the GIL, so every thread (reconciles, the event
# loop) waits for it; a full one walks every tracked object (~0.5 s per 850,000 at 10,000 models).
GC_PAUSE = prometheus_client.Histogram(
    "sparsegate_operator_gc_pause_seconds",
    "Python cyclic garbage collections by generation: how long each stopped every thread.",
    ["generation"], buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))


class _GcTimer:
    """A ``gc.callbacks`` entry observing each collection into GC_PAUSE (collections never overlap:
    they run under the GIL)."""

    def __init__(self) -> None:
        self.children = [GC_PAUSE.labels(generation=str(g)) for g in range(3)]
        self.started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.children[min(info["generation"], 2)].observe(time.perf_counter() - self.started)


_gc_timer = _GcTimer()


def time_gc() -> None:
    """Observe every cyclic collection from now on into ``sparsegate_operator_gc_pause_seconds``
    (idempotent)."""
    if _gc_timer not in gc.callbacks:
        gc.callbacks.append(_gc_timer)


class Outcome:
    """Mutable outcome a reconcile may downgrade (e.g. to ``degraded``) before it returns."""

    def __init__(self) -> None:
        self.value = "success"


@contextlib.contextmanager
def observe(kind: str) -> Iterator[Outcome]:
    outcome = Outcome()
    ERRORS.labels(kind=kind)  # the series exists (at 0) before the first error, so rate() sees it
    RECONCILES.labels(kind=kind, outcome="error")  # likewise
    start = time.perf_counter()
    try:
        yield outcome
    except BaseException:
        ERRORS.labels(kind=kind).inc()
        outcome.value = "error"
        raise
    finally:
        DURATION.labels(kind=kind).observe(time.perf_counter() - start)
        RECONCILES.labels(kind=kind, outcome=outcome.value).inc()


def serve(*, port: int, addr: str = "0.0.0.0") -> None:
    time_gc()
    prometheus_client.start_http_server(port, addr=addr)


# ------------------------------------------------------------------ rollout state per GateConfig

_GC = ("namespace", "gateconfig")
# name → (help, extra label). Exported by :class:`RolloutCollector` from one small record per
# GateConfig: a labelled prometheus_client child per series cost ~12 KiB per GateConfig (17 series),
# ~25 MiB at 2,000 GateConfigs.
_ROLLOUT_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sparsegate_rollout_phase": (
        "1 for the GateConfig's rollout phase (status.rollout.phase), 0 for every other phase.", ("phase",)),
    "sparsegate_rollout_step": ("Current rollout step, 1-based; 0 when no canary is in flight.", ()),
    "sparsegate_rollout_steps": ("Number of steps in spec.rollout.steps, as status records it.", ()),
    "sparsegate_rollout_canary_percent": (
        "Percent of requests (strategy requests) or of instances (strategy instances) the current step "
        "puts on the canary version; 0 without a canary.", ()),
    "sparsegate_rollout_canary_instances": ("Instances assigned the canary version at this step; 0 without a canary.", ()),
    "sparsegate_rollout_instances": ("Instances of the GateConfig's models at the last check.", ()),
    "sparsegate_rollout_pods": (
        "Pods by the role (stable, canary, other) of the gate version they reported at the last check.", ("role",)),
    "sparsegate_rollout_version_info": (
        "1 per role: the stable gate version, and the canary version while one is in flight.", ("role", "version")),
}
# SparseModel → the GateConfig its spec.gateConfigRef names: versions are content addresses, so two
# GateConfigs with the same params share a version id and the dashboard's canary-vs-stable joins
# need this to keep one GateConfig's panels to its own models.
_MODEL_INFO = ("sparsegate_gateconfig_model_info",
               "1 per SparseModel whose spec.gateConfigRef names the GateConfig (label model: the SparseModel).")
_ALL_PHASES = frozenset(p.value for p in Phase)
_ROLES = (Role.STABLE, Role.CANARY, Role.OTHER)


@dataclasses.dataclass
class _RolloutRecord:
    gauges: RolloutGauges
    phases: frozenset[str]  # every phase value exported (0 or 1) for this GateConfig
    instances: int | None  # the last recorded instance count (kept while status records none)


class RolloutCollector:
    """The ``sparsegate_rollout_*`` gauges of every GateConfig, built at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[str, str], _RolloutRecord] = {}
        self._models: dict[tuple[str, str], str] = {}  # (namespace, SparseModel) -> GateConfig it names

    def observe(self, namespace: str, name: str, gauges: RolloutGauges) -> None:
        with self._lock:
            old = self._records.get((namespace, name))
            phases = (old.phases if old is not None else _ALL_PHASES) | ({gauges.phase} if gauges.phase else set())
            instances = gauges.instances if gauges.instances is not None else (old.instances if old else None)
            self._records[(namespace, name)] = _RolloutRecord(gauges=gauges, phases=frozenset(phases),
                                                              instances=instances)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._records.pop((namespace, name), None)

    def bind_model(self, namespace: str, model: str, gateconfig: str | None) -> None:
        """``gateconfig``: what the SparseModel's spec.gateConfigRef names (None: none, or deleted)."""
        with self._lock:
            if gateconfig:
                self._models[interned.deep((namespace, model))] = interned.text(gateconfig)  # shared with the indexes
            else:
                self._models.pop((namespace, model), None)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for name, (doc, extra) in _ROLLOUT_FAMILIES.items():
            yield GaugeMetricFamily(name, doc, labels=[*_GC, *extra])
        yield GaugeMetricFamily(*_MODEL_INFO, labels=[*_GC, "model"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            records = sorted(self._records.items())
            models = sorted(self._models.items())
        families = {name: GaugeMetricFamily(name, doc, labels=[*_GC, *extra])
                    for name, (doc, extra) in _ROLLOUT_FAMILIES.items()}
        for (namespace, name), rec in records:
            g, key = rec.gauges, [namespace, name]
            for phase in sorted(rec.phases):
                families["sparsegate_rollout_phase"].add_metric([*key, phase], 1.0 if phase == g.phase else 0.0)
            families["sparsegate_rollout_step"].add_metric(key, g.step)
            families["sparsegate_rollout_steps"].add_metric(key, g.steps)
            families["sparsegate_rollout_canary_percent"].add_metric(key, g.canary_percent)
            families["sparsegate_rollout_canary_instances"].add_metric(key, g.canary_instances)
            if rec.instances is not None:
                families["sparsegate_rollout_instances"].add_metric(key, rec.instances)
            for role in _ROLES:
                families["sparsegate_rollout_pods"].add_metric([*key, role], g.pods.get(role, 0))
            for role, version in sorted(g.versions.items()):
                families["sparsegate_rollout_version_info"].add_metric([*key, role, version], 1.0)
        yield from families.values()
        bound = GaugeMetricFamily(*_MODEL_INFO, labels=[*_GC, "model"])
        for (namespace, model), gateconfig in models:
            bound.add_metric([namespace, gateconfig, model], 1.0)
        yield bound


ROLLOUT = RolloutCollector()
prometheus_client.REGISTRY.register(ROLLOUT)


def observe_gateconfig(*, namespace: str, name: str, status: Mapping[str, Any] | None) -> None:
    """Set the rollout gauges of one GateConfig from its ``status`` (any shape: unknown or
    missing fields read as "nothing in flight")."""
    ROLLOUT.observe(namespace, name, rollout_gauges(status))


def bind_model(*, namespace: str, name: str, gateconfig: str | None) -> None:
    """Record which GateConfig a SparseModel names (None: none, or the model was deleted)."""
    ROLLOUT.bind_model(namespace, name, gateconfig)


def forget_gateconfig(*, namespace: str, name: str) -> None:
    """Drop every rollout series of a deleted GateConfig."""
    ROLLOUT.forget(namespace, name)
