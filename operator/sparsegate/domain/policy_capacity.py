"""Does a flow document fit where it is published? (pure)

Limits (``sparsegate_contracts.flowpolicy``): the agent's inner policy map (``MAP_MAX_ENTRIES``
records, minus ``AGENT_RESERVED_RECORDS`` left for the meta record and the node's own addresses),
the rules it counts verdicts for (``MAX_RULES``), the identity numbers (``FIRST_IDENTITY`` ..
``MAX_IDENTITY``) and the ConfigMaps it is published in: a document larger than one ConfigMap
(1 MiB of data, minus headroom) is sharded (``sparsegate_contracts.flowpolicy_shards``) over at
most ``MAX_SHARDS`` of them, so bytes bind only past ~15 MiB, far beyond what the map records
allow. A document over any limit is not published: the agent would refuse it (map) or the API
server would (bytes), and the last published allow-list would stay enforced while nothing said so.
The sync keeps the published one and reports ``PolicyTooLarge`` on the RoutingPolicies instead
(``domain.policy_status``).

Records are counted per address (``flowpolicy.map_records``), whatever its family: a dual-stack
pod is published with its IPv4 and its IPv6 address, so it needs two source records and two
policed-destination records, and the agent keys both families in the same inner map.

The agents' map size is ``SPARSEGATE_FLOW_POLICY_MAP_RECORDS`` (the chart sets it and the agents'
``--policy-map-records`` from one value, ``agent.policyMapRecords``; default
``flowpolicy.MAP_MAX_ENTRIES``). Both limits can be lowered (never raised above the real ones)
through the operator's environment, so that tests can reach them with a handful of pods:
``SPARSEGATE_FLOW_POLICY_MAX_RECORDS`` and ``SPARSEGATE_FLOW_POLICY_MAX_BYTES`` (bytes per ConfigMap:
a smaller value shards small documents).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparsegate_contracts import flowpolicy, flowpolicy_shards
from sparsegate_contracts.flowpolicy import FlowPolicyError

MAP_RECORDS_ENV = "SPARSEGATE_FLOW_POLICY_MAP_RECORDS"
MAX_RECORDS_ENV = "SPARSEGATE_FLOW_POLICY_MAX_RECORDS"
MAX_BYTES_ENV = "SPARSEGATE_FLOW_POLICY_MAX_BYTES"
DEFAULT_MAX_RECORDS = flowpolicy.MAP_MAX_ENTRIES - flowpolicy.AGENT_RESERVED_RECORDS
DEFAULT_MAX_BYTES = flowpolicy_shards.SHARD_MAX_BYTES
MAX_IDENTITIES = flowpolicy.MAX_IDENTITY - flowpolicy.FIRST_IDENTITY + 1


@dataclass(frozen=True)
class Capacity:
    max_records: int = DEFAULT_MAX_RECORDS
    max_bytes: int = DEFAULT_MAX_BYTES  # per ConfigMap: the single layout's policy.json or one shard
    max_shards: int = flowpolicy_shards.MAX_SHARDS
    max_rules: int = flowpolicy.MAX_RULES
    max_identities: int = MAX_IDENTITIES

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Capacity:
        """The limits, lowered by the environment; ValueError naming the variable when it is bad."""
        map_records = _limit(env, MAP_RECORDS_ENV, flowpolicy.MAP_MAX_ENTRIES_LIMIT, floor=flowpolicy.MAP_MIN_ENTRIES,
                             default=flowpolicy.MAP_MAX_ENTRIES)
        records = map_records - flowpolicy.AGENT_RESERVED_RECORDS
        return cls(max_records=_limit(env, MAX_RECORDS_ENV, records),
                   max_bytes=_limit(env, MAX_BYTES_ENV, DEFAULT_MAX_BYTES, floor=flowpolicy_shards.MIN_SHARD_BYTES))


def _limit(env: Mapping[str, str], name: str, ceiling: int, *, floor: int = 1, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return ceiling if default is None else default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: must be an integer, got {raw!r}") from None
    if not floor <= value <= ceiling:
        why = "" if default is not None else " (it can only lower the real limit)"
        raise ValueError(f"{name}: must be in {floor}..{ceiling}{why}, got {value}")
    return value


@dataclass(frozen=True)
class Footprint:
    """What a document needs: map records (besides the agent's reserve), bytes published (the head
    and its shards), shard ConfigMaps (0: the single layout), rules and identities."""

    records: int
    bytes: int
    rules: int = 0
    identities: int = 0
    shards: int = 0

    @classmethod
    def of(cls, document: Mapping[str, Any], *, max_bytes: int = DEFAULT_MAX_BYTES) -> Footprint:
        try:  # counted without the shard limit, so the message can say how many it would take
            layout = flowpolicy_shards.split(document, max_bytes=max_bytes, max_shards=1 << 30)
            size = len(layout.head) + sum(len(text) for _, text in layout.shards)  # ASCII: chars = bytes
            shards = len(layout.shards)
        except FlowPolicyError:  # one item larger than a shard: unpublishable whatever the count
            size, shards = flowpolicy.document_bytes(document), 1 << 30
        return cls(records=flowpolicy.map_records(document), bytes=size, rules=len(flowpolicy.rows_of(document)),
                   identities=len(document.get(flowpolicy.IDENTITIES) or ()), shards=shards)


@dataclass(frozen=True)
class TooLarge:
    """A document that does not fit, with the numbers for the condition message."""

    needed: Footprint
    capacity: Capacity

    @property
    def message(self) -> str:
        over = []
        if self.needed.records > self.capacity.max_records:
            over.append(f"needs {self.needed.records} policy map records, capacity {self.capacity.max_records} "
                        "(the chart's agent.policyMapRecords sets the agents' maps)")
        if self.needed.shards > self.capacity.max_shards:
            over.append(f"needs {self.needed.shards} ConfigMaps of {self.capacity.max_bytes} bytes "
                        f"({self.needed.bytes} bytes), capacity {self.capacity.max_shards}")
        if self.needed.rules > self.capacity.max_rules:
            over.append(f"needs {self.needed.rules} rules, capacity {self.capacity.max_rules}")
        if self.needed.identities > self.capacity.max_identities:
            over.append(f"needs {self.needed.identities} identities, capacity {self.capacity.max_identities}")
        return ("flow allow-list too large: " + "; ".join(over)
                + "; not published, the last published allow-list stays enforced")


def check(document: Mapping[str, Any], capacity: Capacity) -> tuple[Footprint, TooLarge | None]:
    """The document's footprint, and a TooLarge when it exceeds any limit."""
    needed = Footprint.of(document, max_bytes=capacity.max_bytes)
    fits = (needed.records <= capacity.max_records and needed.shards <= capacity.max_shards
            and needed.rules <= capacity.max_rules and needed.identities <= capacity.max_identities)
    return needed, None if fits else TooLarge(needed=needed, capacity=capacity)
