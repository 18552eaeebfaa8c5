"""Operator metrics of the published flow allow-list: what it needs against what fits.

Set by the RoutingPolicy sync each time it compiles an allow-list (``handlers.routingpolicy``);
``sparsegate_flow_policy_too_large`` is 1 while the latest one was not published because it did not
fit (``domain.policy_capacity``), the RoutingPolicies then say ``PolicyTooLarge``.
"""

from __future__ import annotations

import prometheus_client

from sparsegate.domain.policy_capacity import Capacity, Footprint

RECORDS = prometheus_client.Gauge(
    "sparsegate_flow_policy_map_records",
    "Policy map records of the latest compiled flow allow-list (needed) and the limit (capacity).", ["of"])
BYTES = prometheus_client.Gauge(
    "sparsegate_flow_policy_document_bytes",
    "Bytes the latest compiled flow allow-list is published in, head and shards (needed), and the limit: "
    "bytes per ConfigMap x shard ConfigMaps (capacity).", ["of"])
TOO_LARGE = prometheus_client.Gauge(
    "sparsegate_flow_policy_too_large",
    "1 while the latest compiled flow allow-list exceeds a limit and is not published.")


def observe(*, needed: Footprint, capacity: Capacity, too_large: bool) -> None:
    RECORDS.labels(of="needed").set(needed.records)
    RECORDS.labels(of="capacity").set(capacity.max_records)
    BYTES.labels(of="needed").set(needed.bytes)
    BYTES.labels(of="capacity").set(capacity.max_bytes * capacity.max_shards)
    TOO_LARGE.set(1 if too_large else 0)
