"""Which gate document a SparseModel's new pods start with.

A GateConfig's ``status.stable`` (written on first reconcile, then by the rollout controller) wins;
until it exists the operator falls back to ``spec.params``. Versioning and validation come from
``sparsegate_contracts.gate`` so the operator and the model server hash params identically.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from sparsegate_contracts import gate as gatedoc


@dataclasses.dataclass(frozen=True)
class GateResolution:
    """Either a usable document or the reason there is none (``document`` is None then)."""

    document: gatedoc.GateDocument | None
    source: str
    """Where the document came from: ``status.stable``, ``spec.params``, ``default`` or ``missing``."""
    error: str | None = None


def stable_from_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The ``status.stable`` block for params exactly as written (content-addressed)."""
    return gatedoc.make_document(params).to_json()


def resolve(gateconfig: Mapping[str, Any] | None, *, referenced: bool,
            num_experts: int) -> GateResolution:
    """Resolve the gate for a model with ``num_experts`` experts.

    ``referenced`` says whether the model names a GateConfig at all: without a reference the
    built-in defaults apply, with their experts-per-token bounds fitted to the model (a 2-expert
    model gets max 2, not the default 4 it could never serve); with a reference that does not
    exist there is no gate (Degraded).
    """
    if not referenced:
        return _checked(default_document(num_experts).to_json(), "default", num_experts)
    if gateconfig is None:
        return GateResolution(document=None, source="missing", error="GateConfig not found")
    stable = (gateconfig.get("status") or {}).get("stable")
    if stable:
        resolution = _checked(stable, "status.stable", num_experts)
        if resolution.error is not None and _hash_mismatch(resolution.error):
            name = (gateconfig.get("metadata") or {}).get("name")
            version = stable.get("version") if isinstance(stable, Mapping) else None
            resolution = dataclasses.replace(resolution, error=(
                f"GateConfig {name} status.stable {version}: {resolution.error}: its params no longer hash to its "
                f"version and checksum (edited by hand, or written back by a tool restoring status); put back the "
                f"params of {version} that status.history holds, or remove status.stable and the operator "
                f"restores it from status.history"))
        return resolution
    params = (gateconfig.get("spec") or {}).get("params") or {}
    try:
        doc = gatedoc.make_document(params, num_experts=num_experts)
    except gatedoc.GateParamsError as e:
        return GateResolution(document=None, source="spec.params", error=str(e))
    return GateResolution(document=doc, source="spec.params")


def _hash_mismatch(error: str) -> bool:
    """``gatedoc.parse_document``'s refusal of a document whose params do not hash to it."""
    return error.startswith("checksum mismatch") or "is not the content address of params" in error


def default_document(num_experts: int) -> gatedoc.GateDocument:
    """The built-in gate for a model of ``num_experts`` experts (unchanged when it already fits)."""
    params = gatedoc.DEFAULT_PARAMS
    cap = gatedoc.default_max_experts(num_experts)
    if cap == params["maxExpertsPerToken"]:
        return gatedoc.DEFAULT_DOCUMENT
    return gatedoc.make_document({**params, "maxExpertsPerToken": cap,
                                  "minExpertsPerToken": min(params["minExpertsPerToken"], cap)})


def _checked(doc: Mapping[str, Any], source: str, num_experts: int) -> GateResolution:
    try:
        parsed = gatedoc.parse_document(doc, num_experts=num_experts)
    except gatedoc.GateParamsError as e:
        return GateResolution(document=None, source=source, error=str(e))
    return GateResolution(document=parsed, source=source)
