"""tests/bench/bench_opa.py: its side-by-side of the chart's Go collector settings against Go's
defaults compares two OPAs holding the same policies and data."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_opa  # noqa: E402


class FakeOpa:
    """What each OPA holds (path → body) whenever its latency is measured."""

    def __init__(self, binary: str, *, go_env: dict[str, str] | None = None) -> None:
        self.go_env = go_env
        self.held: dict[str, str] = {}
        self.measured: list[dict[str, str]] = []

    def put(self, path: str, body: str, content_type: str) -> None:
        self.held[path] = body

    def delete(self, path: str) -> None:
        del self.held[path]

    def latencies(self, path: str, probes: list[dict], count: int, *, metrics: bool
                  ) -> tuple[list[float], list[bool]]:
        self.measured.append(dict(self.held))
        return [100.0] * count, [True] * count

    def stop(self) -> None:
        pass


def test_go_defaults_side_by_side_holds_the_same_state_on_both(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[FakeOpa] = []

    def make(binary: str, *, go_env: dict[str, str] | None = None) -> FakeOpa:
        started.append(FakeOpa(binary, go_env=go_env))
        return started[-1]

    monkeypatch.setattr(bench_opa, "Opa", make)
    sources, _, probes = bench_opa.scenario(20, random.Random(7))
    data, _ = bench_opa.build_opa_data(sources=sources, trust_domain=bench_opa.TD, rego=bench_opa.REGO)
    ours = FakeOpa("opa", go_env={"GOGC": "400"})
    # What main() leaves in the chart-settings OPA after its table: both policies and both data.
    ours.put("/v1/policies/sparsegate-routing", bench_opa.REGO, "text/plain")
    ours.put("/v1/data/sparsegate/policies", json.dumps(data), "application/json")
    ours.put("/v1/policies/naive", bench_opa.NAIVE_REGO, "text/plain")
    ours.put("/v1/data/naive_rules", json.dumps(bench_opa.naive_data(sources)), "application/json")

    mine, theirs = bench_opa.compare_go_defaults("opa", ours, data, probes, 40)

    (plain,) = started
    assert plain.go_env == {}
    assert len(mine) == len(theirs) == 40
    assert ours.measured and plain.measured
    states = [*ours.measured, *plain.measured]
    assert all(s == plain.measured[0] for s in states), (
        sorted(ours.measured[0]), sorted(plain.measured[0]))
    assert "/v1/data/sparsegate/policies" in plain.measured[0]
