"""A model pod's watch event reaches its GateConfig's rollout loop (handlers/gateconfig.py): the
pod-change count moves, and a resting GateConfig's loop is woken at once instead of waiting for
its safety-net timer; one mid-rollout is left to its own ticks."""

from __future__ import annotations

import asyncio
from typing import Any

from sparsegate_contracts import names

from sparsegate.handlers import gateconfig
from sparsegate.handlers.periodic import ObjectLoops


def pod(model: str | None) -> dict[str, Any]:
    labels = {names.NAME_LABEL: names.MODEL_SERVER_NAME}
    if model:
        labels[names.MODEL_LABEL] = model
    return {"metadata": {"name": f"{model}-0", "namespace": "ns", "labels": labels}}


async def test_pod_events_count_per_gate_and_wake_only_resting_loops(monkeypatch) -> None:
    loops = ObjectLoops(kind="GateConfig", interval_s=3600)  # only a wake can start a second round
    monkeypatch.setattr(gateconfig, "_loops", loops)
    monkeypatch.setattr(gateconfig, "_pod_changes", {})
    rounds: dict[str, int] = {"resting": 0, "busy": 0}

    def tick_of(name: str):
        async def tick(_: Any) -> None:
            rounds[name] += 1
        return tick

    for name, resting in (("resting", True), ("busy", False)):
        loops.seen(key=("ns", name), event_type="ADDED", tick=tick_of(name),
                   body={"metadata": {"name": name, "namespace": "ns"}, "resting": resting})
    await asyncio.sleep(0.02)
    assert rounds == {"resting": 1, "busy": 1}  # each loop's first round

    index = {("ns", "m-rest"): ["resting"], ("ns", "m-busy"): ["busy"]}
    for p in (pod("m-rest"), pod("m-rest"), pod("m-busy"), pod("m-other"), pod(None)):
        await gateconfig.model_pod_changed_rollout(body=p, namespace="ns", gate_of_model=index)
    await asyncio.sleep(0.02)
    assert gateconfig._pod_changes == {("ns", "resting"): 2, ("ns", "busy"): 1}
    assert rounds == {"resting": 2, "busy": 1}  # two events before the round ran: one round
    await loops.stop()
