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
