"""status.stable has one writer in the rollout state machine (issue 13 item 5).

``domain.rollout._set_stable`` is the only code that puts a version into ``RolloutStatus.stable``;
the first reconcile and every promotion go through it. Checked on the source (any other
``dataclasses.replace(..., stable=...)`` would be a second writer) and on behaviour.
"""

from __future__ import annotations

import ast
import inspect

from sparsegate.domain import rollout, rollout_codec
from sparsegate.domain.rollout import (
    GateVersion,
    Observations,
    Phase,
    PodObservation,
    RolloutStatus,
    next_action,
    parse_spec,
)

V1 = {"toolGateThreshold": 0.85, "entropyBeta": 0.1}
V2 = {**V1, "toolGateThreshold": 0.8}


def _functions_setting_stable(module: object) -> set[str]:
    """Names of the functions whose body calls ``*.replace(..., stable=...)``."""
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    found = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace" \
                    and any(k.arg == "stable" for k in node.keywords):
                found.add(fn.name)
    return found


def test_only_set_stable_writes_stable() -> None:
    assert _functions_setting_stable(rollout) == {"_set_stable"}
    assert _functions_setting_stable(rollout_codec) == set()


def test_first_version_and_promotion_both_come_through_set_stable(monkeypatch) -> None:
    calls: list[str] = []
    real = rollout._set_stable

    def spy(s: RolloutStatus, gate: GateVersion, **kw: str) -> RolloutStatus:
        calls.append(kw["reason"])
        return real(s, gate, **kw)

    monkeypatch.setattr(rollout, "_set_stable", spy)
    d = next_action(spec=parse_spec({"params": V1}), status=RolloutStatus(), obs=Observations(), now=1.0)
    assert d.status.stable is not None and d.status.stable.version == GateVersion.from_params(V1).version
    # A new version with no pods is promoted directly (NoInstances): the second write.
    d = next_action(spec=parse_spec({"params": V2}), status=d.status, obs=Observations(), now=2.0)
    assert d.status.phase == Phase.SUCCEEDED and d.status.stable == GateVersion.from_params(V2)
    assert calls == ["Initialized", "NoInstances"]
    assert [r.gate.version for r in d.status.history] == [GateVersion.from_params(V1).version,
                                                         GateVersion.from_params(V2).version]
    # With a pod on the old version the new one is not stable yet.
    pod = PodObservation(name="m-0", reachable=True, version=GateVersion.from_params(V2).version)
    d = next_action(spec=parse_spec({"params": V1}), status=d.status, obs=Observations(pods=(pod,)), now=3.0)
    assert d.status.stable == GateVersion.from_params(V2) and d.status.phase == Phase.PROGRESSING
