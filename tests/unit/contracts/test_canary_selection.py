"""The request-level canary contract: the deterministic selection function and the PUT body."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from sparsegate_contracts.canary import (DEFAULT_STICKY_HEADER, canary_point, document_key, gate_set_document,
                                         parse_gate_set, reported_key, routes_to_canary, set_key,
                                         weight_of_percent)
from sparsegate_contracts.gate import DEFAULT_PARAMS, GateParamsError, make_document

STABLE = make_document(DEFAULT_PARAMS)
CANARY = make_document({**DEFAULT_PARAMS, "confidenceThreshold": 0.7})
KEYS = [f"session-{i}" for i in range(20_000)]


@pytest.mark.parametrize("weight", [0.05, 0.2, 0.5])
def test_measured_share_is_within_a_binomial_bound(weight):
    hits = sum(routes_to_canary(k, weight) for k in KEYS)
    sigma = math.sqrt(len(KEYS) * weight * (1 - weight))
    assert abs(hits - weight * len(KEYS)) <= 4 * sigma, (hits, weight)


def test_monotone_in_the_weight():
    weights = [0.0, 0.01, 0.05, 0.2, 0.5, 0.99, 1.0]
    for k in KEYS[:5000]:
        chosen = [routes_to_canary(k, w) for w in weights]
        # once on the canary at some weight, on it at every larger weight
        assert chosen == sorted(chosen), k
    assert not any(routes_to_canary(k, 0.0) for k in KEYS[:1000])
    assert all(routes_to_canary(k, 1.0) for k in KEYS[:1000])


def test_deterministic_across_processes_and_hash_seeds():
    code = ("from sparsegate_contracts.canary import canary_point;"
            "print(','.join(repr(canary_point(f'session-{i}')) for i in range(50)))")
    runs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        runs.add(out.stdout.strip())
    here = ",".join(repr(canary_point(f"session-{i}")) for i in range(50))
    assert runs == {here}
    assert all(0.0 <= canary_point(k) < 1.0 for k in KEYS[:1000])


def test_single_document_put_is_unchanged():
    parsed = parse_gate_set(STABLE.to_json())
    assert parsed.stable == STABLE and parsed.canary is None and parsed.key == STABLE.version
    assert gate_set_document(STABLE.to_json(), None, weight=0.5) == STABLE.to_json()


def test_two_version_document_round_trips():
    body = gate_set_document(STABLE.to_json(), CANARY.to_json(), weight=weight_of_percent(5))
    assert body["canaryWeight"] == 0.05 and body["stickyHeader"] == DEFAULT_STICKY_HEADER
    parsed = parse_gate_set(body)
    assert parsed.canary == CANARY and parsed.weight == 0.05
    assert parsed.key == set_key(STABLE.version, CANARY.version, 0.05) == f"{STABLE.version}+{CANARY.version}@0.05"
    assert parsed.to_json() == body
    report = {"gateVersion": STABLE.version, "canary": {"version": CANARY.version, "weight": 0.05}}
    assert reported_key(report, version_field="gateVersion") == parsed.key
    assert reported_key({"gateVersion": STABLE.version}, version_field="gateVersion") == STABLE.version
    assert reported_key({"gateVersion": STABLE.version, "canary": "x"}, version_field="gateVersion") is None


def test_the_set_key_names_a_sticky_header_other_than_the_default():
    body = gate_set_document(STABLE.to_json(), CANARY.to_json(), weight=0.05, sticky_header="x-user")
    parsed = parse_gate_set(body)
    assert parsed.key == document_key(body) == f"{STABLE.version}+{CANARY.version}@0.05;x-user"
    report = {"gateVersion": STABLE.version,
              "canary": {"version": CANARY.version, "weight": 0.05, "stickyHeader": "x-user"}}
    assert reported_key(report, version_field="gateVersion") == parsed.key
    default = {**report, "canary": {**report["canary"], "stickyHeader": DEFAULT_STICKY_HEADER}}
    assert reported_key(default, version_field="gateVersion") == set_key(STABLE.version, CANARY.version, 0.05)


@pytest.mark.parametrize(("change", "field"), [
    ({"canaryWeight": 1.5}, "canaryWeight"),
    ({"canaryWeight": True}, "canaryWeight"),
    ({"canaryWeight": "0.1"}, "canaryWeight"),
    ({"canaryWeight": 10**400}, r"canaryWeight must be a number in \[0, 1\], got 1000000000000000"),  # past float range
    ({"stickyHeader": "X Session"}, "stickyHeader"),
    ({"stickyHeader": ""}, "stickyHeader"),
    ({"canary": {"version": "g-000000000000", "checksum": "sha256:00", "params": DEFAULT_PARAMS}}, "canary"),
    ({"canary": STABLE.to_json()}, "canary"),
    ({"extra": 1}, "extra"),
])
def test_bad_sets_name_the_field(change, field):
    body = {**gate_set_document(STABLE.to_json(), CANARY.to_json(), weight=0.2), **change}
    with pytest.raises(GateParamsError, match=field):
        parse_gate_set(body)


def test_canary_fields_without_a_canary_are_refused():
    with pytest.raises(GateParamsError, match="canaryWeight given without canary"):
        parse_gate_set({**STABLE.to_json(), "canaryWeight": 0.1})
