"""Sliding-window weighted decay: the estimate, the window and the threshold rules."""

from __future__ import annotations

import pytest

from sparsegate.domain.calibration import (
    DEFAULT_CALIBRATION,
    DecayParams,
    add_sample,
    parse_calibration,
    parse_duration,
    thresholds,
    windowed_estimate,
)


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [("30s", 30.0), ("2m", 120.0), ("500ms", 0.5), (5, 5.0), ("1.5s", 1.5), ("1h", 3600.0),
     ("1m30s", 90.0), ("1h0m0.5s", 3600.5), ("2m500ms", 120.5)],
)
def test_parse_duration(raw: object, seconds: float) -> None:
    assert parse_duration(raw) == seconds


@pytest.mark.parametrize("raw", ["", "fast", "-3s", 0, True, "10d", "0s", "0m0s", "30", "1m 30s"])
def test_parse_duration_rejects(raw: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(raw)


def test_defaults_match_the_contract() -> None:
    cal = parse_calibration(None)
    assert cal == DEFAULT_CALIBRATION
    assert (cal.qps.initial, cal.qps.decay, cal.qps.window_s) == (1000.0, 0.98, 30.0)
    assert (cal.error_rate.initial, cal.error_rate.decay, cal.error_rate.window_s) == (0.02, 0.95, 60.0)


def test_parse_partial_override_and_invalid_decay() -> None:
    cal = parse_calibration({"qpsThreshold": {"initial": 50, "window": "10s"}})
    assert cal.qps == DecayParams(initial=50.0, decay=0.98, window_s=10.0)
    with pytest.raises(ValueError, match="decay"):
        parse_calibration({"errorRateCap": {"decay": 1.5}})


def test_estimate_weights_recent_samples_more() -> None:
    params = DecayParams(initial=0, decay=0.5, window_s=100)
    # Two samples: 10 at age 1 s (weight 0.5) and 0 at age 0 (weight 1) → 10·0.5/1.5.
    est = windowed_estimate(samples=[(99.0, 10.0), (100.0, 0.0)], now=100.0, params=params)
    assert est == pytest.approx(10 * 0.5 / 1.5)


def test_estimate_of_old_samples_with_a_small_decay_is_their_weighted_mean() -> None:
    """decay 0.1 over a 10-minute window: 400 s after the newest sample every decay ** age
    underflows to 0.0 (this once divided by zero and stopped every rollout tick); the weights are
    relative to the newest sample, so the estimate is the same as at the time of that sample."""
    params = DecayParams(initial=0.02, decay=0.1, window_s=600)
    samples = [(0.0, 0.5), (1.0, 0.1)]
    at_sample = windowed_estimate(samples=samples, now=1.0, params=params)
    assert at_sample == pytest.approx((0.5 * 0.1 + 0.1) / 1.1)
    assert windowed_estimate(samples=samples, now=401.0, params=params) == pytest.approx(at_sample)
    assert thresholds(calibration=parse_calibration({"errorRateCap": {"decay": 0.1, "window": "10m"}}),
                      qps_samples=[], error_samples=samples, now=401.0).error_rate_cap > 0


def test_estimate_forgets_samples_outside_the_window() -> None:
    params = DecayParams(initial=0, decay=1.0, window_s=30)
    samples = [(0.0, 1000.0), (80.0, 10.0), (90.0, 20.0)]
    assert windowed_estimate(samples=samples, now=100.0, params=params) == pytest.approx(15.0)
    assert windowed_estimate(samples=samples, now=200.0, params=params) is None


def test_add_sample_trims_to_window_and_replaces_same_instant() -> None:
    samples: list[list[float]] = []
    for t in range(0, 50, 5):
        samples = add_sample(samples, t=float(t), value=float(t), window_s=20)
    assert [s[0] for s in samples] == [30.0, 35.0, 40.0, 45.0]
    samples = add_sample(samples, t=45.0, value=99.0, window_s=20)
    assert samples[-1] == [45.0, 99.0] and len(samples) == 4


def test_thresholds_start_at_initial_values() -> None:
    thr = thresholds(calibration=DEFAULT_CALIBRATION, qps_samples=[], error_samples=[], now=0.0)
    assert (thr.qps_threshold, thr.error_rate_cap) == (1000.0, 0.02)
    assert thr.baseline_qps is None and thr.baseline_error_rate is None


def test_qps_threshold_relaxes_to_observed_traffic_never_above_initial() -> None:
    quiet = thresholds(calibration=DEFAULT_CALIBRATION, qps_samples=[(9.0, 40.0), (10.0, 40.0)], error_samples=[], now=10.0)
    assert quiet.qps_threshold == pytest.approx(40.0)
    busy = thresholds(calibration=DEFAULT_CALIBRATION, qps_samples=[(10.0, 5000.0)], error_samples=[], now=10.0)
    assert busy.qps_threshold == 1000.0


def test_error_cap_relaxes_with_stable_errors_and_tightens_as_they_decay() -> None:
    errs = [(0.0, 0.10)]  # the stable pods saw 10 % errors at t=0
    during = thresholds(calibration=DEFAULT_CALIBRATION, qps_samples=[], error_samples=errs, now=1.0)
    assert during.error_rate_cap == pytest.approx(0.12)
    # Healthy samples arrive; the old one decays (0.95 per second) then leaves the 60 s window.
    errs2 = errs + [(t, 0.0) for t in range(1, 31)]
    later = thresholds(calibration=DEFAULT_CALIBRATION, qps_samples=[], error_samples=errs2, now=30.0)
    assert 0.02 < later.error_rate_cap < 0.025
    gone = thresholds(calibration=DEFAULT_CALIBRATION, qps_samples=[], error_samples=errs2 + [(61.0, 0.0)], now=61.0)
    assert gone.error_rate_cap == pytest.approx(0.02)


def test_the_crds_duration_pattern_is_the_parsers() -> None:
    """One grammar: every duration field of the CRDs uses the pattern parse_duration accepts."""
    import pathlib

    from sparsegate.domain.calibration import DURATION_PATTERN

    crds = pathlib.Path(__file__).resolve().parents[3] / "charts" / "sparsegate" / "crds"
    patterns = [line.split("pattern:", 1)[1].strip().strip("'") for path in crds.glob("*.yaml")
                for line in path.read_text().splitlines() if "pattern:" in line and "(ms|s|m|h)" in line]
    # GateConfig: two calibration windows, analysisInterval, progressDeadline, a check's interval, a web timeout.
    assert len(patterns) == 6 and set(patterns) == {DURATION_PATTERN}


def test_a_window_longer_than_max_samples_ticks_keeps_samples_across_all_of_it() -> None:
    """spec.calibration's window is how long a sample counts. With a 15 min window and the
    operator's 5 s tick (180 ticks), the samples of the window's first 5 minutes (a stable error
    rate of 0.5) were dropped once 120 had been stored, so a sample 10 to 15 minutes old never
    counted and the baseline read 0 instead of about 0.15 (decay 0.999: weight ~0.5 there)."""
    from sparsegate.domain.calibration import MAX_SAMPLES, windowed_estimate

    params = DecayParams(initial=0.02, decay=0.999, window_s=900.0)
    samples: list[list[float]] = []
    for i in range(180):
        t = 5.0 * i
        samples = add_sample(samples, t=t, value=0.5 if t < 300 else 0.0, window_s=params.window_s)
    assert len(samples) <= MAX_SAMPLES
    assert samples[0][0] < 10.0, samples[0]  # the window's oldest samples are still there
    estimate = windowed_estimate(samples=samples, now=895.0, params=params)
    weights = [0.999 ** (895 - 5 * i) for i in range(180)]
    exact = sum(w for i, w in enumerate(weights) if 5 * i < 300) * 0.5 / sum(weights)
    assert estimate == pytest.approx(exact, rel=0.05)
