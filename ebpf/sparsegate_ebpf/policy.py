"""Flow policy documents (CONTRACTS.md "Flow policy published for the eBPF agent") -> map entries.

Pure: no BPF, no I/O. ``parse_policy`` validates a document with ``sparsegate_contracts.flowpolicy``
(the definition the operator builds documents with), bounded by the map's capacity;
``compile_policy`` turns it into the exact (key, value) records one inner policy map holds,
including the meta record (proto 0) that carries the default action and the generation number.

Semantics: only packets to a policed destination (the document's ``policedDestinations``, else its
entries' destinations) are judged; the rest pass. Sources in the document's ``allowedSources`` and
the agent's own always-allowed sources (node addresses) pass to every policed destination. Then
exact match on (srcIP, dstIP, dstPort, protocol); no match -> defaultAction. When entries for the
same tuple disagree, deny wins (as in Cilium and Istio), whatever their order. Only TCP/UDP are
policed (the document's protocol field); other IPv4 protocols are counted and passed by the program.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparsegate_contracts import flowpolicy
from sparsegate_contracts.flowpolicy import FlowPolicy, PolicyEntry

from .maps import (
    ACTION_ALLOW,
    ACTION_DENY,
    KEY_ALLOWED_SRC,
    KEY_POLICED_DST,
    POLICY_MAX_ENTRIES,
    PROTO_NUMBERS,
    PolicyKey,
    PolicyVal,
    ip_to_be32,
    port_to_be16,
)

__all__ = ["ACTIONS", "ACTION_NAMES", "FlowPolicy", "PolicyEntry", "PolicyError", "compile_policy",
           "meta_key", "parse_policy"]

ACTIONS = {flowpolicy.ALLOW: ACTION_ALLOW, flowpolicy.DENY: ACTION_DENY}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}

PolicyError = flowpolicy.FlowPolicyError
"""The document is not a valid flow policy; the agent keeps the policy it has."""


def parse_policy(document: Mapping[str, Any] | str | bytes) -> FlowPolicy:
    """Validate a policy document (dict or JSON text); one map slot is the meta record."""
    return flowpolicy.parse_document(document, max_entries=POLICY_MAX_ENTRIES - 1)


def meta_key() -> PolicyKey:
    """The reserved all-zero key (proto 0) whose value carries default action + generation."""
    return PolicyKey()


def compile_policy(policy: FlowPolicy, *, generation: int,
                   extra_sources: tuple[str, ...] = ()) -> list[tuple[PolicyKey, PolicyVal]]:
    """All records of one inner policy map, meta record first: entries, one record per policed
    destination (carrying the default action) and one per always-allowed source (the document's
    ``allowedSources`` plus ``extra_sources``, the node's own addresses)."""
    if not 0 < generation < 2**32:
        raise PolicyError(f"generation out of range: {generation}")
    sources = sorted(set(policy.allowed_sources) | set(extra_sources))
    total = len(policy.entries) + len(policy.policed_destinations) + len(sources) + 1
    if total > POLICY_MAX_ENTRIES:
        raise PolicyError(f"{total} records (entries, policed destinations, allowed sources, meta) exceed the "
                          f"map capacity {POLICY_MAX_ENTRIES}")
    records: dict[tuple[int, int, int, int], PolicyVal] = {}
    for rule_id, entry in enumerate(policy.entries, start=1):
        tup = (
            ip_to_be32(entry.src_ip),
            ip_to_be32(entry.dst_ip),
            port_to_be16(entry.dst_port),
            PROTO_NUMBERS[entry.protocol],
        )
        action = ACTIONS[entry.action]
        prior = records.get(tup)
        # Deny precedence; among equals the first rule keeps the attribution.
        if prior is None or (action == ACTION_DENY and prior.action != ACTION_DENY):
            records[tup] = PolicyVal(action=action, rule_id=rule_id, generation=generation)
    default = ACTIONS[policy.default_action]
    out = [(meta_key(), PolicyVal(action=default, rule_id=0, generation=generation))]
    for (saddr, daddr, dport, proto), val in records.items():
        out.append((PolicyKey(saddr=saddr, daddr=daddr, dport=dport, proto=proto), val))
    for ip in policy.policed_destinations:
        out.append((PolicyKey(daddr=ip_to_be32(ip), kind=KEY_POLICED_DST),
                    PolicyVal(action=default, rule_id=0, generation=generation)))
    for ip in sources:
        out.append((PolicyKey(saddr=ip_to_be32(ip), kind=KEY_ALLOWED_SRC),
                    PolicyVal(action=ACTION_ALLOW, rule_id=0, generation=generation)))
    return out
