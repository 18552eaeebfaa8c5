"""A model pod's watch event reaches its GateConfig's rollout loop (handlers/gateconfig.py): events
of serving pods (Ready, addressed, not going) move the GateConfig's pod-change count, which makes
its next tick check the pods even when it is resting; other pod events cost nothing."""

from __future__ import annotations

from typing import Any

from sparsegate_contracts import names

from sparsegate.domain.fleet_view import model_view, pod_serving
from sparsegate.handlers import gateconfig


def pod(model: str | None, *, ready: bool = True, ip: str | None = "127.30.0.5", going: bool = False) -> dict[str, Any]:
    labels = {names.NAME_LABEL: names.MODEL_SERVER_NAME}
    if model:
        labels[names.MODEL_LABEL] = model
    meta: dict[str, Any] = {"name": f"{model}-0", "namespace": "ns", "labels": labels}
    if going:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_only_a_ready_addressed_live_pod_is_serving() -> None:
    assert pod_serving(pod("m"))
    assert not pod_serving(pod("m", ready=False))
    assert not pod_serving(pod("m", ip=None))
    assert not pod_serving(pod("m", going=True))
    assert not pod_serving({"metadata": {}, "status": {"podIP": "127.30.0.5"}})  # no conditions yet


async def test_serving_pod_events_count_per_gate(monkeypatch) -> None:
    monkeypatch.setattr(gateconfig, "_pod_changes", {})
    index = {("ns", m): [model_view({"metadata": {"name": m, "namespace": "ns"},
                                     "spec": {"gateConfigRef": {"name": g}}})]
             for m, g in (("m-a", "gate-1"), ("m-b", "gate-1"), ("m-c", "gate-2"))}
    index[("ns", "m-unref")] = [model_view({"metadata": {"name": "m-unref", "namespace": "ns"}, "spec": {}})]
    events = [pod("m-a"), pod("m-b"), pod("m-c"), pod("m-a", ready=False), pod("m-c", ip=None),
              pod("m-c", going=True), pod("m-unbound"), pod("m-unref"), pod(None)]
    for p in events:
        await gateconfig.model_pod_changed_rollout(body=p, namespace="ns", sparsegate_model_views=index)
    assert gateconfig._pod_changes == {("ns", "gate-1"): 2, ("ns", "gate-2"): 1}


async def test_a_serving_pod_brings_its_resting_gates_next_tick_within_the_interval(monkeypatch) -> None:
    import asyncio

    from localcluster.health import wait_for_async
    from sparsegate.handlers.periodic import ObjectLoops

    loops = ObjectLoops(kind="GateConfig", interval_s=0.05)
    monkeypatch.setattr(gateconfig, "_loops", loops)
    monkeypatch.setattr(gateconfig, "_pod_changes", {})
    index = {("ns", "m-a"): [model_view({"metadata": {"name": "m-a", "namespace": "ns"},
                                         "spec": {"gateConfigRef": {"name": "gate-1"}}})]}
    rounds: list[int] = []
    at: list[float] = []
    clock = asyncio.get_running_loop().time

    async def tick(_: Any) -> float:
        rounds.append(gateconfig._pod_changes.get(("ns", "gate-1"), 0))
        at.append(clock())
        return 300.0  # resting

    loops.seen(key=("ns", "gate-1"), event_type=None, body={"metadata": {"name": "gate-1"}}, tick=tick)
    await wait_for_async(lambda: rounds, what="the first tick", timeout_s=10, interval_s=0.005)
    event_at = clock()
    await gateconfig.model_pod_changed_rollout(body=pod("m-a"), namespace="ns", sparsegate_model_views=index)
    await gateconfig.model_pod_changed_rollout(body=pod("m-a"), namespace="ns", sparsegate_model_views=index)
    # Within the 0.05 s interval; a loaded machine may run it late.
    await wait_for_async(lambda: len(rounds) > 1, what="the nudged tick", timeout_s=10, interval_s=0.005)
    await asyncio.sleep(0.1)
    await loops.stop()
    assert rounds == [0, 2]  # one more tick (not two), which sees both events
    assert at[1] - event_at < 2.0, at[1] - event_at  # loosely bounded, far under the 300 s rest
