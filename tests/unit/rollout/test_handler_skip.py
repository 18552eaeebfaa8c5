"""The rollout tick's cheap skip: only a resting, recently checked GateConfig is left alone."""

from __future__ import annotations

import time

from sparsegate.domain.rollout import GateVersion
from sparsegate.controllers.rollout import RESTING_CHECK_S, RolloutLoop, RolloutCache

V1 = {"toolGateThreshold": 0.85}
V2 = {"toolGateThreshold": 0.8}


def body(*, spec_params: dict, phase: str = "Succeeded", stable: dict = V1, annotations: dict | None = None,
         rejected: str | None = None) -> dict:
    rollout = {"phase": phase}
    if rejected:
        rollout["rejectedVersion"] = rejected
    return {"metadata": {"annotations": annotations or {}},
            "spec": {"params": spec_params},
            "status": {"stable": GateVersion.from_params(stable).document(), "rollout": rollout}}


def test_resting_and_recent_is_quiet() -> None:
    now = time.time()
    cache = RolloutCache(last_full_check=now - 1)
    assert RolloutLoop._quiet(body(spec_params=V1), cache=cache, now=now)


def test_stale_check_spec_change_annotation_or_active_phase_is_not_quiet() -> None:
    now = time.time()
    recent = RolloutCache(last_full_check=now - 1)
    assert not RolloutLoop._quiet(body(spec_params=V1), cache=RolloutCache(last_full_check=now - RESTING_CHECK_S), now=now)
    assert not RolloutLoop._quiet(body(spec_params=V2), cache=recent, now=now)
    assert not RolloutLoop._quiet(body(spec_params=V1, annotations={"sparsegate.dev/abort": "x"}), cache=recent, now=now)
    assert not RolloutLoop._quiet(body(spec_params=V1, phase="Analysing"), cache=recent, now=now)
    assert not RolloutLoop._quiet(body(spec_params={"bogus": 1}), cache=recent, now=now)


def test_rejected_version_stays_quiet() -> None:
    now = time.time()
    bad = GateVersion.from_params(V2).version
    assert RolloutLoop._quiet(body(spec_params=V2, phase="RolledBack", rejected=bad),
                              cache=RolloutCache(last_full_check=now - 1), now=now)
