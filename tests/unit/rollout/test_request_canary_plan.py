"""spec.rollout.strategy: requests — the state machine pushes every pod the stable + canary set
at the step's weight, judges per version, promotes to the canary alone and rolls back to the
stable alone (domain.request_canary + domain.rollout), tick by tick against a simulated fleet."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from sparsegate_contracts.canary import document_key, parse_gate_set, set_key

from sparsegate.domain.analysis import GroupMetrics
from sparsegate.domain.request_canary import GateSetTarget, Strategy
from sparsegate.domain.rollout import (
    GateVersion,
    Observations,
    Phase,
    PodObservation,
    PushGate,
    RolloutStatus,
    SpecError,
    desired_versions,
    next_action,
    parse_spec,
)

V1 = {"toolGateThreshold": 0.85, "entropyBeta": 0.1}
V2 = {"toolGateThreshold": 0.8, "entropyBeta": 0.1}
G1, G2 = GateVersion.from_params(V1), GateVersion.from_params(V2)


def spec(params: dict, **rollout: object) -> dict:
    return {"params": params, "rollout": {"analysisInterval": "10s", "minRequests": 20, "strategy": "requests",
                                          **rollout}}


def group(requests: float = 100, errors: float = 0) -> GroupMetrics:
    return GroupMetrics(pods=2, seconds=10, requests=requests, errors=errors,
                        duration_buckets={0.1: requests, math.inf: requests}, mean_active_experts=1.3)


@dataclass
class Fleet:
    """Pods that apply pushed documents as the model server does and report their set key."""

    keys: dict[str, str]
    documents: list[dict] = field(default_factory=list)
    unreachable: set[str] = field(default_factory=set)  # an address, no answer (pushes are lost)
    pending: set[str] = field(default_factory=set)  # not started: no address, no answer

    def observe(self) -> tuple[PodObservation, ...]:
        silent = self.unreachable | self.pending
        return tuple(PodObservation(name=n, reachable=n not in silent, version=None if n in silent else k,
                                    addressed=n not in self.pending) for n, k in sorted(self.keys.items()))

    def apply(self, actions: Iterable[object]) -> None:
        for a in actions:
            if isinstance(a, PushGate) and a.pod not in self.unreachable | self.pending:
                doc = a.gate.document()
                parse_gate_set(doc)  # what the server would accept
                self.keys[a.pod] = document_key(doc)
                self.documents.append(doc)


class Driver:
    def __init__(self, n: int, raw: dict) -> None:
        self.fleet = Fleet({f"m-{i}": G1.version for i in range(n)})
        self.raw, self.now, self.status, self.actions = raw, 1000.0, RolloutStatus(), []

    def tick(self, *, dt: float = 1.0, canary: GroupMetrics | None = None, stable: GroupMetrics | None = None,
             **requests: bool) -> RolloutStatus:
        self.now += dt
        s = parse_spec(self.raw)
        obs = Observations(pods=self.fleet.observe(), canary_metrics=canary, stable_metrics=stable, fleet_qps=20.0,
                           stable_error_rate=0.0, **requests)
        d = next_action(spec=s, status=self.status, obs=obs, now=self.now)
        # Persisted and read back before acting, as the handler does (a restart reads the same).
        self.raw_status = d.status.to_status(steps=s.steps)
        self.status = RolloutStatus.from_status(self.raw_status)
        self.fleet.apply(d.actions)
        self.actions += d.actions
        return self.status


def started(n: int = 2, **rollout: object) -> Driver:
    d = Driver(n, spec(V1, **rollout))
    assert d.tick().phase == Phase.SUCCEEDED
    d.raw = spec(V2, **rollout)
    return d


def test_parse_spec_strategy_and_sticky_header() -> None:
    s = parse_spec({"params": V1})
    assert s.strategy == Strategy.REQUESTS and s.sticky_header == "x-session-id"  # the default
    assert parse_spec({"params": V1, "rollout": {"strategy": "instances"}}).strategy == Strategy.INSTANCES
    s = parse_spec(spec(V1, stickyHeader="x-user"))
    assert s.strategy == Strategy.REQUESTS and s.sticky_header == "x-user"
    with pytest.raises(SpecError, match="spec.rollout.strategy"):
        parse_spec(spec(V1, strategy="pods"))
    with pytest.raises(SpecError, match="spec.rollout.stickyHeader"):
        parse_spec(spec(V1, stickyHeader="X Bad"))


@pytest.mark.parametrize("replicas", [1, 2, 10])
def test_every_step_is_a_share_of_requests_on_every_pod(replicas: int) -> None:
    d = started(replicas, stickyHeader="x-user")
    st = d.tick()
    assert st.phase == Phase.PROGRESSING and st.strategy == Strategy.REQUESTS and st.step_percent == 5
    want = set_key(G1.version, G2.version, 0.05, "x-user")
    assert set(d.fleet.keys.values()) == {want}  # every pod, whatever the replica count
    assert d.fleet.documents[-1]["canaryWeight"] == 0.05 and d.fleet.documents[-1]["stickyHeader"] == "x-user"
    rollout = d.raw_status["rollout"]
    assert rollout["canaryWeight"] == 0.05 and rollout["strategy"] == "requests"
    assert rollout["canaryInstances"] == f"{replicas}/{replicas}"
    started_event = next(a for a in d.actions if getattr(a, "reason", "") == "RolloutStarted")
    assert f"5% of requests on all {replicas} instances" in started_event.message
    assert d.tick().phase == Phase.ANALYSING
    st = d.tick(dt=11, canary=group(), stable=group(1000))
    assert st.phase == Phase.PROGRESSING and st.step_percent == 20
    assert set(d.fleet.keys.values()) == {set_key(G1.version, G2.version, 0.2, "x-user")}
    assert d.tick().phase == Phase.ANALYSING
    d.tick(dt=11, canary=group(), stable=group(1000))
    assert set(d.fleet.keys.values()) == {set_key(G1.version, G2.version, 1.0, "x-user")}
    assert d.tick().phase == Phase.ANALYSING
    st = d.tick(dt=11, canary=group(2000), stable=None)
    # Promoted: the canary becomes stable, alone (weight 0, no canary held).
    assert st.phase == Phase.SUCCEEDED and st.stable == G2 and st.canary is None and st.strategy is None
    assert set(d.fleet.keys.values()) == {G2.version} and "canary" not in d.fleet.documents[-1]
    assert "canaryWeight" not in d.raw_status["rollout"]


def test_a_failing_canary_is_rolled_back_at_the_first_step_to_the_stable_alone() -> None:
    d = started(2)
    d.tick()
    assert d.tick().phase == Phase.ANALYSING
    st = d.tick(dt=2, canary=group(100, errors=40), stable=group(1000))
    assert st.phase == Phase.ROLLING_BACK and st.reason == "AnalysisFailed" and st.step == 0
    assert set(d.fleet.keys.values()) == {G1.version} and d.fleet.documents[-1] == G1.document()
    st = d.tick()
    assert st.phase == Phase.ROLLED_BACK and st.rejected_version == G2.version


def test_abort_drops_the_canary() -> None:
    d = started(3)
    d.tick()
    st = d.tick(abort=True)
    assert st.phase == Phase.ROLLING_BACK and set(d.fleet.keys.values()) == {G1.version}
    assert d.tick().phase == Phase.ABORTED


def test_a_restarted_operator_resumes_the_same_weight_without_pushing() -> None:
    d = started(2)
    d.tick()
    d.tick()
    pushed = len(d.fleet.documents)
    # A new process reads status only: it wants the pods exactly where they are.
    resumed = RolloutStatus.from_status(d.raw_status)
    assert resumed.strategy == Strategy.REQUESTS and resumed.phase == Phase.ANALYSING
    desired = desired_versions(status=resumed, pods=d.fleet.observe())
    assert all(isinstance(g, GateSetTarget) and g.weight == 0.05 for g in desired.values())
    assert {g.version for g in desired.values()} == set(d.fleet.keys.values())
    d.status = resumed
    d.tick(dt=2, canary=group(), stable=group(1000))
    assert len(d.fleet.documents) == pushed


def test_analysis_expects_the_weight_as_the_canary_share_of_traffic() -> None:
    # 10 pods at 5 % of requests: under the instances plan the canary pod would carry 10 % of the
    # traffic; here 5 % of 20 qps is expected, so 1 qps of canary traffic is plenty.
    d = started(10)
    d.tick()
    d.tick()
    st = d.tick(dt=11, canary=group(requests=30), stable=group(570))
    assert st.phase == Phase.PROGRESSING and st.step_percent == 20, st.message


def test_an_instance_silent_at_abort_holds_the_rollback_until_it_answers() -> None:
    # m-2 holds the canary set and stops answering (a partition: the kubelet may still route to it).
    d = started(3)
    d.tick()
    assert d.tick().phase == Phase.ANALYSING
    held = d.fleet.keys["m-2"]
    d.fleet.unreachable = {"m-2"}
    d.tick(abort=True)
    for _ in range(3):
        st = d.tick()
        # Not Aborted ("every instance back on stable") while m-2 may still serve the canary.
        assert st.phase == Phase.ROLLING_BACK, st.message
        assert "1 unreachable instance(s) that may still hold" in st.message and "m-2" in st.message
    assert d.fleet.keys == {"m-0": G1.version, "m-1": G1.version, "m-2": held}
    d.fleet.unreachable = set()  # it answers again: it is pushed the stable alone, then the rollback rests
    d.tick()
    assert d.fleet.keys["m-2"] == G1.version
    st = d.tick()
    assert st.phase == Phase.ABORTED and st.message.startswith("aborted by annotation") and "waiting" not in st.message


def test_a_pending_instance_neither_holds_a_step_nor_a_rollback() -> None:
    # A scale-up mid-step whose pod waits for a node (no address): it serves nothing and starts from
    # the stable ConfigMap, so the step is not held past progressDeadline (rolling a healthy canary back).
    d = started(2, progressDeadline="30s")
    d.tick()
    assert d.tick().phase == Phase.ANALYSING
    d.fleet.keys["m-9"] = G1.version
    d.fleet.pending = {"m-9"}
    for _ in range(6):  # each step: verified (m-9 aside), then analysed past its 10 s window
        st = d.tick(dt=20, canary=group(), stable=group(1000))
        assert st.phase in (Phase.PROGRESSING, Phase.ANALYSING), st.message
    assert st.step_percent == 100 and st.reason != "ProgressDeadlineExceeded"
    d.fleet.pending = set()  # it started, on the stable version: it is pushed the step's set
    d.tick()
    assert d.fleet.keys["m-9"] == set_key(G1.version, G2.version, 1.0)
    d.fleet.pending = {"m-9"}
    st = d.tick(abort=True)
    assert st.phase == Phase.ROLLING_BACK
    assert d.tick().phase == Phase.ABORTED


def test_a_sticky_header_edit_reaches_every_pod_at_once() -> None:
    # Pods keying sessions by different headers route one session to different versions.
    d = started(2, stickyHeader="x-user")
    d.tick()
    assert d.tick().phase == Phase.ANALYSING
    d.raw = spec(V2, stickyHeader="x-tenant")
    d.fleet.keys["m-9"] = G1.version  # and a pod scaled up meanwhile
    st = d.tick(canary=group(), stable=group(1000))
    assert st.phase == Phase.PROGRESSING  # the step is verified again: its routing changed
    assert {doc["stickyHeader"] for doc in d.fleet.documents[-3:]} == {"x-tenant"}
    assert set(d.fleet.keys.values()) == {set_key(G1.version, G2.version, 0.05, "x-tenant")}
    assert d.tick().phase == Phase.ANALYSING
