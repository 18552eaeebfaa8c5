"""The built-in default gate on the running pods of a model without ``spec.gateConfigRef`` (pure).

A model's new pods start with the gate its reconcile renders into ``<model>-gate``; the gate of a
running pod is changed only by a push (``PUT /admin/gate``). A GateConfig's rollout pushes its
gate to the pods of the models that reference it; once a model's reference is removed no rollout
covers it, and its running pods kept the last gate pushed to them (a canary too, mid-rollout)
while the ConfigMap, ``status.gateVersion`` and every new pod had the default: one model served
two gates until its pods restarted.

So the reconcile that renders the default gate over something else marks the model with
condition ``DefaultGateApplied=False`` (:func:`reconcile_condition`), in the same status write
that names the default's version: level-based, an operator restart or a failed push loses
nothing. While the condition is False a loop (``handlers.defaultgate``) reads what each pod
serves (``/healthz``), pushes the default to every pod that serves something else, and writes the
condition True once every live pod serves it; the loop then ends. Models that never referenced a
GateConfig, and models at rest, cost nothing: no loop, no request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sparsegate_contracts import gate as gatedoc

from sparsegate.domain import conditions as c
from sparsegate.domain.conditions import listed, merge_conditions
from sparsegate.domain.gate import GateResolution, default_document

CONDITION = "DefaultGateApplied"
ALL_PODS_SERVE = "AllPodsServeDefault"
NO_PODS = "NoPods"
NOT_APPLIED = "PodsServeAnotherGate"
PENDING = "GateConfigRefRemoved"
# Degraded=False messages (``conditions.degraded_condition``) of a gate that came from a GateConfig.
_REFERENCED_SOURCES = frozenset({"gate from status.stable", "gate from spec.params"})


def _condition(model_or_status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((x for x in model_or_status.get("conditions") or [] if x.get("type") == CONDITION), None)


def referenced(model: Mapping[str, Any]) -> bool:
    return bool(((model.get("spec") or {}).get("gateConfigRef") or {}).get("name"))


def pending(model: Mapping[str, Any]) -> bool:
    """The model has no GateConfig and its pods may not all serve the default gate yet."""
    cond = _condition(model.get("status") or {})
    return not referenced(model) and cond is not None and cond.get("status") != "True"


def _may_serve_another_gate(previous: Mapping[str, Any], version: str) -> bool:
    """Whether the pods of a model whose status was ``previous`` may hold a gate other than the
    default ``version``: status named another gate, a GateConfig was its gate's source (its stable
    may be the default, a canary still on the pods), or a push of the default is still pending."""
    if previous.get("gateVersion") and previous["gateVersion"] != version:
        return True
    cond = _condition(previous)
    if cond is not None and cond.get("status") != "True":
        return True
    for x in previous.get("conditions") or []:
        if x.get("type") == c.ConditionType.DEGRADED.value and (
                x.get("reason") in c.GATE_REASONS
                or (x.get("status") == "False" and x.get("message") in _REFERENCED_SOURCES)):
            return True
    return False


def reconcile_conditions(previous: Mapping[str, Any], conditions: list[dict[str, Any]], *,
                         gate: GateResolution, gate_written: bool, now: str,
                         generation: int | None) -> list[dict[str, Any]]:
    """``conditions`` (a reconcile's, merged over ``previous``'s) with ``DefaultGateApplied`` as that
    reconcile leaves it: False when it writes the default gate over a status that says the pods may
    serve another one (:func:`_may_serve_another_gate`); dropped when the model has a GateConfig
    (its rollout pushes the pods); otherwise as it was."""
    if gate.source != "default":
        return [x for x in conditions if x.get("type") != CONDITION]
    if gate.document is None or not gate_written or not _may_serve_another_gate(previous, gate.document.version):
        return conditions
    current = _condition(previous)
    if current is not None and current.get("status") != "True":
        return conditions  # pending already: its loop's message stands
    wanted = {"type": CONDITION, "status": "False", "reason": PENDING,
              "message": f"gate {gate.document.version} (the default) is pushed to the running pods"}
    return merge_conditions(conditions, [wanted], now=now, observed_generation=generation)


def wanted_document(model: Mapping[str, Any]) -> gatedoc.GateDocument | None:
    """The default gate the pods must serve: the one status names as rendered (None: the model's
    reconcile has not rendered the default yet, or renders another gate)."""
    experts = int(((model.get("spec") or {}).get("model") or {}).get("experts") or 0)
    doc = default_document(experts)
    return doc if (model.get("status") or {}).get("gateVersion") == doc.version else None


def pods_to_push(version: str, *, reachable: Sequence[str], serving: Mapping[str, str | None]) -> list[str]:
    """Pods (with an address) whose ``/healthz`` answered serving anything but ``version`` alone (a
    pod that did not answer is asked again next round: a push would fail the same way)."""
    return sorted(p for p in reachable if (s := serving.get(p)) is not None and s != version)


def condition(version: str, *, pods: Sequence[str], serving: Mapping[str, str | None],
              errors: Mapping[str, str] | None = None) -> dict[str, str]:
    """``DefaultGateApplied`` for the model's live pods (``pods``) and what each serves now."""
    if not pods:
        return {"type": CONDITION, "status": "True", "reason": NO_PODS,
                "message": f"no pods; each new pod starts with gate {version} (the default)"}
    missing = [p for p in pods if serving.get(p) != version]
    if not missing:
        return {"type": CONDITION, "status": "True", "reason": ALL_PODS_SERVE,
                "message": f"{len(pods)}/{len(pods)} pods serve gate {version} (the default)"}
    errors = errors or {}
    why = [f"{p}: {errors[p]}" if errors.get(p) else
           f"{p}: {'no answer' if serving.get(p) is None else 'serves ' + str(serving[p])}" for p in missing]
    return {"type": CONDITION, "status": "False", "reason": NOT_APPLIED,
            "message": (f"{len(pods) - len(missing)}/{len(pods)} pods serve gate {version} (the default); "
                        f"not yet: {listed(why)}")[:1024]}


def status_patch(previous: Mapping[str, Any], *, wanted: Mapping[str, str], version: str,
                 generation: int | None, now: str) -> dict[str, Any] | None:
    """The status merge patch recording ``wanted`` for the default ``version``, or None when status
    already says so or no longer asks for it (a reference back, another gate rendered since)."""
    current = _condition(previous)
    if current is None or current.get("status") == "True" or previous.get("gateVersion") != version:
        return None
    if all(current.get(k) == v for k, v in wanted.items()):
        return None
    return {"conditions": merge_conditions(previous.get("conditions") or [], [dict(wanted)], now=now,
                                           observed_generation=current.get("observedGeneration", generation))}
