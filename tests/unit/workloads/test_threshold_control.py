"""The PI threshold controller, driven by the real dynamic gate (`gating.DynamicGate`) on hidden
states from two input distributions: a confident one and a flat one that, at the same threshold,
takes about 2.5x the experts. The controller must hold the target through the shift."""

from __future__ import annotations

import pytest
import torch

from sparsegate_contracts.gate import GateParams
from sparsegate_workload.gating import DynamicGate
from sparsegate_workload.threshold_control import (ThresholdControl, ThresholdControlError,
                                                   ThresholdController)

D_MODEL, EXPERTS, BATCH = 64, 8, 256


def _gate() -> DynamicGate:
    gate = DynamicGate(D_MODEL, EXPERTS)
    gate.reset_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        gate.weight.mul_(3.0)  # the built-in model's router init scale: confidences spread
    return gate.requires_grad_(False)


def _traffic(kind: str, g: torch.Generator) -> torch.Tensor:
    """Confident traffic: unit-scale hidden states. Flat: the same directions at 1/4 norm, so
    the softmax is flatter and top-p keeps more experts."""
    x = torch.randn(BATCH, D_MODEL, generator=g)
    return x if kind == "confident" else 0.25 * x


def _experts(gate: DynamicGate, x: torch.Tensor, threshold: float) -> float:
    routing = gate(x, confidence_threshold=threshold, min_experts=1, max_experts=EXPERTS,
                   capacity_factor=None)
    return float(routing.selected.float().mean())


def _run(controller: ThresholdController, schedule: list[str]) -> list[tuple[float, float]]:
    gate, g = _gate(), torch.Generator().manual_seed(1)
    trace = []
    for kind in schedule:
        threshold = controller.threshold
        measured = _experts(gate, _traffic(kind, g), threshold)
        controller.update(measured)
        trace.append((threshold, measured))
    return trace


def test_the_shift_is_real_at_a_fixed_threshold() -> None:
    gate, g = _gate(), torch.Generator().manual_seed(1)
    confident = _experts(gate, _traffic("confident", g), 0.8)
    flat = _experts(gate, _traffic("flat", g), 0.8)
    assert flat > 2.0 * confident, (confident, flat)


def test_holds_the_target_through_a_traffic_shift() -> None:
    target = 2.0
    controller = ThresholdController(ThresholdControl(target_experts=target),
                                     initial_threshold=0.6)
    trace = _run(controller, ["confident"] * 60 + ["flat"] * 60)
    settle = 25  # batches allowed to settle after start and after the shift
    for lo, hi in ((settle, 60), (60 + settle, 120)):
        window = [m for _, m in trace[lo:hi]]
        mean = sum(window) / len(window)
        assert abs(mean - target) <= 0.1, (lo, mean)
        assert max(abs(m - target) for m in window) <= 0.35, (lo, window)
    # The shift moved the threshold down: flat traffic needs a lower one for the same experts.
    before, after = trace[59][0], trace[-1][0]
    assert after < before - 0.2, (before, after)
    # Without control the flat traffic would have taken far more experts at the old threshold.
    assert trace[60][1] > target + 1.5


def test_anti_windup_recovers_fast_from_an_unreachable_target() -> None:
    """Target 5 experts on confident traffic is out of reach below max_threshold 0.9: the
    output pins at the bound and the integral must not wind up, so when the traffic turns flat
    (where 5 is reachable at a lower threshold) the threshold leaves the bound at once."""
    control = ThresholdControl(target_experts=5.0, max_threshold=0.9)
    controller = ThresholdController(control, initial_threshold=0.6)
    trace = _run(controller, ["confident"] * 80)
    assert controller.saturated and controller.threshold == 0.9
    windup_free_integral = controller.integral
    trace = _run(controller, ["flat"] * 40)
    assert trace[3][0] < 0.9, "still pinned at the bound: the integral wound up"
    window = [m for _, m in trace[20:]]
    assert abs(sum(window) / len(window) - 5.0) <= 0.2
    # While pinned the integral stopped at about what reaching the bound needs, instead of
    # adding the ~2.4-expert error on each of the 80 batches (~190).
    assert windup_free_integral <= (0.9 - 0.6) / control.ki + 5.0


def test_output_stays_within_bounds() -> None:
    control = ThresholdControl(target_experts=1.0, min_threshold=0.2, max_threshold=0.7,
                               kp=0.5, ki=0.5)
    controller = ThresholdController(control, initial_threshold=0.5)
    for measured in (8.0, 8.0, 1.0, 0.0, 0.0, 0.0, 3.0):
        assert 0.2 <= controller.update(measured) <= 0.7


def test_params_carries_the_controlled_threshold() -> None:
    controller = ThresholdController(ThresholdControl(target_experts=2.0),
                                     initial_threshold=0.6)
    controller.update(3.0)  # too many experts: threshold goes down
    params = controller.params(GateParams(confidence_threshold=0.6, max_experts_per_token=4))
    assert params.confidence_threshold == controller.threshold < 0.6
    assert params.max_experts_per_token == 4


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"target_experts": 0.5}, "target_experts"),
    ({"target_experts": float("nan")}, "target_experts"),
    ({"target_experts": 2.0, "kp": -1.0}, "kp"),
    ({"target_experts": 2.0, "kp": 0.0, "ki": 0.0}, "kp and ki"),
    ({"target_experts": 2.0, "min_threshold": 0.0}, "min_threshold"),
    ({"target_experts": 2.0, "min_threshold": 0.8, "max_threshold": 0.5}, "min_threshold"),
])
def test_bad_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ThresholdControlError, match=field):
        ThresholdControl(**kwargs)


def test_bad_initial_threshold_and_measurement_are_rejected() -> None:
    control = ThresholdControl(target_experts=2.0, max_threshold=0.9)
    with pytest.raises(ThresholdControlError, match="initial_threshold"):
        ThresholdController(control, initial_threshold=0.95)
    controller = ThresholdController(control, initial_threshold=0.5)
    with pytest.raises(ThresholdControlError, match="measured_experts"):
        controller.update(float("inf"))
