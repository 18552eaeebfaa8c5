"""RoutingPolicy objects → the rules OPA evaluates (pure).

Each RoutingPolicy expands to one rule per (source selector, target). The rules are pushed to OPA as
data (`data.sparsegate.policies`), pre-indexed by target key and identity key, so that the Rego in
`policies/routing/src.rego` finds the few rules that can apply to a request with map lookups instead
of scanning every rule (OPA does not index iterations over arrays). The two files describe the same
shape: change them together.

Identity keys (where a source selector is filed):
- `spiffe://<td>/ns/<ns>/sa/<sa>`: a SPIFFE ID, or namespace + service account;
- `ns:<ns>`: a whole namespace (optionally narrowed by labels);
- `*`: any namespace of our trust domain (optionally narrowed by service account and labels).
Target keys: `<ns>/<model>`, or `<ns>/*` for every SparseModel of the namespace.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sparsegate_contracts.canonical import sha256_hex, sha256_of

ANY = "*"
DEFAULT_TRUST_DOMAIN = "cluster.local"


class Action(str, enum.Enum):
    """What a matching rule does; Deny wins over Allow whatever the priorities."""

    ALLOW = "allow"
    # admits the flow unless a Deny rule also matches
    DENY = "deny"
    # refuses the flow; no Allow rule can override it


@dataclass(frozen=True)
class Port:
    port: int
    protocol: str = "tcp"

    def to_json(self) -> dict[str, Any]:
        return {"port": self.port, "protocol": self.protocol}


@dataclass(frozen=True)
class Rule:
    """One (source selector, target) of a RoutingPolicy, as OPA sees it."""

    id: str  # "<ns>/<name>#s<i>t<j>"
    policy: str  # "<ns>/<name>"
    action: Action
    priority: int
    target_key: str
    identity_key: str
    # Residual conditions checked after the map lookup.
    service_account: str | None
    match_labels: tuple[tuple[str, str], ...]
    ports: tuple[Port, ...]
    expert_groups: tuple[str, ...]
    routes: tuple[str, ...]

    def to_opa(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "id": self.id,
            "policy": self.policy,
            "action": self.action.value,
            "priority": self.priority,
            "matchLabels": dict(self.match_labels),
            "ports": [p.to_json() for p in self.ports],
            "expertGroups": list(self.expert_groups),
            "routes": list(self.routes),
        }
        if self.service_account is not None:
            doc["serviceAccount"] = self.service_account
        return doc


def spiffe_id(*, trust_domain: str, namespace: str, service_account: str) -> str:
    return f"spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}"


def identity_key(
    *, selector: Mapping[str, Any], policy_namespace: str, trust_domain: str
) -> tuple[str, str | None]:
    """Where a source selector is filed, and the service account left to check after the lookup.

    A selector without a namespace means the policy's own namespace (least privilege); `*` means any.
    """
    if selector.get("spiffeID"):
        return str(selector["spiffeID"]), None
    namespace = selector.get("namespace") or policy_namespace
    service_account = selector.get("serviceAccount")
    if namespace == ANY:
        return ANY, service_account
    if service_account:
        return spiffe_id(
            trust_domain=trust_domain, namespace=namespace, service_account=service_account
        ), None
    return f"ns:{namespace}", None


def target_key(*, namespace: str, model: str) -> str:
    return f"{namespace}/{model}"


def policy_key(*, namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def _ports(spec_ports: Iterable[Mapping[str, Any]] | None) -> tuple[Port, ...]:
    ports = {
        Port(port=int(p["port"]), protocol=str(p.get("protocol") or "TCP").lower())
        for p in spec_ports or ()
    }
    return tuple(sorted(ports, key=lambda p: (p.port, p.protocol)))


def rules_from_spec(
    *, namespace: str, name: str, spec: Mapping[str, Any], trust_domain: str = DEFAULT_TRUST_DOMAIN
) -> list[Rule]:
    """Expand one RoutingPolicy spec. Targets are SparseModels of the policy's namespace."""
    key = policy_key(namespace=namespace, name=name)
    action = Action(str(spec.get("action", "Allow")).lower())
    priority = int(spec.get("priority", 0))
    ports = _ports(spec.get("ports"))
    rules = []
    for i, source in enumerate(spec.get("sources") or ()):
        ikey, service_account = identity_key(
            selector=source, policy_namespace=namespace, trust_domain=trust_domain
        )
        labels = tuple(sorted((str(k), str(v)) for k, v in (source.get("matchLabels") or {}).items()))
        for j, target in enumerate(spec.get("targets") or ()):
            rules.append(
                Rule(
                    id=f"{key}#s{i}t{j}",
                    policy=key,
                    action=action,
                    priority=priority,
                    target_key=target_key(namespace=namespace, model=target["sparseModel"]),
                    identity_key=ikey,
                    service_account=service_account,
                    match_labels=labels,
                    ports=ports,
                    expert_groups=tuple(sorted(set(target.get("expertGroups") or ()))),
                    routes=tuple(sorted(set(target.get("routes") or ()))),
                )
            )
    return rules


@dataclass(frozen=True)
class PolicySource:
    """A RoutingPolicy as the operator last saw it."""

    namespace: str
    name: str
    generation: int
    spec: Mapping[str, Any]

    @property
    def key(self) -> str:
        return policy_key(namespace=self.namespace, name=self.name)


def index_rules(rules: Iterable[Rule]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """targets[target key][identity key] = [rule, ...], in a stable order."""
    targets: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for rule in sorted(rules, key=lambda r: (r.target_key, r.identity_key, -r.priority, r.id)):
        targets.setdefault(rule.target_key, {}).setdefault(rule.identity_key, []).append(rule.to_opa())
    return targets


def build_opa_data(
    *, sources: Sequence[PolicySource], trust_domain: str, rego: str
) -> tuple[dict[str, Any], list[Rule]]:
    """The whole `data.sparsegate.policies` document and the rules in it.

    `revision` covers the Rego too, so a changed policy module also counts as out of sync.
    """
    rules: list[Rule] = []
    loaded: dict[str, dict[str, int]] = {}
    for source in sorted(sources, key=lambda s: s.key):
        expanded = rules_from_spec(
            namespace=source.namespace, name=source.name, spec=source.spec, trust_domain=trust_domain
        )
        rules.extend(expanded)
        loaded[source.key] = {"generation": source.generation, "rules": len(expanded)}
    body = {"trustDomain": trust_domain, "policies": loaded, "targets": index_rules(rules)}
    revision = sha256_of({"data": body, "rego": hashlib.sha256(rego.encode()).hexdigest()})
    return {"revision": revision, **body}, rules


# 16 hex digits (64 bits) per spec: the record of many policies must fit a ConfigMap annotation,
# and a collision would need a second spec crafted to hash alike, not an accident.
_DIGEST_HEX = 16


def source_digest(source: PolicySource) -> str:
    """``"<generation>:<digest of the spec>"``: the spec OPA decided, even across a delete and re-create
    (generation restarts at 1, the digest does not match a different spec)."""
    return f"{source.generation}:{sha256_hex(dict(source.spec))[:_DIGEST_HEX]}"


def decision_basis(*, sources: Sequence[PolicySource], trust_domain: str, rego: str) -> dict[str, Any]:
    """What a set of OPA decisions was computed from: the Rego, the trust domain and each policy's
    spec (`source_digest`). Recorded beside the published allow-list, so that an operator that
    cannot ask OPA can tell which of today's policies the allow-list already reflects."""
    return {
        "rego": hashlib.sha256(rego.encode()).hexdigest()[:_DIGEST_HEX],
        "trustDomain": trust_domain,
        "policies": {s.key: source_digest(s) for s in sorted(sources, key=lambda s: s.key)},
    }


def undecided_policies(*, current: Mapping[str, Any], decided: Mapping[str, Any] | None) -> set[str]:
    """Policies of the `current` basis whose spec OPA has not decided: new ones, changed ones (any
    generation or spec change), and every one when the decided basis is unknown (`None`: an operator
    that just started without a record) or came from another Rego or trust domain."""
    policies = dict(current.get("policies") or {})
    if decided is None or any(decided.get(k) != current.get(k) for k in ("rego", "trustDomain")):
        return set(policies)
    before = decided.get("policies") or {}
    return {key for key, digest in policies.items() if before.get(key) != digest}
