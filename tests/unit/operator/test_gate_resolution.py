"""Which gate a model starts with: status.stable, then spec.params, defaults, or none."""

from __future__ import annotations

from sparsegate.domain import gate
from sparsegate_workload import gateparams

PARAMS = {**gateparams.DEFAULT_PARAMS, "toolGateThreshold": 0.7}


def gc(*, params=PARAMS, stable=None):
    body = {"metadata": {"name": "g", "namespace": "ns"}, "spec": {"params": params}}
    if stable is not None:
        body["status"] = {"stable": stable}
    return body


def test_stable_wins_over_spec():
    stable = gate.stable_from_params(gateparams.DEFAULT_PARAMS)
    r = gate.resolve(gc(stable=stable), referenced=True, num_experts=8)
    assert r.source == "status.stable" and r.document.version == stable["version"]


def test_spec_params_until_status_exists():
    r = gate.resolve(gc(), referenced=True, num_experts=8)
    assert r.source == "spec.params" and r.error is None
    assert r.document.version == gateparams.version_of(PARAMS)


def test_unreferenced_uses_builtin_defaults():
    r = gate.resolve(None, referenced=False, num_experts=8)
    assert r.document.version == gateparams.DEFAULT_DOCUMENT.version and r.source == "default"


def test_missing_gateconfig_is_an_error_not_a_crash():
    r = gate.resolve(None, referenced=True, num_experts=8)
    assert r.document is None and r.source == "missing" and "not found" in r.error


def test_gate_wider_than_the_model_is_invalid():
    r = gate.resolve(gc(params={**PARAMS, "maxExpertsPerToken": 6}), referenced=True, num_experts=4)
    assert r.document is None and "maxExpertsPerToken" in r.error


def test_an_unset_max_fits_a_model_with_fewer_than_4_experts():
    """A GateConfig that leaves maxExpertsPerToken unset (the CRD has no default for it) resolves
    for a 2-expert model as max 2, and for an 8-expert one as max 4; one document for both."""
    params = {k: v for k, v in PARAMS.items() if k != "maxExpertsPerToken"}
    stable = gate.stable_from_params(params)
    small = gate.resolve(gc(stable=stable), referenced=True, num_experts=2)
    large = gate.resolve(gc(stable=stable), referenced=True, num_experts=8)
    assert small.error is None and small.document.params.max_experts_per_token == 2
    assert large.error is None and large.document.params.max_experts_per_token == 4
    assert small.document.version == large.document.version
    # Written out, 4 is still wider than a 2-expert model.
    explicit = gate.resolve(gc(params={**PARAMS, "maxExpertsPerToken": 4}), referenced=True, num_experts=2)
    assert explicit.document is None and "maxExpertsPerToken must be in [1, 2]" in explicit.error


def test_tampered_stable_fails_its_checksum():
    stable = gate.stable_from_params(gateparams.DEFAULT_PARAMS)
    stable["params"] = {**stable["params"], "entropyBeta": 0.5}
    r = gate.resolve(gc(stable=stable), referenced=True, num_experts=8)
    assert r.document is None and "checksum" in r.error


def test_a_tampered_stable_names_the_gateconfig_and_the_fix():
    """The SparseModel's Degraded message (GateConfigInvalid) for a status.stable edited out of its
    hash says whose status.stable it is and what to do, not only the two hashes."""
    stable = gate.stable_from_params(PARAMS)
    stable["params"] = {**stable["params"], "entropyBeta": 0.5}
    r = gate.resolve(gc(stable=stable), referenced=True, num_experts=8)
    assert r.document is None and r.error.startswith(f"GateConfig g status.stable {stable['version']}: checksum mismatch")
    assert "remove status.stable" in r.error and "status.history" in r.error
    bad_version = {**gate.stable_from_params(PARAMS), "version": "g-000000000000"}
    r = gate.resolve(gc(stable=bad_version), referenced=True, num_experts=8)
    assert "not the content address" in r.error and "remove status.stable" in r.error
    too_wide = gate.stable_from_params({**PARAMS, "maxExpertsPerToken": 8})  # valid, for another model
    r = gate.resolve(gc(stable=too_wide), referenced=True, num_experts=2)
    assert r.error is not None and "remove status.stable" not in r.error


def test_stable_block_shape():
    stable = gate.stable_from_params(PARAMS)
    assert set(stable) == {"version", "checksum", "params"}
    assert stable["checksum"] == gateparams.checksum_of(PARAMS)


def test_builtin_defaults_fit_a_small_model_instead_of_degrading_it():
    # A 2-expert model with no GateConfig: the default's max 4 could never be served.
    r = gate.resolve(None, referenced=False, num_experts=2)
    assert r.error is None and r.source == "default"
    assert r.document.params.max_experts_per_token == 2 and r.document.params.min_experts_per_token == 1
    assert r.document.version != gateparams.DEFAULT_DOCUMENT.version  # content-addressed: its own version
    one = gate.resolve(None, referenced=False, num_experts=1).document.params
    assert (one.min_experts_per_token, one.max_experts_per_token) == (1, 1)
    assert gate.resolve(None, referenced=False, num_experts=8).document == gateparams.DEFAULT_DOCUMENT
