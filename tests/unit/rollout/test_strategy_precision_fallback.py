"""A rollout that changes precisionPolicy runs pod by pod under the default strategy: a checkpoint
pod holds one weight storage, so it cannot serve two versions of different precisions side by
side (the model server refuses such a set with 422). Every other change keeps requests."""

from __future__ import annotations

from test_request_canary_plan import G1, V1, Driver, spec

from sparsegate.domain.request_canary import Strategy, strategy_for
from sparsegate.domain.rollout import GateVersion, Phase

FP32 = {**V1, "precisionPolicy": "fp32"}


def test_strategy_for_keeps_requests_unless_precision_policy_changes() -> None:
    assert strategy_for(Strategy.REQUESTS, stable=G1, canary=GateVersion.from_params({**V1, "entropyBeta": 0.2})) \
        == (Strategy.REQUESTS, "")
    # "auto" written out or left to the default is the same policy.
    assert strategy_for(Strategy.REQUESTS, stable=G1,
                        canary=GateVersion.from_params({**V1, "precisionPolicy": "auto", "entropyBeta": 0.2}))[0] \
        == Strategy.REQUESTS
    strategy, why = strategy_for(Strategy.REQUESTS, stable=G1, canary=GateVersion.from_params(FP32))
    assert strategy == Strategy.INSTANCES and "precisionPolicy auto -> fp32" in why
    # instances asked: instances; no stable yet: nothing to compare.
    assert strategy_for(Strategy.INSTANCES, stable=G1, canary=GateVersion.from_params(FP32))[0] == Strategy.INSTANCES
    assert strategy_for(Strategy.REQUESTS, stable=None, canary=G1) == (Strategy.REQUESTS, "")


def test_precision_change_rolls_out_pod_by_pod_and_says_why() -> None:
    d = Driver(4, spec(V1))
    assert d.tick().phase == Phase.SUCCEEDED
    d.raw = spec(FP32)  # the spec asks for strategy requests
    st = d.tick()
    assert st.phase == Phase.PROGRESSING and st.strategy == Strategy.INSTANCES
    canary = GateVersion.from_params(FP32).version
    # 5 % of 4 pods: one pod gets the fp32 version alone, the others keep the stable alone.
    assert sorted(d.fleet.keys.values()) == sorted([canary, G1.version, G1.version, G1.version])
    assert d.raw_status["rollout"]["strategy"] == "instances" and "canaryWeight" not in d.raw_status["rollout"]
    started = next(a for a in d.actions if getattr(a, "reason", "") == "RolloutStarted")
    assert "precisionPolicy auto -> fp32" in started.message, started.message
