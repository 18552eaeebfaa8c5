"""A faithful port of kstatus' ``Compute`` for custom resources (sigs.k8s.io/cli-utils
pkg/kstatus/status, read at commit 5895ad6c17dd06b99c1e5c8af17e2b12a3504fad).

Only the path a custom resource takes is ported (no ``legacyTypes`` entry matches our kinds):

1. ``checkGenericProperties`` (generic.go): ``metadata.deletionTimestamp`` → Terminating; then
   ``checkGeneration``: when ``status.observedGeneration`` exists and differs from
   ``metadata.generation`` → InProgress (LatestGenerationNotObserved); then the first condition, in
   list order, that is ``Reconciling=True`` → InProgress or ``Stalled=True`` → Failed.
2. ``checkReadyCondition`` (status.go): the first ``Ready`` condition: True → Current, False or
   Unknown → InProgress; any other value is skipped.
3. Otherwise Current ("Resource is current").

Flux's kustomize-controller health checks and kpt's live apply wait on exactly this result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

IN_PROGRESS, FAILED, CURRENT, TERMINATING = "InProgress", "Failed", "Current", "Terminating"


def compute(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(status, message) kstatus gives ``obj``."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return TERMINATING, "Resource scheduled for deletion"
    generation = meta.get("generation")
    if generation is not None and "observedGeneration" in status:
        if status["observedGeneration"] != generation:
            return IN_PROGRESS, (f"{obj.get('kind')} generation is {generation}, but latest observed "
                                 f"generation is {status['observedGeneration']}")
    conditions = status.get("conditions") or []
    for cond in conditions:
        if cond.get("type") == "Reconciling" and cond.get("status") == "True":
            return IN_PROGRESS, cond.get("message", "")
        if cond.get("type") == "Stalled" and cond.get("status") == "True":
            return FAILED, cond.get("message", "")
    for cond in conditions:
        if cond.get("type") != "Ready":
            continue
        if cond.get("status") == "True":
            return CURRENT, "Resource is Ready"
        if cond.get("status") in ("False", "Unknown"):
            return IN_PROGRESS, cond.get("message", "")
    return CURRENT, "Resource is current"
