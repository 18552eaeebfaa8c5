"""GateConfig conditions derived from the rollout status (pure).

:func:`kstatus_conditions` gives ``Ready``, ``Reconciling`` and ``Stalled`` as kstatus (Flux,
kpt) reads them; :func:`conditions` adds the rollout's own ``Progressing`` and ``Degraded`` and
keeps each condition's lastTransitionTime while its status is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sparsegate_contracts.names import RETRY_ANNOTATION

from sparsegate.domain.conditions import merge_conditions
from sparsegate.domain.rollout_codec import Phase, RolloutStatus, iso_time


def kstatus_conditions(*, status: RolloutStatus, target_version: str | None) -> list[dict[str, Any]]:
    """``Ready``, ``Reconciling`` and ``Stalled`` as kstatus (Flux, kpt) reads them.

    Reconciling is True while versions are being pushed or judged; Stalled is True when nothing
    moves until a person acts: the spec is invalid, analysis failed with autoRollback off, or
    the spec still names the version that was rolled back or aborted. A paused rollout is
    neither (Ready False, so kstatus reads InProgress). ``target_version`` is the spec's version
    (None when the spec cannot be parsed).
    """
    phase, reason, message = status.phase, status.reason or status.phase.value, status.message
    if phase == Phase.PAUSED:
        reason = Phase.PAUSED.value  # whatever paused it (RolloutStarted while paused, Paused)
    rejected_wanted = (phase in (Phase.ROLLED_BACK, Phase.ABORTED)
                       and (target_version is None or target_version == status.rejected_version))
    stalled = phase == Phase.FAILED or rejected_wanted
    reconciling = phase in (Phase.PENDING, Phase.PROGRESSING, Phase.ANALYSING, Phase.ROLLING_BACK)
    ready = not stalled and not reconciling and phase != Phase.PAUSED
    if rejected_wanted:
        message = (f"{message}; spec still asks for rejected {status.rejected_version}: change spec.params, "
                   f"or annotate {RETRY_ANNOTATION} to try it again")
    stable = status.stable.version if status.stable else "-"

    def cond(ctype: str, value: bool, why: str, text: str) -> dict[str, Any]:
        return {"type": ctype, "status": "True" if value else "False", "reason": why, "message": text}

    return [
        cond("Ready", ready, reason if not ready else "StableVersionServed",
             message if not ready else f"every instance runs the version the spec asks for ({stable})"),
        cond("Reconciling", reconciling, reason if reconciling else phase.value,
             message if reconciling else f"phase {phase.value}"),
        cond("Stalled", stalled, reason if stalled else phase.value, message if stalled else f"phase {phase.value}"),
    ]


CONDITION_ORDER = ("Ready", "Reconciling", "Stalled", "Progressing", "Degraded")


def conditions(
    *, status: RolloutStatus, target_version: str | None, previous: Sequence[Mapping[str, Any]], now: float,
    refused: tuple[str, str] | None = None,
) -> tuple[dict[str, Any], ...]:
    """All GateConfig conditions: kstatus' three plus ``Progressing`` and ``Degraded`` (the rollout's
    own view: a rollback leaves Degraded True until the next rollout); lastTransitionTime kept while
    a condition's status is unchanged. ``refused``: (reason, message) while pods refuse the gate
    document they are to hold: nothing moves until a person acts, so Stalled and Degraded are True,
    Ready and Reconciling False, with that reason and message (Flux reads Failed, Argo CD Degraded)."""
    phase, reason, message = status.phase, status.reason, status.message
    wanted = {
        "Progressing": phase in (Phase.PROGRESSING, Phase.ANALYSING, Phase.ROLLING_BACK),
        "Degraded": phase in (Phase.ROLLED_BACK, Phase.ABORTED, Phase.FAILED),
    }
    new = [*kstatus_conditions(status=status, target_version=target_version),
           *({"type": ctype, "status": "True" if value else "False", "reason": reason or phase.value,
              "message": message} for ctype, value in wanted.items())]
    if refused is not None:
        why, text = refused
        flagged = {"Ready": False, "Reconciling": False, "Stalled": True, "Degraded": True}
        new = [{**c, "status": "True" if flagged[c["type"]] else "False", "reason": why, "message": text}
               if c["type"] in flagged else c for c in new]
    merged = merge_conditions(previous, new, now=iso_time(now) or "", order=CONDITION_ORDER)
    return tuple(c for c in merged if c["type"] in CONDITION_ORDER)
