"""The chart's GateConfig Argo CD health check (Lua, run with lupa) over the objects the rollout
state machine produces at each phase, as the handler persists them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa
from test_rollout_history_kstatus import V1, V2, Gate, healthy

from sparsegate.domain.rollout import ABORT_ANNOTATION, RETRY_ANNOTATION, Phase

LUA = (Path(__file__).resolve().parents[3] / "charts" / "sparsegate" / "health" / "sparsegate.dev" / "GateConfig"
       / "health.lua").read_text()


def argo_health(obj: dict[str, Any]) -> str:
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    return lua.execute(LUA)["status"]


def test_argo_health_through_a_rollout_pause_rollback_and_retry() -> None:
    g = Gate(V1, pods=10)
    g.tick()
    assert argo_health(g.obj()) == "Healthy"
    g.edit(V2, paused=True)
    assert argo_health(g.obj()) == "Progressing"  # spec edit not observed yet
    assert g.tick().phase == Phase.PAUSED
    # Paused stays Suspended however long it is held (not Progressing forever).
    for _ in range(3):
        g.tick(dt=60)
        assert argo_health(g.obj()) == "Suspended"
    g.edit(paused=False)
    st = g.tick()
    while st.phase != Phase.ANALYSING:
        assert argo_health(g.obj()) == "Progressing"
        st = g.tick()
    assert argo_health(g.obj()) == "Progressing"
    g.tick(canary=healthy(errors=50), stable=healthy(1000))
    assert argo_health(g.obj()) == "Progressing"  # rolling back
    g.until(Phase.ROLLED_BACK)
    assert argo_health(g.obj()) == "Degraded"
    g.tick(annotations={RETRY_ANNOTATION: "x"})
    assert argo_health(g.obj()) == "Progressing"
    assert g.promote_through().phase == Phase.SUCCEEDED
    assert argo_health(g.obj()) == "Healthy"


def test_argo_health_after_abort_until_the_spec_goes_back() -> None:
    g = Gate(V1, pods=10)
    g.tick()
    g.edit(V2)
    g.until(Phase.ANALYSING)
    g.tick(annotations={ABORT_ANNOTATION: "x"})
    g.until(Phase.ABORTED)
    assert argo_health(g.obj()) == "Degraded"
    g.edit(V1)
    g.tick()
    assert argo_health(g.obj()) == "Healthy"
