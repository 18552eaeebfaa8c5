"""Which pods of a model need its access document, and what status says about it (pure).

A SparseModel with ``spec.access.requestAuth: Enforce`` runs its servers with ``--request-auth
in-cluster``; they serve nothing (503) until they hold the model's access document
(``domain.request_access.access_document``, compiled from the RoutingPolicies of its namespace).
The operator reads what each pod holds (``GET /admin/access`` revision), pushes the document to
every pod holding another revision or none (a restarted pod starts with none), and reports
condition ``AccessRulesApplied``: True only when every live pod of the model holds the current
revision. Models that do not enforce carry no such condition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sparsegate.domain import render
from sparsegate.domain.conditions import listed, merge_conditions
from sparsegate.domain.policy import PolicySource, Rule, rules_from_spec
from sparsegate.domain.request_access import access_document

CONDITION = "AccessRulesApplied"
REVISION_FIELD = "accessRevision"
ALL_PODS_HOLD = "AllPodsHoldRules"
NO_PODS = "NoPods"
NOT_APPLIED = "RulesNotApplied"
RULES_INVALID = "RulesInvalid"


@dataclass(frozen=True)
class PodAccess:
    """What one pod answered about its access rules (``revision`` None: none, or no answer)."""

    name: str
    revision: str | None
    error: str | None = None


def enforced(model: Mapping[str, Any]) -> bool:
    return render.request_auth_enforced(model)


def reported(model: Mapping[str, Any]) -> bool:
    """Whether the model's status carries the condition or the revision (to remove once it stops enforcing)."""
    status = model.get("status") or {}
    return status.get(REVISION_FIELD) is not None or any(
        c.get("type") == CONDITION for c in status.get("conditions") or [])


def model_rules(sources: Iterable[PolicySource], *, namespace: str, trust_domain: str) -> list[Rule]:
    """Every rule of the RoutingPolicies in the model's namespace (targets name models of their own
    namespace only). Raises ValueError/KeyError/TypeError for a spec the expansion cannot read."""
    rules: list[Rule] = []
    for source in sorted(sources, key=lambda s: s.key):
        if source.namespace == namespace:
            rules += rules_from_spec(namespace=source.namespace, name=source.name, spec=source.spec,
                                     trust_domain=trust_domain)
    return rules


def model_document(model: Mapping[str, Any], sources: Iterable[PolicySource], *,
                   trust_domain: str) -> dict[str, Any]:
    """The model's access document from the RoutingPolicies the operator holds."""
    meta = model["metadata"]
    rules = model_rules(sources, namespace=meta["namespace"], trust_domain=trust_domain)
    return access_document(rules, namespace=meta["namespace"], model=meta["name"],
                           serving_port=render.serving_port(model), trust_domain=trust_domain)


def pods_to_push(revision: str, *, reachable: Sequence[str], held: Mapping[str, PodAccess]) -> list[str]:
    """Pods (with an address) that answered holding no rules or another revision. A pod whose
    ``GET /admin/access`` failed (still starting, refused) is not pushed to: the PUT would fail
    the same way; the condition names the error and the next round asks again."""
    return sorted(p for p in reachable
                  if (a := held.get(p)) is not None and a.error is None and a.revision != revision)


def condition(*, revision: str | None, rules: int = 0, pods: Sequence[str], held: Mapping[str, PodAccess],
              withheld: Mapping[str, str] | None = None, error: str | None = None) -> dict[str, str]:
    """``AccessRulesApplied`` for the model's live pods (``pods``) and what each reported.

    ``error``: the document could not be compiled (nothing was pushed). ``withheld``: pods that
    carry the model's labels but are not its pods (no token goes to them; not counted as its pods).
    """
    if error is not None:
        return {"type": CONDITION, "status": "False", "reason": RULES_INVALID,
                "message": f"access rules not compiled, nothing pushed: {error}"[:1024]}
    assert revision is not None
    if not pods:
        return {"type": CONDITION, "status": "True", "reason": NO_PODS,
                "message": f"no pods; each new pod gets revision {revision} ({rules} rules)"}
    missing = [p for p in pods if (held.get(p) is None or held[p].revision != revision)]
    if not missing:
        return {"type": CONDITION, "status": "True", "reason": ALL_PODS_HOLD,
                "message": f"{len(pods)}/{len(pods)} pods hold revision {revision} ({rules} rules)"}
    why = [f"{p}: {held[p].error}" if held.get(p) is not None and held[p].error else
           f"{p}: {'no address yet' if held.get(p) is None else 'holds ' + str(held[p].revision)}"
           for p in missing]
    message = (f"{len(pods) - len(missing)}/{len(pods)} pods hold revision {revision} ({rules} rules); "
               f"not yet: {listed(why)}")
    if withheld:
        message += f"; not the model's pods (no token sent): {listed(sorted(withheld))}"
    return {"type": CONDITION, "status": "False", "reason": NOT_APPLIED, "message": message[:1024]}


def status_patch(previous: Mapping[str, Any], *, wanted: Mapping[str, str] | None, revision: str | None,
                 generation: int | None, now: str) -> dict[str, Any] | None:
    """The status merge patch that records ``wanted`` and the compiled ``revision`` (``wanted`` None:
    drop both, the model does not enforce), or None when status already says so."""
    conditions = [dict(c) for c in previous.get("conditions") or []]
    current = next((c for c in conditions if c.get("type") == CONDITION), None)
    if wanted is None:
        if current is None and previous.get(REVISION_FIELD) is None:
            return None
        return {"conditions": [c for c in conditions if c.get("type") != CONDITION], REVISION_FIELD: None}
    if current is not None and all(current.get(k) == v for k, v in wanted.items()) \
            and current.get("observedGeneration") == generation and previous.get(REVISION_FIELD) == revision:
        return None
    others = [c for c in conditions if c.get("type") != CONDITION]
    mine = merge_conditions([current] if current else [], [dict(wanted)], now=now, observed_generation=generation)
    return {"conditions": others + mine, REVISION_FIELD: revision}
