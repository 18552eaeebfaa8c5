"""The flow allow-list: produced by the operator, enforced by the node agent (dev/CONTRACTS.md).

ConfigMap ``sparsegate-flow-policy`` (operator namespace), key ``policy.json``, in one of two forms
(a document larger than one ConfigMap is sharded over several: ``flowpolicy_shards``).
Identity form (what the operator publishes)::

    {"version": "sha256:...", "defaultAction": "deny"|"allow",
     "identities": [{"identity": 256, "ips": ["a.b.c.d", "fd00::a", ...]}, ...],
     "rules": [{"srcIdentity": 256, "dstIdentity": 257, "dstPort": 8080,
                "protocol": "tcp"|"udp", "action": "allow"|"deny", "rule": "ns/name#id"}],
     "policedDestinations": ["a.b.c.d", ...],   # optional
     "allowedSources": ["a.b.c.d", ...]}        # optional

Entries form (older operators; still accepted)::

    {"version": ..., "defaultAction": ...,
     "entries": [{"srcIP": "a.b.c.d", "dstIP": "a.b.c.d", "dstPort": 8080,
                  "protocol": "tcp"|"udp", "action": "allow"|"deny", "rule": "ns/name#id"}],
     "policedDestinations": [...], "allowedSources": [...]}

Addresses (``ips``, ``srcIP``/``dstIP``, ``policedDestinations``, ``allowedSources``) are IPv4 or
IPv6 (``ip_text``: written back in ``ipaddress``'s canonical text; IPv4-mapped IPv6 and zone ids
are refused); a dual-stack pod is listed with both. A document has ``entries`` or
``identities``/``rules``, never both. An identity is a number
(``FIRST_IDENTITY``..``MAX_IDENTITY``; lower ones are reserved) standing for a set of pod IPs: the
operator gives one to each (namespace, serviceAccount, labels) class its rules involve, the way
Cilium allocates security identities, so the allow-list grows with identities x rules rather than
with source pods x model pods. An IP belongs to at most one identity.

``version`` = ``canonical.sha256_of`` of the document without its ``version`` field, whoever
computes it: the operator when it builds a document (``build_document``) and the agent for a
document that comes without one (``parse_document``). Semantics (enforced by the agent): only
packets to a *policed destination* are judged, everything else passes; a packet to one is judged by
exact match on (identity of srcIP, identity of dstIP, dstPort, protocol) against ``rules`` (entries
form: on (srcIP, dstIP, dstPort, protocol)), otherwise ``defaultAction``; an IP with no identity
matches no rule; deny wins when rules for one tuple disagree. ``policedDestinations``: the model pod
IPs under a RoutingPolicy (absent: the destinations the rules or entries name).
``allowedSources``: source IPs always allowed to policed destinations (the operator's own pod, for
its admin and metrics traffic).
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sparsegate_contracts.canonical import sha256_of

CONFIGMAP_NAME = "sparsegate-flow-policy"
DOCUMENT_KEY = "policy.json"
ALLOW = "allow"
DENY = "deny"
ACTIONS = (ALLOW, DENY)
PROTOCOLS = ("tcp", "udp")
DEFAULT_PROTOCOL = "tcp"
POLICED_DESTINATIONS = "policedDestinations"
ALLOWED_SOURCES = "allowedSources"
IDENTITIES = "identities"
RULES = "rules"
DOCUMENT_FIELDS = ("version", "defaultAction", "entries", IDENTITIES, RULES, POLICED_DESTINATIONS, ALLOWED_SOURCES)
ENTRY_FIELDS = ("srcIP", "dstIP", "dstPort", "protocol", "action", "rule")
RULE_FIELDS = ("srcIdentity", "dstIdentity", "dstPort", "protocol", "action", "rule")
IDENTITY_ALLOWED = 1
"""Reserved identity of the sources always allowed to policed destinations (node, operator)."""
FIRST_IDENTITY = 256
"""Identities below are reserved (0: no identity, ``IDENTITY_ALLOWED``), as in Cilium."""
MAX_IDENTITY = 65535
"""Identities are 16-bit in the agent's map values; far more than the map's records allow."""

# Capacity (checked by the operator before it publishes, and again by the agent before it loads).
MAP_MAX_ENTRIES = 65536
"""Default ``max_entries`` of each inner policy map: records (``SG_POLICY_MAX_RECORDS`` in the agent's
header; the agent's ``--policy-map-records`` and the chart's ``agent.policyMapRecords`` change it)."""
MAP_MAX_ENTRIES_LIMIT = 1 << 20
"""The largest ``--policy-map-records`` the agent accepts (the maps are not preallocated: kernel
memory follows the records written, ~120 B each, plus 16 B per record of capacity)."""
MAP_MIN_ENTRIES = 1024
"""The smallest ``--policy-map-records`` the agent accepts (the reserve and a few rules must fit)."""
MAX_RULES = 16383
"""Rules (or entries) per document: their 1-based ids index the agent's per-rule verdict counters
(``SG_POLICY_MAX_ENTRIES`` = MAX_RULES + 1 per pool map)."""
AGENT_RESERVED_RECORDS = 64
"""Map records the operator leaves to each agent: the meta record and the node's own addresses."""
CONFIGMAP_MAX_BYTES = 1024 * 1024
"""The API server refuses a ConfigMap whose data exceeds 1 MiB."""
DOCUMENT_MAX_BYTES = CONFIGMAP_MAX_BYTES - 64 * 1024
"""The largest value the operator writes in one ConfigMap (``policy.json``, or a shard's
``shard.json``): the 1 MiB limit minus headroom. A larger document is sharded."""


class FlowPolicyError(ValueError):
    """The document is not a valid flow policy (the agent keeps the policy it has)."""


@dataclass(frozen=True)
class PolicyEntry:
    src_ip: str
    dst_ip: str
    dst_port: int
    protocol: str
    action: str
    rule: str

    def to_json(self) -> dict[str, Any]:
        return {"srcIP": self.src_ip, "dstIP": self.dst_ip, "dstPort": self.dst_port,
                "protocol": self.protocol, "action": self.action, "rule": self.rule}


@dataclass(frozen=True)
class IdentityRule:
    src_identity: int
    dst_identity: int
    dst_port: int
    protocol: str
    action: str
    rule: str

    def to_json(self) -> dict[str, Any]:
        return identity_rule_json(self.src_identity, self.dst_identity, self.dst_port, self.protocol, self.action,
                                  self.rule)


def identity_rule_json(src_identity: int, dst_identity: int, dst_port: int, protocol: str, action: str,
                       rule: str) -> dict[str, Any]:
    """One ``rules`` row (``IdentityRule.to_json``), without building the dataclass: a compile writes
    one per (source class, destination class, port)."""
    return {"srcIdentity": src_identity, "dstIdentity": dst_identity, "dstPort": dst_port,
            "protocol": protocol, "action": action, "rule": rule}


@dataclass(frozen=True)
class FlowPolicy:
    version: str
    default_action: str
    entries: tuple[PolicyEntry, ...]
    policed_destinations: tuple[str, ...] = ()  # resolved: the document's list, or the rules' destinations
    allowed_sources: tuple[str, ...] = ()
    identities: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (identity, its IPs), identity form only
    rules: tuple[IdentityRule, ...] = ()

    def rule_names(self) -> dict[int, str]:
        """1-based rule (or entry) index (the agent's rule_id) -> its rule name; 0 = the default."""
        names = {0: f"default:{self.default_action}"}
        rows = self.rules or self.entries
        names.update({i + 1: r.rule or f"entry-{i + 1}" for i, r in enumerate(rows)})
        return names


def policy_of_rule(rule: str) -> str:
    """``"ns/name"`` of the RoutingPolicy that produced an entry (its ``rule`` is ``"ns/name#id"``)."""
    return str(rule).split("#", 1)[0]


def without_policies(document: Mapping[str, Any], *, live: Iterable[str]) -> dict[str, Any] | None:
    """The document minus the ALLOW entries of RoutingPolicies not in ``live``; None if nothing goes.

    Narrowing only: deny entries and entries with no ``ns/name`` rule are kept, so applying this
    never widens access. The agents use it to drop a deleted policy's access without the operator.
    """
    live = set(live)
    rows = rows_of(document)
    kept = [e for e in rows
            if e.get("action") != ALLOW or "/" not in (p := policy_of_rule(e.get("rule", ""))) or p in live]
    if len(kept) == len(rows):
        return None
    return with_rows(document, kept)


def rows_of(document: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The document's decisions: its ``rules`` (identity form) or its ``entries``."""
    return list(document.get(RULES) or document.get("entries") or ())


def with_rows(document: Mapping[str, Any], rows: Iterable[Mapping[str, Any]], *,
              identities: Iterable[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The document with only ``rows`` (and ``identities``, when given) left, rebuilt with its version.

    The destinations stay policed (dropping their rules must not unpolice them) and the allowed
    sources stay."""
    common = dict(default_action=document.get("defaultAction", DENY), policed_destinations=policed_of(document),
                  allowed_sources=document.get(ALLOWED_SOURCES))
    if IDENTITIES in document or RULES in document:
        return build_document(rules=rows, identities=document.get(IDENTITIES) if identities is None else identities,
                              **common)
    return build_document(entries=rows, **common)


def identity_ips(document: Mapping[str, Any]) -> dict[int, list[str]]:
    """identity -> its IPs (identity form; empty for the entries form)."""
    return {int(i["identity"]): list(i.get("ips") or ()) for i in document.get(IDENTITIES) or ()
            if isinstance(i, Mapping)}


def ip_entries(document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The document's decisions as IP-level entries (entries form), for reading and tests: each
    identity rule expanded to its (source IP, destination IP) pairs. Proportional to pods squared:
    never what the agents load."""
    if not (IDENTITIES in document or RULES in document):
        return [dict(e) for e in document.get("entries") or ()]
    ips = identity_ips(document)
    return [entry(src_ip=s, dst_ip=d, dst_port=r["dstPort"], protocol=r.get("protocol", DEFAULT_PROTOCOL),
                  action=r["action"], rule=r.get("rule", ""))
            for r in document.get(RULES) or ()
            for s in ips.get(r["srcIdentity"], ()) for d in ips.get(r["dstIdentity"], ())]


def policed_of(document: Mapping[str, Any]) -> list[str]:
    """The policed destinations of a document: its ``policedDestinations``, else its entries' ``dstIP``s."""
    listed = document.get(POLICED_DESTINATIONS)
    if listed is not None:
        return list(listed)
    ips = identity_ips(document)
    dests = {str(e.get("dstIP")) for e in document.get("entries") or () if isinstance(e, Mapping)}
    dests.update(ip for r in document.get(RULES) or () if isinstance(r, Mapping)
                 for ip in ips.get(r.get("dstIdentity"), ()))  # type: ignore[call-overload]
    return sorted(dests)


def map_records(document: Mapping[str, Any]) -> int:
    """Inner-map records the document needs on an agent, besides the meta record and the node's own
    addresses: one per distinct rule (or entry) tuple, per policed destination, and per source address
    (the IPs of a rule's source identity, the entries' source IPs, the allowed sources), as
    ``sparsegate_ebpf.policy.compile_policy`` writes them."""
    allowed = set(document.get(ALLOWED_SOURCES) or ())
    if IDENTITIES in document or RULES in document:
        rules = [r for r in document.get(RULES) or () if isinstance(r, Mapping)]
        tuples = {(r.get("srcIdentity"), r.get("dstIdentity"), r.get("dstPort"), r.get("protocol", DEFAULT_PROTOCOL))
                  for r in rules}
        ips = identity_ips(document)
        sources = {ip for ident in {r.get("srcIdentity") for r in rules} for ip in ips.get(ident, ())}  # type: ignore[call-overload]
        return len(tuples) + len(policed_of(document)) + len(sources | allowed)
    entries = [e for e in document.get("entries") or () if isinstance(e, Mapping)]
    tuples = {(e.get("srcIP"), e.get("dstIP"), e.get("dstPort"), e.get("protocol", DEFAULT_PROTOCOL)) for e in entries}
    return len(tuples) + len(policed_of(document)) + len({e.get("srcIP") for e in entries} | allowed)


def document_bytes(document: Mapping[str, Any]) -> int:
    """Bytes of the ``policy.json`` value the operator writes (``document_text``, UTF-8)."""
    return len(document_text(document).encode())


def version_of(body: Mapping[str, Any]) -> str:
    """The version of a document without its ``version`` field (content address)."""
    return sha256_of(body)


def entry(*, src_ip: str, dst_ip: str, dst_port: int, protocol: str, action: str, rule: str) -> dict[str, Any]:
    return PolicyEntry(src_ip=src_ip, dst_ip=dst_ip, dst_port=dst_port, protocol=protocol, action=action,
                       rule=rule).to_json()


def build_document(*, entries: Iterable[Mapping[str, Any]] | None = None, default_action: str = DENY,
                   policed_destinations: Iterable[str] | None = None,
                   allowed_sources: Iterable[str] | None = None,
                   rules: Iterable[Mapping[str, Any]] | None = None,
                   identities: Iterable[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """A complete document (rows in the given order) with its content-addressed version.

    ``rules``/``identities`` given: the identity form; else the entries form (``entries``, default
    none). ``policed_destinations`` / ``allowed_sources``: written (sorted) only when given, so
    documents built without them are byte-identical to before."""
    body: dict[str, Any] = {"defaultAction": default_action}
    if rules is not None or identities is not None:
        body[IDENTITIES] = [{"identity": int(i["identity"]), "ips": sorted(set(i["ips"]))}
                            for i in sorted(identities or (), key=lambda i: int(i["identity"]))]
        body[RULES] = list(rules or ())
    else:
        body["entries"] = list(entries or ())
    if policed_destinations is not None:
        body[POLICED_DESTINATIONS] = sorted(set(policed_destinations))
    if allowed_sources is not None:
        body[ALLOWED_SOURCES] = sorted(set(allowed_sources))
    return {"version": version_of(body), **body}


def document_text(document: Mapping[str, Any]) -> str:
    """The ``policy.json`` value the operator writes into the ConfigMap."""
    return json.dumps(document, indent=1, sort_keys=True)


def ip_text(value: Any, *, where: str) -> str:
    """``value`` as the canonical text of an IPv4 or IPv6 address (``ipaddress``: IPv6 compressed,
    lower case), or FlowPolicyError naming ``where``. Refused besides malformed text: non-strings,
    IPv6 zone ids (``fe80::1%eth0``: an address of one link, not of a pod) and IPv4-mapped IPv6
    addresses (``::ffff:a.b.c.d``: the agent keys an IPv4 address that way, so the IPv4 form is the
    one to write)."""
    if isinstance(value, str):
        try:  # fast path, ~10x cheaper: glibc's inet_pton takes exactly ipaddress's IPv4 forms
            return socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, value))
        except (OSError, ValueError):  # ValueError: e.g. an embedded NUL
            pass  # IPv6, or not an address: ipaddress decides and words the error
    try:
        if not isinstance(value, str) or "%" in value:
            raise ValueError(value)
        ip = ipaddress.ip_address(value)
    except ValueError as exc:
        raise FlowPolicyError(f"{where}: not an IPv4 or IPv6 address: {value!r}") from exc
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        raise FlowPolicyError(f"{where}: {value!r} is an IPv4-mapped IPv6 address; write {ip.ipv4_mapped}")
    return str(ip)


def _ip_list(document: Mapping[str, Any], field: str) -> tuple[str, ...] | None:
    raw = document.get(field)
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise FlowPolicyError(f"{field} must be a list of IP addresses")
    return tuple(sorted({ip_text(value, where=f"{field}[{i}]") for i, value in enumerate(raw)}))


def _action(value: Any, *, where: str) -> str:
    if value not in ACTIONS:
        raise FlowPolicyError(f"{where}: must be 'allow' or 'deny', got {value!r}")
    return value


def parse_document(document: Mapping[str, Any] | str | bytes, *, max_entries: int | None = None,
                   max_rules: int | None = None) -> FlowPolicy:
    """Validate a document (dict or JSON text); ``max_entries``: the consumer's map capacity (records),
    ``max_rules``: how many rules (or entries) it can tell apart, if any."""
    if isinstance(document, (str, bytes)):
        try:
            document = json.loads(document)
        except json.JSONDecodeError as exc:
            raise FlowPolicyError(f"policy is not valid JSON: {exc}") from exc
    if not isinstance(document, Mapping):
        raise FlowPolicyError("policy document must be a JSON object")
    unknown = set(document) - set(DOCUMENT_FIELDS)
    if unknown:
        raise FlowPolicyError(f"unknown top-level fields: {sorted(unknown)}")
    default_action = _action(document.get("defaultAction", DENY), where="defaultAction")
    raw_entries = document.get("entries", [])
    if not isinstance(raw_entries, list):
        raise FlowPolicyError("entries must be a list")
    identity_form = IDENTITIES in document or RULES in document
    if identity_form and raw_entries:
        raise FlowPolicyError("entries and identities/rules: a document uses one form, not both")
    raw_rows = document.get(RULES, []) if identity_form else raw_entries
    if not isinstance(raw_rows, list):
        raise FlowPolicyError("rules must be a list")
    if max_rules is not None and len(raw_rows) > max_rules:
        raise FlowPolicyError(f"{len(raw_rows)} {'rules' if identity_form else 'entries'} exceed the "
                              f"{max_rules} rules the agent counts verdicts for")
    if max_entries is not None and len(raw_rows) > max_entries:
        raise FlowPolicyError(f"{len(raw_rows)} {'rules' if identity_form else 'entries'} exceed the map "
                              f"capacity {max_entries}")
    entries: list[PolicyEntry] = []
    rules: list[IdentityRule] = []
    identities: tuple[tuple[int, tuple[str, ...]], ...] = ()
    if identity_form:
        identities = _identities(document.get(IDENTITIES, []))
        declared = {ident for ident, _ in identities}
        for i, raw in enumerate(raw_rows):
            where = f"rules[{i}]"
            port, protocol, action, rule = _row(raw, where=where)
            ids = []
            for field in ("srcIdentity", "dstIdentity"):
                value = raw.get(field)
                if value not in declared:
                    raise FlowPolicyError(f"{where}.{field}: {value!r} is not an identity of the document")
                ids.append(value)
            rules.append(IdentityRule(src_identity=ids[0], dst_identity=ids[1], dst_port=port, protocol=protocol,
                                      action=action, rule=rule))
    else:
        for i, raw in enumerate(raw_rows):
            port, protocol, action, rule = _row(raw, where=f"entries[{i}]")
            entries.append(PolicyEntry(src_ip=ip_text(raw.get("srcIP"), where=f"entries[{i}].srcIP"),
                                       dst_ip=ip_text(raw.get("dstIP"), where=f"entries[{i}].dstIP"),
                                       dst_port=port, protocol=protocol, action=action, rule=rule))
    version = document.get("version")
    if version is None:
        version = version_of(document)
    if not isinstance(version, str):
        raise FlowPolicyError("version must be a string")
    policed = _ip_list(document, POLICED_DESTINATIONS)
    if policed is None:
        members = dict(identities)
        policed = tuple(sorted({e.dst_ip for e in entries} | {ip for r in rules for ip in members[r.dst_identity]}))
    allowed = _ip_list(document, ALLOWED_SOURCES) or ()
    policy = FlowPolicy(version=version, default_action=default_action, entries=tuple(entries),
                        policed_destinations=policed, allowed_sources=allowed, identities=identities,
                        rules=tuple(rules))
    if max_entries is not None:
        needed = map_records(document if POLICED_DESTINATIONS in document else
                             {**document, POLICED_DESTINATIONS: list(policed)})
        if needed > max_entries:
            raise FlowPolicyError(f"{needed} records (rules, policed destinations, sources) exceed the map "
                                  f"capacity {max_entries}")
    return policy


def _row(raw: Any, *, where: str) -> tuple[int, str, str, str]:
    """dstPort, protocol, action, rule of one entry or rule, validated."""
    if not isinstance(raw, Mapping):
        raise FlowPolicyError(f"{where} must be an object")
    port = raw.get("dstPort")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise FlowPolicyError(f"{where}.dstPort: must be an integer 1..65535, got {port!r}")
    protocol = raw.get("protocol", DEFAULT_PROTOCOL)
    if protocol not in PROTOCOLS:
        raise FlowPolicyError(f"{where}.protocol: must be 'tcp' or 'udp', got {protocol!r}")
    rule = raw.get("rule", "")
    if not isinstance(rule, str):
        raise FlowPolicyError(f"{where}.rule must be a string")
    return port, protocol, _action(raw.get("action"), where=f"{where}.action"), rule


def _identities(raw: Any) -> tuple[tuple[int, tuple[str, ...]], ...]:
    if not isinstance(raw, list):
        raise FlowPolicyError("identities must be a list")
    out: dict[int, tuple[str, ...]] = {}
    owner: dict[str, int] = {}
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise FlowPolicyError(f"identities[{i}] must be an object")
        ident = item.get("identity")
        if not isinstance(ident, int) or isinstance(ident, bool) or not FIRST_IDENTITY <= ident <= MAX_IDENTITY:
            raise FlowPolicyError(f"identities[{i}].identity: must be an integer {FIRST_IDENTITY}..{MAX_IDENTITY}, "
                                  f"got {ident!r}")
        if ident in out:
            raise FlowPolicyError(f"identities[{i}].identity: {ident} appears twice")
        ips = item.get("ips")
        if not isinstance(ips, list):
            raise FlowPolicyError(f"identities[{i}].ips must be a list of IP addresses")
        members = []
        for j, value in enumerate(ips):
            ip = ip_text(value, where=f"identities[{i}].ips[{j}]")
            if owner.setdefault(ip, ident) != ident:
                raise FlowPolicyError(f"identities[{i}].ips[{j}]: {ip} already has identity {owner[ip]}")
            members.append(ip)
        out[ident] = tuple(sorted(set(members)))
    return tuple(sorted(out.items()))
