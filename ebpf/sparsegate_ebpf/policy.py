"""Flow policy documents (CONTRACTS.md "Flow policy published for the eBPF agent") -> map entries.

Pure: no BPF, no I/O. ``parse_policy`` validates a document with ``sparsegate_contracts.flowpolicy``
(the definition the operator builds documents with), bounded by the map's capacity;
``compile_policy`` turns it into the exact (key, value) records one inner policy map holds,
including the meta record (proto 0) that carries the default action and the generation number.

Records are identity-based (sparsegate_flow.h): one per source address (its identity), one per
policed destination (default action + its identity), one per (source identity, destination
identity, port, protocol) rule. A document in the identity form brings its identities; one in the
entries form gets one identity per IP here, so both forms compile to the same kind of records.

Semantics: only packets to a policed destination (the document's ``policedDestinations``, else its
rules' destinations) are judged; the rest pass. Sources in the document's ``allowedSources`` and
the agent's own always-allowed sources (node addresses) pass to every policed destination. Then
exact match on (identity of srcIP, identity of dstIP, dstPort, protocol); no match (or an address
without identity) -> defaultAction. When rules for the same tuple disagree, deny wins (as in Cilium
and Istio), whatever their order. Only TCP/UDP are policed (the document's protocol field); other
protocols are counted and passed by the program (IPv6 with an extension header: see
xdp_flow.bpf.c). Addresses of both families go into the same records (``maps.addr_of``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sparsegate_contracts import flowpolicy
from sparsegate_contracts.flowpolicy import FlowPolicy, IdentityRule, PolicyEntry

from .maps import (
    ACTION_ALLOW,
    ACTION_DENY,
    IDENTITY_ALLOWED,
    KEY_ALLOWED_SRC,
    KEY_ENTRY,
    KEY_POLICED_DST,
    KEY_RULE,
    KEY_SOURCE,
    POLICY_MAX_ENTRIES,
    POLICY_MAX_RECORDS,
    PROTO_NUMBERS,
    Addr,
    PolicyKey,
    PolicyVal,
    addr_of,
    identity_addr,
    port_to_be16,
)

__all__ = ["ACTIONS", "ACTION_NAMES", "FlowPolicy", "IdentityRule", "PolicyEntry", "PolicyError",
           "compile_policy", "identity_form", "meta_key", "parse_policy", "upgrade_records"]

ACTIONS = {flowpolicy.ALLOW: ACTION_ALLOW, flowpolicy.DENY: ACTION_DENY}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}

PolicyError = flowpolicy.FlowPolicyError
"""The document is not a valid flow policy; the agent keeps the policy it has."""


def parse_policy(document: Mapping[str, Any] | str | bytes, *, max_records: int = POLICY_MAX_RECORDS) -> FlowPolicy:
    """Validate a policy document (dict or JSON text) for a map of `max_records` records; one map
    slot is the meta record."""
    return flowpolicy.parse_document(document, max_entries=max_records - 1, max_rules=POLICY_MAX_ENTRIES - 1)


def meta_key() -> PolicyKey:
    """The reserved all-zero key (proto 0) whose value carries default action + generation."""
    return PolicyKey()


def identity_form(policy: FlowPolicy) -> tuple[dict[str, int], tuple[IdentityRule, ...]]:
    """IP -> identity and the rules, in the order of the document's rule ids. An entries-form
    document gets one identity per IP it names (FIRST_IDENTITY upwards, in address order)."""
    if policy.rules or policy.identities:
        return {ip: ident for ident, ips in policy.identities for ip in ips}, policy.rules
    ips = sorted({ip for e in policy.entries for ip in (e.src_ip, e.dst_ip)}, key=lambda ip: bytes(addr_of(ip)))
    ipcache = {ip: flowpolicy.FIRST_IDENTITY + i for i, ip in enumerate(ips)}
    if len(ipcache) > flowpolicy.MAX_IDENTITY - flowpolicy.FIRST_IDENTITY + 1:
        raise PolicyError(f"{len(ipcache)} addresses exceed the {flowpolicy.MAX_IDENTITY} identities")
    rules = tuple(IdentityRule(src_identity=ipcache[e.src_ip], dst_identity=ipcache[e.dst_ip], dst_port=e.dst_port,
                               protocol=e.protocol, action=e.action, rule=e.rule) for e in policy.entries)
    return ipcache, rules


def compile_policy(policy: FlowPolicy, *, generation: int, extra_sources: tuple[str, ...] = (),
                   max_records: int = POLICY_MAX_RECORDS) -> list[tuple[PolicyKey, PolicyVal]]:
    """All records of one inner map (at most `max_records`), meta record first: rules, one record per policed destination
    (default action, identity), one per source address of a rule's source identity, and one per
    always-allowed source (the document's ``allowedSources`` plus ``extra_sources``, the node's
    own addresses; their identity is IDENTITY_ALLOWED, whatever the document gives them)."""
    if not 0 < generation < 2**32:
        raise PolicyError(f"generation out of range: {generation}")
    ipcache, rules = identity_form(policy)
    allowed = set(policy.allowed_sources) | set(extra_sources)
    src_identities = {r.src_identity for r in rules}
    sources = {ip: ident for ip, ident in ipcache.items() if ident in src_identities}
    sources.update(dict.fromkeys(allowed, IDENTITY_ALLOWED))
    records: dict[tuple[int, int, int, int], PolicyVal] = {}
    for rule_id, rule in enumerate(rules, start=1):
        tup = (rule.src_identity, rule.dst_identity, port_to_be16(rule.dst_port), PROTO_NUMBERS[rule.protocol])
        action = ACTIONS[rule.action]
        prior = records.get(tup)
        # Deny precedence; among equals the first rule keeps the attribution.
        if prior is None or (action == ACTION_DENY and prior.action != ACTION_DENY):
            records[tup] = PolicyVal(action=action, rule_id=rule_id, generation=generation)
    total = len(records) + len(policy.policed_destinations) + len(sources) + 1
    if total > max_records:
        raise PolicyError(f"{total} records (rules, policed destinations, sources, meta) exceed the "
                          f"map capacity {max_records}")
    if len(rules) > POLICY_MAX_ENTRIES - 1:
        raise PolicyError(f"{len(rules)} rules exceed the {POLICY_MAX_ENTRIES - 1} the program counts verdicts for")
    default = ACTIONS[policy.default_action]
    out = [(meta_key(), PolicyVal(action=default, rule_id=0, generation=generation))]
    for (src_id, dst_id, dport, proto), val in records.items():
        out.append((PolicyKey(saddr=identity_addr(src_id), daddr=identity_addr(dst_id), dport=dport, proto=proto,
                              kind=KEY_RULE), val))
    for ip in policy.policed_destinations:
        out.append((PolicyKey(daddr=addr_of(ip), kind=KEY_POLICED_DST),
                    PolicyVal(action=default, rule_id=0, generation=generation, identity=ipcache.get(ip, 0))))
    for ip, ident in sorted(sources.items()):
        out.append((PolicyKey(saddr=addr_of(ip), kind=KEY_SOURCE),
                    PolicyVal(action=ACTION_ALLOW if ident == IDENTITY_ALLOWED else 0, rule_id=0,
                              generation=generation, identity=ident)))
    return out


def upgrade_records(records: list[tuple[PolicyKey, PolicyVal]]) -> list[tuple[PolicyKey, PolicyVal]]:
    """Records read from a program from before identities (IP-level SG_KEY_ENTRY rules,
    SG_KEY_ALLOWED_SRC sources) as this program reads them, same generation and rule ids; records
    already identity-based come back as they are. Destinations its rules name stay policed.
    (Keys of IPv4-only programs are widened first: ``maps.upgrade_key``, in inherit.py.)"""
    entries = [(k, v) for k, v in records if k.kind == KEY_ENTRY and k.proto]
    old_sources = [(k, v) for k, v in records if k.kind == KEY_ALLOWED_SRC]
    if not entries and not old_sources:
        return records
    meta = next(v for k, v in records if bytes(k) == bytes(meta_key()))
    ips = sorted({bytes(a) for k, _ in entries for a in (k.saddr, k.daddr)})
    ipcache = {a: flowpolicy.FIRST_IDENTITY + i for i, a in enumerate(ips)}
    policed = {bytes(k.daddr): v for k, v in records if k.kind == KEY_POLICED_DST}
    for k, _ in entries:
        policed.setdefault(bytes(k.daddr), PolicyVal(action=meta.action, rule_id=0, generation=meta.generation))
    out = [(meta_key(), meta)]
    out += [(PolicyKey(saddr=identity_addr(ipcache[bytes(k.saddr)]), daddr=identity_addr(ipcache[bytes(k.daddr)]),
                       dport=k.dport, proto=k.proto, kind=KEY_RULE), v) for k, v in entries]
    out += [(PolicyKey(daddr=Addr.from_buffer_copy(d), kind=KEY_POLICED_DST),
             PolicyVal(action=v.action, rule_id=0, generation=v.generation, identity=ipcache.get(d, 0)))
            for d, v in policed.items()]
    sources = {bytes(k.saddr): ipcache[bytes(k.saddr)] for k, _ in entries}
    sources.update({bytes(k.saddr): IDENTITY_ALLOWED for k, _ in old_sources})
    out += [(PolicyKey(saddr=Addr.from_buffer_copy(a), kind=KEY_SOURCE),
             PolicyVal(action=ACTION_ALLOW if ident == IDENTITY_ALLOWED else 0, rule_id=0,
                       generation=meta.generation, identity=ident)) for a, ident in sources.items()]
    out += [(k, v) for k, v in records if k.kind in (KEY_SOURCE, KEY_RULE)]
    return out
