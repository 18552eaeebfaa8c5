"""Does a flow document fit where it is published? (pure)

Limits (``sparsegate_contracts.flowpolicy``): the agent's inner policy map (``MAP_MAX_ENTRIES``
records, minus ``AGENT_RESERVED_RECORDS`` left for the meta record and the node's own addresses),
the rules it counts verdicts for (``MAX_RULES``), the identity numbers (``FIRST_IDENTITY`` ..
``MAX_IDENTITY``) and the ConfigMap (1 MiB of data, minus headroom). A document over any is not
published: the agent would refuse it (map) or the API server would (bytes), and the last
published allow-list would stay enforced while nothing said so. The sync keeps the published one
and reports ``PolicyTooLarge`` on the RoutingPolicies instead (``domain.policy_status``).

Records are counted per address (``flowpolicy.map_records``), whatever its family: a dual-stack
pod is published with its IPv4 and its IPv6 address, so it needs two source records and two
policed-destination records, and the agent keys both families in the same inner map.

Both limits can be lowered (never raised above the real ones) through the operator's environment,
so that tests can reach them with a handful of pods: ``SPARSEGATE_FLOW_POLICY_MAX_RECORDS`` and
``SPARSEGATE_FLOW_POLICY_MAX_BYTES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparsegate_contracts import flowpolicy

MAX_RECORDS_ENV = "SPARSEGATE_FLOW_POLICY_MAX_RECORDS"
MAX_BYTES_ENV = "SPARSEGATE_FLOW_POLICY_MAX_BYTES"
DEFAULT_MAX_RECORDS = flowpolicy.MAP_MAX_ENTRIES - flowpolicy.AGENT_RESERVED_RECORDS
DEFAULT_MAX_BYTES = flowpolicy.DOCUMENT_MAX_BYTES
MAX_IDENTITIES = flowpolicy.MAX_IDENTITY - flowpolicy.FIRST_IDENTITY + 1


@dataclass(frozen=True)
class Capacity:
    max_records: int = DEFAULT_MAX_RECORDS
    max_bytes: int = DEFAULT_MAX_BYTES
    max_rules: int = flowpolicy.MAX_RULES
    max_identities: int = MAX_IDENTITIES

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Capacity:
        """The limits, lowered by the environment; ValueError naming the variable when it is bad."""
        return cls(max_records=_limit(env, MAX_RECORDS_ENV, DEFAULT_MAX_RECORDS),
                   max_bytes=_limit(env, MAX_BYTES_ENV, DEFAULT_MAX_BYTES))


def _limit(env: Mapping[str, str], name: str, ceiling: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return ceiling
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: must be an integer, got {raw!r}") from None
    if not 1 <= value <= ceiling:
        raise ValueError(f"{name}: must be in 1..{ceiling} (it can only lower the real limit), got {value}")
    return value


@dataclass(frozen=True)
class Footprint:
    """What a document needs: map records (besides the agent's reserve), ConfigMap bytes, rules and
    identities."""

    records: int
    bytes: int
    rules: int = 0
    identities: int = 0

    @classmethod
    def of(cls, document: Mapping[str, Any]) -> Footprint:
        return cls(records=flowpolicy.map_records(document), bytes=flowpolicy.document_bytes(document),
                   rules=len(flowpolicy.rows_of(document)),
                   identities=len(document.get(flowpolicy.IDENTITIES) or ()))


@dataclass(frozen=True)
class TooLarge:
    """A document that does not fit, with the numbers for the condition message."""

    needed: Footprint
    capacity: Capacity

    @property
    def message(self) -> str:
        over = []
        if self.needed.records > self.capacity.max_records:
            over.append(f"needs {self.needed.records} policy map records, capacity {self.capacity.max_records}")
        if self.needed.bytes > self.capacity.max_bytes:
            over.append(f"needs {self.needed.bytes} bytes, ConfigMap capacity {self.capacity.max_bytes}")
        if self.needed.rules > self.capacity.max_rules:
            over.append(f"needs {self.needed.rules} rules, capacity {self.capacity.max_rules}")
        if self.needed.identities > self.capacity.max_identities:
            over.append(f"needs {self.needed.identities} identities, capacity {self.capacity.max_identities}")
        return ("flow allow-list too large: " + "; ".join(over)
                + "; not published, the last published allow-list stays enforced")


def check(document: Mapping[str, Any], capacity: Capacity) -> tuple[Footprint, TooLarge | None]:
    """The document's footprint, and a TooLarge when it exceeds any limit."""
    needed = Footprint.of(document)
    fits = (needed.records <= capacity.max_records and needed.bytes <= capacity.max_bytes
            and needed.rules <= capacity.max_rules and needed.identities <= capacity.max_identities)
    return needed, None if fits else TooLarge(needed=needed, capacity=capacity)
