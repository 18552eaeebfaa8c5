"""RoutingPolicy specs → indexed OPA data (sparsegate.domain.policy)."""

from __future__ import annotations

import pytest

from sparsegate.domain.policy import (
    Action,
    PolicySource,
    Port,
    build_opa_data,
    identity_key,
    rules_from_spec,
)

TD = "cluster.local"


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ({"spiffeID": "spiffe://other.org/ns/a/sa/b"}, ("spiffe://other.org/ns/a/sa/b", None)),
        ({"namespace": "web", "serviceAccount": "fe"}, ("spiffe://cluster.local/ns/web/sa/fe", None)),
        ({"serviceAccount": "fe"}, ("spiffe://cluster.local/ns/models/sa/fe", None)),  # policy's namespace
        ({"namespace": "web"}, ("ns:web", None)),
        ({"matchLabels": {"a": "b"}}, ("ns:models", None)),
        ({"namespace": "*"}, ("*", None)),
        ({"namespace": "*", "serviceAccount": "gw"}, ("*", "gw")),
    ],
)
def test_identity_key(selector: dict, expected: tuple) -> None:
    assert identity_key(selector=selector, policy_namespace="models", trust_domain=TD) == expected


def test_rules_expand_sources_times_targets() -> None:
    spec = {
        "action": "Deny",
        "priority": 7,
        "sources": [{"namespace": "batch"}, {"namespace": "web", "serviceAccount": "fe", "matchLabels": {"x": "1"}}],
        "targets": [{"sparseModel": "mixtral", "expertGroups": ["b", "a", "a"]}, {"sparseModel": "*"}],
        "ports": [{"port": 9090, "protocol": "UDP"}, {"port": 8080}],
    }
    rules = rules_from_spec(namespace="models", name="p", spec=spec, trust_domain=TD)
    assert [r.id for r in rules] == ["models/p#s0t0", "models/p#s0t1", "models/p#s1t0", "models/p#s1t1"]
    first = rules[0]
    assert first.action is Action.DENY and first.priority == 7 and first.policy == "models/p"
    assert first.target_key == "models/mixtral" and first.identity_key == "ns:batch"
    assert first.ports == (Port(8080, "tcp"), Port(9090, "udp"))
    assert first.expert_groups == ("a", "b")
    assert rules[1].target_key == "models/*"
    assert rules[2].match_labels == (("x", "1"),)
    assert rules[2].to_opa()["matchLabels"] == {"x": "1"}
    assert "serviceAccount" not in rules[2].to_opa()


def _allow(name: str, ns: str = "models", generation: int = 1, **spec: object) -> PolicySource:
    base = {"action": "Allow", "sources": [{"namespace": "web"}], "targets": [{"sparseModel": "m"}]}
    return PolicySource(namespace=ns, name=name, generation=generation, spec={**base, **spec})


def test_data_is_indexed_by_target_then_identity() -> None:
    data, rules = build_opa_data(
        sources=[_allow("b", priority=1), _allow("a", priority=5), _allow("c", sources=[{"namespace": "*"}])],
        trust_domain=TD, rego="package x",
    )
    assert len(rules) == 3
    bucket = data["targets"]["models/m"]
    assert sorted(bucket) == ["*", "ns:web"]
    assert [r["id"] for r in bucket["ns:web"]] == ["models/a#s0t0", "models/b#s0t0"]  # priority first
    assert data["policies"] == {f"models/{n}": {"generation": 1, "rules": 1} for n in "abc"}
    assert data["trustDomain"] == TD


def test_revision_is_content_addressed() -> None:
    one, _ = build_opa_data(sources=[_allow("a"), _allow("b")], trust_domain=TD, rego="package x")
    same, _ = build_opa_data(sources=[_allow("b"), _allow("a")], trust_domain=TD, rego="package x")
    assert one["revision"] == same["revision"] and one["revision"].startswith("sha256:")
    other_rego, _ = build_opa_data(sources=[_allow("a"), _allow("b")], trust_domain=TD, rego="package y")
    new_generation, _ = build_opa_data(sources=[_allow("a", generation=2), _allow("b")], trust_domain=TD, rego="package x")
    assert len({one["revision"], other_rego["revision"], new_generation["revision"]}) == 3


def test_empty_policy_set_is_still_a_document() -> None:
    data, rules = build_opa_data(sources=[], trust_domain=TD, rego="package x")
    assert rules == [] and data["targets"] == {} and data["policies"] == {}
