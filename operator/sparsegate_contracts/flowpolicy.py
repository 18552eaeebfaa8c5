"""The flow allow-list: produced by the operator, enforced by the node agent (dev/CONTRACTS.md).

ConfigMap ``sparsegate-flow-policy`` (operator namespace), key ``policy.json``::

    {"version": "sha256:...", "defaultAction": "deny"|"allow",
     "entries": [{"srcIP": "a.b.c.d", "dstIP": "a.b.c.d", "dstPort": 8080,
                  "protocol": "tcp"|"udp", "action": "allow"|"deny", "rule": "ns/name#id"}],
     "policedDestinations": ["a.b.c.d", ...],   # optional
     "allowedSources": ["a.b.c.d", ...]}        # optional

``version`` = ``canonical.sha256_of`` of the document without its ``version`` field, whoever
computes it: the operator when it builds a document (``build_document``) and the agent for a
document that comes without one (``parse_document``). Semantics (enforced by the agent): only
packets to a *policed destination* are judged, everything else passes; a packet to one is judged by
exact match on (srcIP, dstIP, dstPort, protocol), otherwise ``defaultAction``; deny wins when
entries for one tuple disagree. ``policedDestinations``: the model pod IPs under a RoutingPolicy
(absent: the ``dstIP`` of every entry). ``allowedSources``: source IPs always allowed to policed
destinations (the operator's own pod, for its admin and metrics traffic).
"""

from __future__ import annotations

import ipaddress
import json
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
DOCUMENT_FIELDS = ("version", "defaultAction", "entries", POLICED_DESTINATIONS, ALLOWED_SOURCES)
ENTRY_FIELDS = ("srcIP", "dstIP", "dstPort", "protocol", "action", "rule")

# Capacity (checked by the operator before it publishes, and again by the agent before it loads).
MAP_MAX_ENTRIES = 16384
"""``max_entries`` of each inner policy map (``SG_POLICY_MAX_ENTRIES`` in the agent's header)."""
AGENT_RESERVED_RECORDS = 64
"""Map records the operator leaves to each agent: the meta record and the node's own addresses."""
CONFIGMAP_MAX_BYTES = 1024 * 1024
"""The API server refuses a ConfigMap whose data exceeds 1 MiB."""
DOCUMENT_MAX_BYTES = CONFIGMAP_MAX_BYTES - 64 * 1024
"""The largest ``policy.json`` the operator publishes: the 1 MiB limit minus headroom."""


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
class FlowPolicy:
    version: str
    default_action: str
    entries: tuple[PolicyEntry, ...]
    policed_destinations: tuple[str, ...] = ()  # resolved: the document's list, or the entries' dstIPs
    allowed_sources: tuple[str, ...] = ()

    def rule_names(self) -> dict[int, str]:
        """1-based entry index (the agent's rule_id) -> the entry's rule name; 0 = the default."""
        names = {0: f"default:{self.default_action}"}
        names.update({i + 1: e.rule or f"entry-{i + 1}" for i, e in enumerate(self.entries)})
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
    entries = list(document.get("entries") or ())
    kept = [e for e in entries
            if e.get("action") != ALLOW or "/" not in (p := policy_of_rule(e.get("rule", ""))) or p in live]
    if len(kept) == len(entries):
        return None
    # The destinations stay policed (dropping their entries must not unpolice them).
    return build_document(entries=kept, default_action=document.get("defaultAction", DENY),
                          policed_destinations=policed_of(document), allowed_sources=document.get(ALLOWED_SOURCES))


def policed_of(document: Mapping[str, Any]) -> list[str]:
    """The policed destinations of a document: its ``policedDestinations``, else its entries' ``dstIP``s."""
    listed = document.get(POLICED_DESTINATIONS)
    if listed is not None:
        return list(listed)
    return sorted({str(e.get("dstIP")) for e in document.get("entries") or () if isinstance(e, Mapping)})


def map_records(document: Mapping[str, Any]) -> int:
    """Inner-map records the document needs on an agent, besides the meta record and the node's own
    addresses: one per distinct entry tuple, policed destination and allowed source (as
    ``sparsegate_ebpf.policy.compile_policy`` writes them)."""
    tuples = {(e.get("srcIP"), e.get("dstIP"), e.get("dstPort"), e.get("protocol", DEFAULT_PROTOCOL))
              for e in document.get("entries") or () if isinstance(e, Mapping)}
    return len(tuples) + len(policed_of(document)) + len(set(document.get(ALLOWED_SOURCES) or ()))


def document_bytes(document: Mapping[str, Any]) -> int:
    """Bytes of the ``policy.json`` value the operator writes (``document_text``, UTF-8)."""
    return len(document_text(document).encode())


def version_of(body: Mapping[str, Any]) -> str:
    """The version of a document without its ``version`` field (content address)."""
    return sha256_of(body)


def entry(*, src_ip: str, dst_ip: str, dst_port: int, protocol: str, action: str, rule: str) -> dict[str, Any]:
    return PolicyEntry(src_ip=src_ip, dst_ip=dst_ip, dst_port=dst_port, protocol=protocol, action=action,
                       rule=rule).to_json()


def build_document(*, entries: Iterable[Mapping[str, Any]], default_action: str = DENY,
                   policed_destinations: Iterable[str] | None = None,
                   allowed_sources: Iterable[str] | None = None) -> dict[str, Any]:
    """A complete document (entries in the given order) with its content-addressed version.

    ``policed_destinations`` / ``allowed_sources``: written (sorted) only when given, so documents
    built without them are byte-identical to before."""
    body: dict[str, Any] = {"defaultAction": default_action, "entries": list(entries)}
    if policed_destinations is not None:
        body[POLICED_DESTINATIONS] = sorted(set(policed_destinations))
    if allowed_sources is not None:
        body[ALLOWED_SOURCES] = sorted(set(allowed_sources))
    return {"version": version_of(body), **body}


def document_text(document: Mapping[str, Any]) -> str:
    """The ``policy.json`` value the operator writes into the ConfigMap."""
    return json.dumps(document, indent=1, sort_keys=True)


def _ipv4(value: Any, *, field: str, index: int) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except (ValueError, TypeError) as exc:
        raise FlowPolicyError(f"entries[{index}].{field}: not an IPv4 address: {value!r}") from exc


def _ipv4_list(document: Mapping[str, Any], field: str) -> tuple[str, ...] | None:
    raw = document.get(field)
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise FlowPolicyError(f"{field} must be a list of IPv4 addresses")
    out = []
    for i, value in enumerate(raw):
        try:
            out.append(str(ipaddress.IPv4Address(value)))
        except (ValueError, TypeError) as exc:
            raise FlowPolicyError(f"{field}[{i}]: not an IPv4 address: {value!r}") from exc
    return tuple(sorted(set(out)))


def _action(value: Any, *, where: str) -> str:
    if value not in ACTIONS:
        raise FlowPolicyError(f"{where}: must be 'allow' or 'deny', got {value!r}")
    return value


def parse_document(document: Mapping[str, Any] | str | bytes, *, max_entries: int | None = None) -> FlowPolicy:
    """Validate a document (dict or JSON text); ``max_entries``: the consumer's capacity, if any."""
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
    if max_entries is not None and len(raw_entries) > max_entries:
        raise FlowPolicyError(f"{len(raw_entries)} entries exceed the map capacity {max_entries}")
    entries = []
    for i, raw in enumerate(raw_entries):
        if not isinstance(raw, Mapping):
            raise FlowPolicyError(f"entries[{i}] must be an object")
        port = raw.get("dstPort")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise FlowPolicyError(f"entries[{i}].dstPort: must be an integer 1..65535, got {port!r}")
        protocol = raw.get("protocol", DEFAULT_PROTOCOL)
        if protocol not in PROTOCOLS:
            raise FlowPolicyError(f"entries[{i}].protocol: must be 'tcp' or 'udp', got {protocol!r}")
        rule = raw.get("rule", "")
        if not isinstance(rule, str):
            raise FlowPolicyError(f"entries[{i}].rule must be a string")
        entries.append(
            PolicyEntry(
                src_ip=_ipv4(raw.get("srcIP"), field="srcIP", index=i),
                dst_ip=_ipv4(raw.get("dstIP"), field="dstIP", index=i),
                dst_port=port,
                protocol=protocol,
                action=_action(raw.get("action"), where=f"entries[{i}].action"),
                rule=rule,
            )
        )
    version = document.get("version")
    if version is None:
        version = version_of(document)
    if not isinstance(version, str):
        raise FlowPolicyError("version must be a string")
    policed = _ipv4_list(document, POLICED_DESTINATIONS)
    if policed is None:
        policed = tuple(sorted({e.dst_ip for e in entries}))
    allowed = _ipv4_list(document, ALLOWED_SOURCES) or ()
    if max_entries is not None and len(entries) + len(policed) + len(allowed) > max_entries:
        raise FlowPolicyError(f"{len(entries)} entries + {len(policed)} policedDestinations + {len(allowed)} "
                              f"allowedSources exceed the map capacity {max_entries}")
    return FlowPolicy(version=version, default_action=default_action, entries=tuple(entries),
                      policed_destinations=policed, allowed_sources=allowed)
