"""The CRD fuzz generator (tests/e2e/operator/crd_fuzz_cases.py) without a cluster: enough cases,
every kind and category, deterministic for a seed, and every CEL rule of the CRDs known to it.

The API server's verdict on each case is tests/e2e/operator/test_crd_fuzz.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from crd_fuzz_loader import crd_fuzz_cases

ROOT = Path(__file__).resolve().parents[3]
CRD_DIR = ROOT / "charts" / "sparsegate" / "crds"

fuzz = crd_fuzz_cases()
SCHEMAS = fuzz.load_schemas(CRD_DIR)
EXAMPLES = fuzz.load_examples(ROOT / "examples")


@pytest.fixture(scope="module")
def cases() -> list:
    return fuzz.invalid_cases(SCHEMAS, EXAMPLES)


def test_at_least_200_cases_over_every_kind_and_category(cases, capsys):
    by_kind, by_category = fuzz.counts(cases)
    with capsys.disabled():
        print(f"\n{len(cases)} invalid cases; per kind {by_kind}; per category {by_category}")
    assert len(cases) >= 200
    assert all(n >= 20 for n in by_kind.values()), by_kind
    assert all(n >= 1 for n in by_category.values()), by_category
    # Unique ids: a failing case can be named and re-run on its own.
    assert len({c.id for c in cases}) == len(cases)


def test_deterministic_for_a_seed(cases):
    again = fuzz.invalid_cases(SCHEMAS, EXAMPLES)
    assert [(c.id, c.obj) for c in again] == [(c.id, c.obj) for c in cases]
    other = fuzz.invalid_cases(SCHEMAS, EXAMPLES, seed=fuzz.DEFAULT_SEED + 1)
    # Another seed picks other wrong values (same fields, so the same number of cases per field).
    assert [c.id for c in other] != [c.id for c in cases]
    assert {fuzz.normalise(c.path) for c in other} == {fuzz.normalise(c.path) for c in cases}


def test_each_case_is_one_change_to_a_valid_base_at_its_path(cases):
    bases = fuzz.full_bases(EXAMPLES)
    for case in cases:
        base = bases[case.kind]
        # As JSON: in Python True == 1, on the wire they are different types.
        assert json.dumps(case.obj, sort_keys=True) != json.dumps(base, sort_keys=True), case.id
        assert case.obj.get("kind", base["kind"]) == base["kind"]
        assert case.path.startswith(("spec", "metadata.name", fuzz.UNKNOWN_KEY)), case.id
        assert case.strict == (case.category == "unknown_field"), case.id
    # The bases themselves were not mutated by the generator.
    assert fuzz.full_bases(EXAMPLES) == bases


def test_every_field_under_spec_is_mutated(cases):
    for kind in fuzz.KINDS:
        mutated = {fuzz.normalise(c.path) for c in cases if c.kind == kind}
        fields = set(fuzz.spec_paths(SCHEMAS[kind]))
        assert fields and fields <= mutated, fields - mutated


def test_a_cel_rule_without_fuzz_cases_is_an_error():
    schemas = copy.deepcopy(SCHEMAS)
    spec = schemas["TelemetryProbe"]["properties"]["spec"]
    spec.setdefault("x-kubernetes-validations", []).append({"rule": "size(self.interfaces) < 9", "message": "m"})
    with pytest.raises(KeyError, match="size\\(self.interfaces\\) < 9"):
        fuzz.invalid_cases(schemas, EXAMPLES)


def test_every_cel_rule_of_the_crds_has_cases():
    rules = {(kind, holder, rule) for kind in fuzz.KINDS for holder, rule in fuzz.cel_rules(SCHEMAS[kind])
             if not holder.startswith("status")}
    assert rules == set(fuzz.KNOWN_RULES)


def test_valid_edges_cover_the_operator_kinds_with_few_running_models():
    edges = fuzz.valid_edges(SCHEMAS, EXAMPLES)
    for kind in fuzz.KINDS:
        names = [e.obj["metadata"]["name"] for e in edges if e.kind == kind]
        assert len(names) >= 2 and len(set(names)) == len(names), kind
    models = [e.obj for e in edges if e.kind == "SparseModel"]
    # Each running model server costs a CPU-heavy container on the test machine.
    assert all(m["spec"].get("replicas", 1) <= 1 for m in models)
    assert max(len(e.obj["metadata"]["name"]) for e in edges if e.kind == "SparseModel") == 63
    assert max(len(e.obj["metadata"]["name"]) for e in edges if e.kind == "GateConfig") == 253
    refs = {m["spec"].get("gateConfigRef", {}).get("name") for m in models} - {None}
    gates = {e.obj["metadata"]["name"] for e in edges if e.kind == "GateConfig"}
    assert refs - gates == {"no-such-gate"}  # one dangling reference, on purpose


def test_operator_parsers_accept_the_valid_edges():
    """What the schema accepts at its bounds, the operator's pure parsers accept too (the e2e test
    shows the running operator's conditions for the same objects)."""
    from sparsegate.domain import gate, policy, render, rollout

    edges = fuzz.valid_edges(SCHEMAS, EXAMPLES)
    gates = {e.obj["metadata"]["name"]: e.obj for e in edges if e.kind == "GateConfig"}
    for g in gates.values():
        parsed = rollout.parse_spec(g["spec"])
        assert parsed.steps[-1] == 100 and parsed.analysis_interval_s > 0 and parsed.progress_deadline_s > 0
    for e in edges:
        if e.kind == "SparseModel":
            model = {**e.obj, "metadata": {**e.obj["metadata"], "namespace": "ns", "uid": "u"}}
            ref = e.obj["spec"].get("gateConfigRef", {}).get("name")
            resolution = gate.resolve(gates.get(ref), referenced=ref is not None,
                                      num_experts=e.obj["spec"]["model"]["experts"])
            if ref == "no-such-gate":
                assert resolution.document is None and resolution.source == "missing"
                continue
            assert resolution.document is not None, (e.note, resolution.error)
            deployment = next(o for o in render.render_applied(model, resolution.document) if o["kind"] == "Deployment")
            assert deployment["spec"]["replicas"] == e.obj["spec"]["replicas"]
        elif e.kind == "RoutingPolicy":
            rules = policy.rules_from_spec(namespace="ns", name=e.obj["metadata"]["name"], spec=e.obj["spec"])
            assert len(rules) == len(e.obj["spec"]["sources"]) * len(e.obj["spec"]["targets"]) <= 256
