"""Sliding-window weighted decay: thresholds that follow the observed baseline.

The design article says "sliding-window weighted decay dynamically adjusts gate
thresholds". Here is the precise definition used by the rollout analysis.

Each calibrated threshold has ``initial``, ``decay`` and ``window`` (GateConfig
``spec.calibration``). During a rollout the controller records baseline samples
``(t, x)`` — fleet queries per second, and the error rate of the *stable* pods —
once per tick. The baseline estimate at time ``now`` is the weighted mean of the
samples inside the window::

    b(now) = Σ wᵢ·xᵢ / Σ wᵢ,   wᵢ = decay ** (now − tᵢ),   now − window < tᵢ ≤ now

``decay`` applies per second of age: with 0.98 over 30 s the oldest sample still
counts 55 %, with 0.95 over 60 s about 5 %. Samples older than the window are
dropped, so the estimate forgets an incident completely after one window.

The estimate then moves the threshold:

* **qpsThreshold** ``q* = min(initial, b_qps)``. ``initial`` (1000) is the traffic
  level at which a window is taken as fully representative; a quieter service
  relaxes the threshold down to its own normal traffic. Analysis is
  *inconclusive* (neither promotes nor rolls back; the step keeps observing) when
  the canary pods serve less than ``INCONCLUSIVE_FRACTION`` (10 %) of their
  expected share ``q*·canaryShare`` — "far below" — or fewer than ``minRequests``
  requests in the window.
* **errorRateCap** ``e* = min(1, initial + b_err)``: the canary may add at most
  ``initial`` (2 %) errors on top of what the stable version shows in the same
  window. The cap relaxes while the stable pods fail for reasons unrelated to
  the canary (a shared upstream outage) and tightens back to ``initial`` as those
  samples decay out of the window.

Before any sample exists both thresholds are their ``initial`` values.
Samples live in GateConfig status (bounded by the window) so a restarted
operator keeps its calibration.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INCONCLUSIVE_FRACTION",
    "DecayParams",
    "Calibration",
    "Thresholds",
    "parse_duration",
    "parse_calibration",
    "windowed_estimate",
    "add_sample",
    "thresholds",
]

# Canary traffic below this fraction of its expected share makes analysis inconclusive.
INCONCLUSIVE_FRACTION = 0.1

# Samples are stored as [t, x] pairs in status; at most this many per series
# (a 1 s tick over a 60 s window needs 60), so status stays small.
MAX_SAMPLES = 120

# The CRDs' duration grammar (pattern ``^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$``, a Go duration without
# its sign and sub-millisecond units): one or more number+unit terms, e.g. ``1m30s``.
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
_DURATION = re.compile(DURATION_PATTERN)
_TERM = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, *, field: str = "duration") -> float:
    """A CRD duration (``30s``, ``1m30s``, ``500ms``) or a bare number of seconds → seconds (> 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a duration, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        if not _DURATION.match(text):
            raise ValueError(f"{field}: cannot parse duration {value!r} (e.g. 30s, 1m30s, 500ms)")
        seconds = sum(float(n) * _UNIT_S[unit] for n, unit in _TERM.findall(text))
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"{field}: duration must be positive, got {value!r}")
    return seconds


@dataclass(frozen=True)
class DecayParams:
    initial: float
    decay: float  # weight multiplier per second of sample age, 0 < decay ≤ 1
    window_s: float


@dataclass(frozen=True)
class Calibration:
    qps: DecayParams
    error_rate: DecayParams


DEFAULT_CALIBRATION = Calibration(
    qps=DecayParams(initial=1000.0, decay=0.98, window_s=30.0),
    error_rate=DecayParams(initial=0.02, decay=0.95, window_s=60.0),
)


def _parse_decay(raw: Mapping[str, Any] | None, *, default: DecayParams, field: str) -> DecayParams:
    raw = raw or {}
    initial = float(raw.get("initial", default.initial))
    decay = float(raw.get("decay", default.decay))
    window_s = parse_duration(raw.get("window", default.window_s), field=f"{field}.window")
    if initial < 0:
        raise ValueError(f"{field}.initial must be ≥ 0, got {initial}")
    if not 0 < decay <= 1:
        raise ValueError(f"{field}.decay must be in (0, 1], got {decay}")
    return DecayParams(initial=initial, decay=decay, window_s=window_s)


def parse_calibration(raw: Mapping[str, Any] | None) -> Calibration:
    """GateConfig ``spec.calibration`` → :class:`Calibration` (defaults filled in)."""
    raw = raw or {}
    return Calibration(
        qps=_parse_decay(raw.get("qpsThreshold"), default=DEFAULT_CALIBRATION.qps, field="qpsThreshold"),
        error_rate=_parse_decay(
            raw.get("errorRateCap"), default=DEFAULT_CALIBRATION.error_rate, field="errorRateCap"
        ),
    )


def _in_window(samples: Iterable[Sequence[float]], *, now: float, window_s: float) -> list[tuple[float, float]]:
    return [(float(t), float(x)) for t, x in samples if now - window_s < float(t) <= now]


def windowed_estimate(
    *, samples: Iterable[Sequence[float]], now: float, params: DecayParams
) -> float | None:
    """Decay-weighted mean of the samples inside the window; None without samples.

    Weights ``decay ** (now - t)`` share the factor ``decay ** (now - newest)``, which cancels in
    the mean, so ages are taken from the newest sample: its weight is 1 however old it is (a small
    decay over a long window would otherwise underflow every weight to 0)."""
    kept = _in_window(samples, now=now, window_s=params.window_s)
    if not kept:
        return None
    newest = max(t for t, _ in kept)
    weights = [params.decay ** (newest - t) for t, _ in kept]
    total = sum(weights)
    return sum(w * x for w, (_, x) in zip(weights, kept, strict=True)) / total


def add_sample(
    samples: Iterable[Sequence[float]], *, t: float, value: float, window_s: float
) -> list[list[float]]:
    """Append one sample and drop what fell out of the window (status-friendly lists).

    One sample per instant (a retried tick replaces) and per slot of ``window_s / MAX_SAMPLES``
    seconds (the newest in a slot replaces the one before), so a window longer than
    MAX_SAMPLES ticks keeps samples across the whole window, not only its newest MAX_SAMPLES
    ticks. Slots are far shorter than a tick at the default windows (0.25 s and 0.5 s)."""
    slot = window_s / MAX_SAMPLES
    kept = _in_window(samples, now=t, window_s=window_s)
    kept = [s for s in kept if s[0] < t and math.floor(s[0] / slot) < math.floor(t / slot)]
    kept.append((t, value))
    return [[round(a, 3), round(b, 6)] for a, b in kept[-MAX_SAMPLES:]]


@dataclass(frozen=True)
class Thresholds:
    qps_threshold: float
    error_rate_cap: float
    baseline_qps: float | None
    baseline_error_rate: float | None


def thresholds(
    *,
    calibration: Calibration,
    qps_samples: Iterable[Sequence[float]],
    error_samples: Iterable[Sequence[float]],
    now: float,
) -> Thresholds:
    """Effective thresholds now (see the module docstring for the rules)."""
    b_qps = windowed_estimate(samples=qps_samples, now=now, params=calibration.qps)
    b_err = windowed_estimate(samples=error_samples, now=now, params=calibration.error_rate)
    qps_threshold = calibration.qps.initial if b_qps is None else min(calibration.qps.initial, b_qps)
    error_cap = calibration.error_rate.initial if b_err is None else min(1.0, calibration.error_rate.initial + b_err)
    return Thresholds(
        qps_threshold=qps_threshold,
        error_rate_cap=error_cap,
        baseline_qps=b_qps,
        baseline_error_rate=b_err,
    )
