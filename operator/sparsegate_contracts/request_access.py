"""Per-request access to one model: expert groups, and the access document the operator compiles.

One definition for both sides: the operator builds the document from the RoutingPolicies that
target a model (``sparsegate.domain.request_access``), the model server parses it and decides each
request with :meth:`AccessTable.decide` / :meth:`AccessTable.scope`.

Decision semantics are those of ``policies/routing/src.rego`` for a request that names a route (its
path) and an expert group on the model's serving port: Deny wins whatever the priorities, an Allow
without ``expertGroups``/``routes`` covers every group/route, a scoped one only those it lists, and
nothing matching means deny. Two differences, both towards refusing:

- A caller verified by a ServiceAccount token has no pod labels the server can trust, so an Allow
  that needs ``matchLabels`` never matches and a Deny that needs them always does. The table's
  answer is therefore OPA's answer for the caller with no labels AND with every label the rules name.
- A request that names no group asks for the whole model: only rules without ``expertGroups``
  count (OPA's answer for a request naming a route and no group), and the experts of groups a Deny
  names for the caller are then masked out.

Document (``version`` 1)::

    {"version": 1, "model": "<ns>/<name>", "trustDomain": "cluster.local", "enforced": bool,
     "revision": "sha256:...",
     "rules": [{"id", "action": "allow"|"deny", "priority": int, "identity": <identity key>,
                "serviceAccount": str|null, "needsLabels": bool,
                "expertGroups": [...], "routes": [...]}]}

``enforced`` false (no RoutingPolicy targets the model): every request is served as before.
Identity keys are those of ``sparsegate.domain.policy.identity_key``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

VERSION = 1
# The request header naming the expert group a request wants.
EXPERT_GROUP_HEADER = "x-sparsegate-expert-group"
TOKEN_AUDIENCE = "sparsegate"
MAX_GROUPS = 32
MAX_RULES = 4096

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class AccessDocumentError(ValueError):
    """A malformed expert-group list or access document; the message names the field."""


def parse_expert_groups(groups: Any, *, num_experts: int | None) -> dict[str, tuple[int, ...]]:
    """``[{name, experts}]`` (SparseModel spec.expertGroups) as {name: sorted experts}.

    ``num_experts`` None (a checkpoint, shape not known yet): indices are checked later."""
    if not isinstance(groups, list):
        raise AccessDocumentError("expertGroups must be a list")
    if len(groups) > MAX_GROUPS:
        raise AccessDocumentError(f"expertGroups has {len(groups)} groups, at most {MAX_GROUPS}")
    out: dict[str, tuple[int, ...]] = {}
    for i, g in enumerate(groups):
        where = f"expertGroups[{i}]"
        if not isinstance(g, Mapping):
            raise AccessDocumentError(f"{where} must be an object")
        name, experts = g.get("name"), g.get("experts")
        if not isinstance(name, str) or len(name) > 63 or not _DNS_LABEL.match(name):
            raise AccessDocumentError(f"{where}.name must be a DNS-1123 label, got {name!r}")
        if name in out:
            raise AccessDocumentError(f"{where}.name {name!r} repeats an earlier group")
        if not isinstance(experts, list) or not experts:
            raise AccessDocumentError(f"{where}.experts must be a non-empty list")
        for e in experts:
            if isinstance(e, bool) or not isinstance(e, int) or e < 0 or (
                    num_experts is not None and e >= num_experts):
                raise AccessDocumentError(
                    f"{where}.experts: {e!r} is not an expert index"
                    + (f" below {num_experts}" if num_experts is not None else ""))
        if len(set(experts)) != len(experts):
            raise AccessDocumentError(f"{where}.experts repeats an expert")
        out[name] = tuple(sorted(experts))
    return out


def caller_identity_keys(*, trust_domain: str, namespace: str, service_account: str) -> tuple[str, ...]:
    """The buckets a verified ServiceAccount is filed under (the Rego's ``identity_keys``)."""
    return (f"spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}", f"ns:{namespace}", "*")


@dataclasses.dataclass(frozen=True)
class AccessRule:
    id: str
    allow: bool
    priority: int
    identity: str
    service_account: str | None
    needs_labels: bool
    expert_groups: frozenset[str]
    routes: frozenset[str]

    def matches(self, *, keys: Sequence[str], service_account: str, route: str,
                group: str | None) -> bool:
        if self.identity not in keys:
            return False
        if self.service_account is not None and self.service_account != service_account:
            return False
        # Labels cannot be verified from a token: never enough for an Allow, always for a Deny.
        if self.needs_labels and self.allow:
            return False
        if self.routes and route not in self.routes:
            return False
        # group None: the whole model, which only an unscoped rule covers.
        return not self.expert_groups or (group is not None and group in self.expert_groups)


@dataclasses.dataclass(frozen=True)
class Decision:
    allow: bool
    rule: str  # the deciding rule ("" when none matched)
    reason: str


@dataclasses.dataclass(frozen=True)
class Scope:
    """What a request may use: ``experts`` None means every expert (no enforcement)."""

    decision: Decision
    group: str | None
    experts: tuple[int, ...] | None


def _ranked(hits: list[AccessRule]) -> list[AccessRule]:
    return sorted(hits, key=lambda r: (-r.priority, r.id))


@dataclasses.dataclass(frozen=True)
class AccessTable:
    model: str
    trust_domain: str
    enforced: bool
    revision: str
    rules: tuple[AccessRule, ...]
    # The rules filed by identity key, as the Rego's data is: a decision reads three buckets, not
    # every rule of the model.
    by_identity: Mapping[str, tuple[AccessRule, ...]] = dataclasses.field(default_factory=dict, compare=False)

    def decide(self, *, namespace: str, service_account: str, route: str,
               group: str | None) -> Decision:
        """The Rego decision for this caller, route and group (None: the whole model)."""
        if not self.enforced:
            return Decision(True, "", "no RoutingPolicy targets this model")
        keys = caller_identity_keys(trust_domain=self.trust_domain, namespace=namespace,
                                    service_account=service_account)
        hits = [r for key in keys for r in self.by_identity.get(key, ())
                if r.matches(keys=keys, service_account=service_account, route=route, group=group)]
        denies = _ranked([r for r in hits if not r.allow])
        if denies:
            return Decision(False, denies[0].id, "denied by a Deny rule (Deny wins over Allow)")
        allows = _ranked([r for r in hits if r.allow])
        if allows:
            return Decision(True, allows[0].id, "allowed")
        return Decision(False, "", "no Allow rule matches (default deny)")

    def scope(self, *, namespace: str, service_account: str, route: str, group: str | None,
              groups: Mapping[str, tuple[int, ...]], num_experts: int) -> Scope:
        """The experts a request may activate. ``group`` must be one of ``groups`` (the caller
        checks it and answers 400 otherwise)."""
        ask = dict(namespace=namespace, service_account=service_account, route=route)
        if not self.enforced:
            return Scope(self.decide(**ask, group=group), group,
                         groups[group] if group is not None else None)
        if group is not None:
            d = self.decide(**ask, group=group)
            if not d.allow:
                return Scope(d, group, ())
            # Deny wins: an expert the named group shares with a group a Deny names for this
            # caller stays masked (groups may overlap), as it is for a request naming no group.
            denied = {e for g in groups if g != group
                      for dg in [self.decide(**ask, group=g)] if not dg.allow and dg.rule
                      for e in groups[g]}
            left = tuple(e for e in groups[group] if e not in denied)
            if not left:
                return Scope(Decision(False, d.rule, f"every expert of group {group} is also in a group "
                                                     f"denied to this caller"), group, ())
            return Scope(d, group, left)
        d = self.decide(**ask, group=None)
        if not d.allow:
            allowed = sorted(g for g in groups if self.decide(**ask, group=g).allow)
            if allowed:
                d = Decision(False, d.rule, f"scoped to expert groups {', '.join(allowed)}: name one in "
                                            f"header {EXPERT_GROUP_HEADER}")
            return Scope(d, None, ())
        denied_groups = sorted(g for g in groups if not self.decide(**ask, group=g).allow)
        denied = {e for g in denied_groups for e in groups[g]}
        left = tuple(e for e in range(num_experts) if e not in denied)
        if not left:
            # Nothing left to route to: a refusal, not a forward with every expert masked.
            return Scope(Decision(False, d.rule, f"every expert is in a group denied to this caller "
                                                 f"({', '.join(denied_groups)})"), None, ())
        return Scope(d, None, left)


def _str_list(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AccessDocumentError(f"{where} must be a list of strings")
    return frozenset(value)


def parse_access_document(doc: Any) -> AccessTable:
    """Raises :class:`AccessDocumentError` naming the first bad field."""
    if not isinstance(doc, Mapping):
        raise AccessDocumentError("the access document must be a JSON object")
    if doc.get("version") != VERSION:
        raise AccessDocumentError(f"version must be {VERSION}, got {doc.get('version')!r}")
    for key in ("model", "trustDomain", "revision"):
        if not isinstance(doc.get(key), str) or not doc.get(key):
            raise AccessDocumentError(f"{key} must be a non-empty string")
    if not isinstance(doc.get("enforced"), bool):
        raise AccessDocumentError("enforced must be true or false")
    raw = doc.get("rules")
    if not isinstance(raw, list) or len(raw) > MAX_RULES:
        raise AccessDocumentError(f"rules must be a list of at most {MAX_RULES}")
    rules = []
    for i, r in enumerate(raw):
        where = f"rules[{i}]"
        if not isinstance(r, Mapping):
            raise AccessDocumentError(f"{where} must be an object")
        if r.get("action") not in ("allow", "deny"):
            raise AccessDocumentError(f"{where}.action must be allow or deny")
        for key in ("id", "identity"):
            if not isinstance(r.get(key), str) or not r.get(key):
                raise AccessDocumentError(f"{where}.{key} must be a non-empty string")
        priority = r.get("priority")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise AccessDocumentError(f"{where}.priority must be an integer")
        sa = r.get("serviceAccount")
        if sa is not None and not isinstance(sa, str):
            raise AccessDocumentError(f"{where}.serviceAccount must be a string or null")
        if not isinstance(r.get("needsLabels"), bool):
            raise AccessDocumentError(f"{where}.needsLabels must be true or false")
        rules.append(AccessRule(
            id=r["id"], allow=r["action"] == "allow", priority=priority, identity=r["identity"],
            service_account=sa, needs_labels=r["needsLabels"],
            expert_groups=_str_list(r.get("expertGroups"), f"{where}.expertGroups"),
            routes=_str_list(r.get("routes"), f"{where}.routes")))
    if rules and not doc["enforced"]:
        raise AccessDocumentError("rules given but enforced is false")
    by_identity: dict[str, list[AccessRule]] = {}
    for rule in rules:
        by_identity.setdefault(rule.identity, []).append(rule)
    return AccessTable(model=doc["model"], trust_domain=doc["trustDomain"], enforced=doc["enforced"],
                       revision=doc["revision"], rules=tuple(rules),
                       by_identity={k: tuple(v) for k, v in by_identity.items()})
