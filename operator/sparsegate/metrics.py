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
import threading
import time
from collections.abc import Mapping
from typing import Any, Iterator

import prometheus_client

from sparsegate.domain.rollout import Phase
from sparsegate.domain.rollout_gauges import Role, rollout_gauges

RECONCILES = prometheus_client.Counter(
    "sparsegate_operator_reconciles_total", "Reconciles by resource kind and outcome.",
    ["kind", "outcome"])
ERRORS = prometheus_client.Counter(
    "sparsegate_operator_reconcile_errors_total", "Reconciles that raised, by kind.", ["kind"])
DURATION = prometheus_client.Histogram(
    "sparsegate_operator_reconcile_duration_seconds", "Reconcile wall time by kind.", ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


class Outcome:
    """Mutable outcome a reconcile may downgrade (e.g. to ``degraded``) before it returns."""

    def __init__(self) -> None:
        self.value = "success"


@contextlib.contextmanager
def observe(kind: str) -> Iterator[Outcome]:
    outcome = Outcome()
    ERRORS.labels(kind=kind)  # the series exists (at 0) before the first error, so rate() sees it
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
    prometheus_client.start_http_server(port, addr=addr)


# ------------------------------------------------------------------ rollout state per GateConfig

_GC = ["namespace", "gateconfig"]
ROLLOUT_PHASE = prometheus_client.Gauge(
    "sparsegate_rollout_phase",
    "1 for the GateConfig's rollout phase (status.rollout.phase), 0 for every other phase.",
    [*_GC, "phase"])
ROLLOUT_STEP = prometheus_client.Gauge(
    "sparsegate_rollout_step", "Current rollout step, 1-based; 0 when no canary is in flight.", _GC)
ROLLOUT_STEPS = prometheus_client.Gauge(
    "sparsegate_rollout_steps", "Number of steps in spec.rollout.steps, as status records it.", _GC)
ROLLOUT_CANARY_PERCENT = prometheus_client.Gauge(
    "sparsegate_rollout_canary_percent",
    "Percent of instances the current step puts on the canary version; 0 without a canary.", _GC)
ROLLOUT_CANARY_INSTANCES = prometheus_client.Gauge(
    "sparsegate_rollout_canary_instances",
    "Instances assigned the canary version at this step; 0 without a canary.", _GC)
ROLLOUT_INSTANCES = prometheus_client.Gauge(
    "sparsegate_rollout_instances", "Instances of the GateConfig's models at the last check.", _GC)
ROLLOUT_PODS = prometheus_client.Gauge(
    "sparsegate_rollout_pods",
    "Pods by the role (stable, canary, other) of the gate version they reported at the last check.",
    [*_GC, "role"])
ROLLOUT_VERSION = prometheus_client.Gauge(
    "sparsegate_rollout_version_info",
    "1 per role: the stable gate version, and the canary version while one is in flight.",
    [*_GC, "role", "version"])

_PER_GATECONFIG = (ROLLOUT_STEP, ROLLOUT_STEPS, ROLLOUT_CANARY_PERCENT, ROLLOUT_CANARY_INSTANCES,
                   ROLLOUT_INSTANCES)
_lock = threading.Lock()
# (namespace, name) -> label values of the series with changing labels we set last time.
_phases: dict[tuple[str, str], set[str]] = {}
_versions: dict[tuple[str, str], set[tuple[str, str]]] = {}


def observe_gateconfig(*, namespace: str, name: str, status: Mapping[str, Any] | None) -> None:
    """Set the rollout gauges of one GateConfig from its ``status`` (any shape: unknown or
    missing fields read as "nothing in flight")."""
    g = rollout_gauges(status)
    key = (namespace, name)
    with _lock:
        phases = _phases.setdefault(key, set())
        phases.update(p.value for p in Phase)
        if g.phase:
            phases.add(g.phase)
        for phase in phases:
            ROLLOUT_PHASE.labels(namespace, name, phase).set(1.0 if phase == g.phase else 0.0)
        ROLLOUT_STEP.labels(namespace, name).set(g.step)
        ROLLOUT_STEPS.labels(namespace, name).set(g.steps)
        ROLLOUT_CANARY_PERCENT.labels(namespace, name).set(g.canary_percent)
        ROLLOUT_CANARY_INSTANCES.labels(namespace, name).set(g.canary_instances)
        if g.instances is not None:
            ROLLOUT_INSTANCES.labels(namespace, name).set(g.instances)
        for role in (Role.STABLE, Role.CANARY, Role.OTHER):
            ROLLOUT_PODS.labels(namespace, name, role).set(g.pods.get(role, 0))
        now = set(g.versions.items())
        for role, version in _versions.get(key, set()) - now:
            ROLLOUT_VERSION.remove(namespace, name, role, version)
        for role, version in now:
            ROLLOUT_VERSION.labels(namespace, name, role, version).set(1.0)
        _versions[key] = now


def forget_gateconfig(*, namespace: str, name: str) -> None:
    """Drop every rollout series of a deleted GateConfig."""
    key = (namespace, name)
    with _lock:
        for phase in _phases.pop(key, set()):
            ROLLOUT_PHASE.remove(namespace, name, phase)
        for role, version in _versions.pop(key, set()):
            ROLLOUT_VERSION.remove(namespace, name, role, version)
        for role in (Role.STABLE, Role.CANARY, Role.OTHER):
            with contextlib.suppress(KeyError):
                ROLLOUT_PODS.remove(namespace, name, role)
        for gauge in _PER_GATECONFIG:
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)
