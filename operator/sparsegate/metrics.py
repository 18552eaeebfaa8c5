"""Operator metrics (Prometheus): reconciles by kind and outcome, errors, durations.

Served by prometheus-client's own HTTP server on ``--metrics-port``; Kopf's liveness endpoint
is separate (``--liveness``), so a wedged metrics scrape never fails the liveness probe.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import prometheus_client

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
