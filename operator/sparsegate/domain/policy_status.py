"""RoutingPolicy status, derived from what the last sync observed (pure).

Conditions (a list keyed by `type`):
- Ready: OPA holds this generation of the policy and its decisions are published.
- Degraded: the operator cannot reach OPA (the published allow-list is the last good one, or
  narrower, never wider, until OPA answers again), OPA refused the input, or the compiled
  allow-list does not fit (``PolicyTooLarge``).
- Reconciling (kstatus): not Ready yet and not Stalled: OPA does not hold this generation yet or
  cannot be reached (the sync retries on its own).
- Stalled (kstatus): OPA refused the policy or its data, or the allow-list compiled from all
  policies and pods does not fit the agents' policy map or its ConfigMap (``PolicyTooLarge``, with
  needed vs capacity: the last published allow-list stays enforced); retrying the same input
  cannot help, the policies or the pods have to change.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sparsegate.domain.conditions import merge_conditions


class ConditionType(str, enum.Enum):
    READY = "Ready"
    """OPA holds this generation and the allow-list from its decisions is published."""
    DEGRADED = "Degraded"
    """OPA is unreachable (the operator fails closed and retries), refused the input, or the
    allow-list does not fit."""
    RECONCILING = "Reconciling"
    """kstatus: not Ready and not Stalled; the next sync may get there without a spec change."""
    STALLED = "Stalled"
    """kstatus: OPA rejected this generation's input, or the allow-list does not fit
    (PolicyTooLarge); retrying the same input cannot help."""


class Reason(str, enum.Enum):
    LOADED = "LoadedInOPA"
    """Ready=True: read back from OPA after the push."""
    NOT_LOADED = "NotLoadedInOPA"
    """Ready=False: OPA answered but does not hold this generation (yet)."""
    OPA_UNREACHABLE = "OPAUnreachable"
    """Ready=False / Degraded=True: no answer from OPA; last good decisions kept."""
    OPA_REJECTED = "OPARejected"
    """Ready=False / Degraded=True: OPA refused the policy or data (see message)."""
    POLICY_TOO_LARGE = "PolicyTooLarge"
    """Ready=False / Degraded=True / Stalled=True: the allow-list does not fit (needed vs capacity
    in the message); not published, the last published one stays."""
    AS_EXPECTED = "AsExpected"
    """Degraded=False: the last sync reached OPA."""


@dataclass(frozen=True)
class SyncOutcome:
    """What one sync learnt about one RoutingPolicy."""

    generation: int
    loaded_generation: int | None  # as read back from OPA; None if absent or OPA unreachable
    decision_count: int | None  # None: keep the previous count (nothing new was decided)
    revision: str | None
    error: str | None = None  # set when OPA could not be used
    rejected: bool = False  # the error is OPA refusing our input, not OPA being down
    too_large: str | None = None  # the allow-list did not fit (domain.policy_capacity message)


def _condition(type_: ConditionType, status: bool, reason: Reason, message: str) -> dict[str, Any]:
    return {"type": type_.value, "status": "True" if status else "False", "reason": reason.value, "message": message}


def status_patch(
    *, outcome: SyncOutcome, previous: Mapping[str, Any] | None, now: str
) -> dict[str, Any]:
    """The `status` to write. Keeps lastTransitionTime when a condition's status did not change."""
    previous = previous or {}
    loaded = outcome.loaded_generation == outcome.generation
    if outcome.error:
        reason = Reason.OPA_REJECTED if outcome.rejected else Reason.OPA_UNREACHABLE
        conditions = [
            _condition(ConditionType.READY, False, reason, outcome.error),
            _condition(ConditionType.DEGRADED, True, reason, f"{outcome.error}; last good allow-list kept"),
        ]
        loaded_in_opa = False if outcome.rejected else bool(previous.get("loadedInOPA", False))
    elif outcome.too_large:
        conditions = [
            _condition(ConditionType.READY, False, Reason.POLICY_TOO_LARGE, outcome.too_large),
            _condition(ConditionType.DEGRADED, True, Reason.POLICY_TOO_LARGE, outcome.too_large),
        ]
        loaded_in_opa = loaded
    else:
        conditions = [
            _condition(
                ConditionType.READY, loaded, Reason.LOADED if loaded else Reason.NOT_LOADED,
                f"revision {outcome.revision}" if loaded else f"OPA holds generation {outcome.loaded_generation}",
            ),
            _condition(ConditionType.DEGRADED, False, Reason.AS_EXPECTED, "OPA reachable"),
        ]
        loaded_in_opa = loaded
    too_large = bool(outcome.too_large) and not outcome.error
    stalled = (bool(outcome.error) and outcome.rejected) or too_large
    reconciling = not (loaded and not outcome.error) and not stalled
    ready = conditions[0]
    conditions += [
        _condition(ConditionType.RECONCILING, reconciling, Reason(ready["reason"]), ready["message"]),
        _condition(ConditionType.STALLED, True, Reason(ready["reason"]), ready["message"])
        if stalled else _condition(ConditionType.STALLED, False, Reason.AS_EXPECTED, "no input refused by OPA"),
    ]
    merged = merge_conditions(previous.get("conditions") or (), conditions, now=now,
                              observed_generation=outcome.generation, order=[t.value for t in ConditionType])
    patch: dict[str, Any] = {
        "observedGeneration": outcome.generation,
        "loadedInOPA": loaded_in_opa,
        "conditions": merged,
    }
    if outcome.decision_count is not None:
        patch["decisionCount"] = outcome.decision_count
    if outcome.revision and not outcome.error:
        patch["opaRevision"] = outcome.revision
    return patch


def status_changed(*, previous: Mapping[str, Any] | None, patch: Mapping[str, Any]) -> bool:
    """Whether writing `patch` would change anything (timers must not write every tick)."""
    previous = previous or {}
    return any(previous.get(k) != v for k, v in patch.items())
