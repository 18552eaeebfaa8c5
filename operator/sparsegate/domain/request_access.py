"""RoutingPolicy rules → one model's per-request access document (pure).

The rules are those ``sparsegate.domain.policy.rules_from_spec`` expands (the same ones pushed to
OPA); a model keeps those whose target is it or ``<ns>/*`` and whose ports admit its serving port
(TCP), since every request arrives there. The document's shape and its decision semantics are
``sparsegate_contracts.request_access``: the model server decides each request with it, with the
Rego's answer (a unit test asks the real OPA the same questions and compares).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sparsegate_contracts.canonical import sha256_of
from sparsegate_contracts.request_access import VERSION

from .policy import ANY, Rule, target_key


def _admits_port(rule: Rule, port: int) -> bool:
    return not rule.ports or any(p.port == port and p.protocol == "tcp" for p in rule.ports)


def model_rules(rules: Iterable[Rule], *, namespace: str, model: str, serving_port: int) -> list[Rule]:
    """The rules a request to this model on its serving port can match, in a stable order."""
    keys = {target_key(namespace=namespace, model=model), target_key(namespace=namespace, model=ANY)}
    return sorted((r for r in rules if r.target_key in keys and _admits_port(r, serving_port)),
                  key=lambda r: r.id)


def targets_model(rules: Iterable[Rule], *, namespace: str, model: str) -> bool:
    """Whether any RoutingPolicy names this model (or every model of its namespace), whatever port:
    once one does, requests are default deny."""
    keys = {target_key(namespace=namespace, model=model), target_key(namespace=namespace, model=ANY)}
    return any(r.target_key in keys for r in rules)


def access_document(rules: Iterable[Rule], *, namespace: str, model: str, serving_port: int,
                    trust_domain: str) -> dict[str, Any]:
    """The access document (``sparsegate_contracts.request_access``) for one model."""
    all_rules = list(rules)
    kept = model_rules(all_rules, namespace=namespace, model=model, serving_port=serving_port)
    body: dict[str, Any] = {
        "version": VERSION,
        "model": target_key(namespace=namespace, model=model),
        "trustDomain": trust_domain,
        "enforced": targets_model(all_rules, namespace=namespace, model=model),
        "rules": [{
            "id": r.id, "action": r.action.value, "priority": r.priority, "identity": r.identity_key,
            "serviceAccount": r.service_account, "needsLabels": bool(r.match_labels),
            "expertGroups": list(r.expert_groups), "routes": list(r.routes),
        } for r in kept],
    }
    return {**body, "revision": sha256_of(body)}
