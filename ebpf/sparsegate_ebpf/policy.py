"""Flow policy documents (CONTRACTS.md "Flow policy published for the eBPF agent") -> map entries.

Pure: no BPF, no I/O. ``parse_policy`` validates a document; ``compile_policy`` turns it into the
exact (key, value) records one inner policy map holds, including the meta record (proto 0) that
carries the default action and the generation number.

Semantics: exact match on (srcIP, dstIP, dstPort, protocol); no match -> defaultAction. When
entries for the same tuple disagree, deny wins (as in Cilium and Istio), whatever their order.
Only TCP/UDP are policed (the document's protocol field); other IPv4 protocols are counted
and passed by the program.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .maps import (
    ACTION_ALLOW,
    ACTION_DENY,
    POLICY_MAX_ENTRIES,
    PROTO_NUMBERS,
    PolicyKey,
    PolicyVal,
    ip_to_be32,
    port_to_be16,
)

ACTIONS = {"allow": ACTION_ALLOW, "deny": ACTION_DENY}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}


class PolicyError(ValueError):
    """The document is not a valid flow policy; the agent keeps the policy it has."""


@dataclass(frozen=True)
class PolicyEntry:
    src_ip: str
    dst_ip: str
    dst_port: int
    protocol: str
    action: str
    rule: str


@dataclass(frozen=True)
class FlowPolicy:
    version: str
    default_action: str
    entries: tuple[PolicyEntry, ...]

    def rule_names(self) -> dict[int, str]:
        """rule_id (1-based entry index, as stored in the map) -> the entry's rule name; 0 = default."""
        names = {0: f"default:{self.default_action}"}
        names.update({i + 1: e.rule or f"entry-{i + 1}" for i, e in enumerate(self.entries)})
        return names


def _ipv4(value: Any, *, field: str, index: int) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except (ValueError, TypeError) as exc:
        raise PolicyError(f"entries[{index}].{field}: not an IPv4 address: {value!r}") from exc


def _action(value: Any, *, where: str) -> str:
    if value not in ACTIONS:
        raise PolicyError(f"{where}: must be 'allow' or 'deny', got {value!r}")
    return value


def parse_policy(document: Mapping[str, Any] | str | bytes) -> FlowPolicy:
    """Validate a policy document (dict or JSON text)."""
    if isinstance(document, (str, bytes)):
        try:
            document = json.loads(document)
        except json.JSONDecodeError as exc:
            raise PolicyError(f"policy is not valid JSON: {exc}") from exc
    if not isinstance(document, Mapping):
        raise PolicyError("policy document must be a JSON object")
    unknown = set(document) - {"version", "defaultAction", "entries"}
    if unknown:
        raise PolicyError(f"unknown top-level fields: {sorted(unknown)}")
    default_action = _action(document.get("defaultAction", "deny"), where="defaultAction")
    raw_entries = document.get("entries", [])
    if not isinstance(raw_entries, list):
        raise PolicyError("entries must be a list")
    if len(raw_entries) > POLICY_MAX_ENTRIES - 1:
        raise PolicyError(f"{len(raw_entries)} entries exceed the map capacity {POLICY_MAX_ENTRIES - 1}")
    entries = []
    for i, raw in enumerate(raw_entries):
        if not isinstance(raw, Mapping):
            raise PolicyError(f"entries[{i}] must be an object")
        port = raw.get("dstPort")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise PolicyError(f"entries[{i}].dstPort: must be an integer 1..65535, got {port!r}")
        protocol = raw.get("protocol", "tcp")
        if protocol not in PROTO_NUMBERS:
            raise PolicyError(f"entries[{i}].protocol: must be 'tcp' or 'udp', got {protocol!r}")
        rule = raw.get("rule", "")
        if not isinstance(rule, str):
            raise PolicyError(f"entries[{i}].rule must be a string")
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
        version = "sha256:" + hashlib.sha256(
            json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
    if not isinstance(version, str):
        raise PolicyError("version must be a string")
    return FlowPolicy(version=version, default_action=default_action, entries=tuple(entries))


def meta_key() -> PolicyKey:
    """The reserved all-zero key (proto 0) whose value carries default action + generation."""
    return PolicyKey()


def compile_policy(policy: FlowPolicy, *, generation: int) -> list[tuple[PolicyKey, PolicyVal]]:
    """All records of one inner policy map, meta record first."""
    if not 0 < generation < 2**32:
        raise PolicyError(f"generation out of range: {generation}")
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
    out = [(meta_key(), PolicyVal(action=ACTIONS[policy.default_action], rule_id=0, generation=generation))]
    for (saddr, daddr, dport, proto), val in records.items():
        out.append((PolicyKey(saddr=saddr, daddr=daddr, dport=dport, proto=proto), val))
    return out
