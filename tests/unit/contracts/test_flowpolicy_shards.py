"""Sharding a flow-policy document over ConfigMaps: the round trip is exact, a small document keeps the
single (pre-sharding) layout byte for byte, an inconsistent set of shards is refused, and the publish
order puts the head after its shards."""
from __future__ import annotations

import json

import pytest

from sparsegate_contracts import flowpolicy
from sparsegate_contracts import flowpolicy_shards as shards
from sparsegate_contracts.flowpolicy import FlowPolicyError, parse_document
from sparsegate_contracts.flowpolicy_shards import ShardsNotReady, Step


def document(*, classes: int = 12, per_class: int = 200, port: int = 8080) -> dict:
    """A model identity (256) and ``classes`` caller identities, one large (an identity spanning shards)."""
    ids = [{"identity": 256, "ips": [f"10.0.{j // 256}.{j % 256}" for j in range(50)] + ["fd00::1"]}]
    sizes = [per_class * (10 if c == 0 else 1) for c in range(classes)]
    ids += [{"identity": 257 + c, "ips": [f"10.{1 + c}.{j // 256}.{j % 256}" for j in range(n)]}
            for c, n in enumerate(sizes)]
    rules = [{"srcIdentity": 257 + c, "dstIdentity": 256, "dstPort": port, "protocol": "tcp", "action": "allow",
              "rule": f"models/p#{c}"} for c in range(classes)]
    return flowpolicy.build_document(rules=rules, identities=ids, policed_destinations=ids[0]["ips"],
                                     allowed_sources=["10.255.0.1"])


def test_small_document_is_the_single_layout_byte_for_byte() -> None:
    doc = document(classes=2, per_class=3)
    layout = shards.split(doc)
    assert layout.shards == ()
    assert layout.head == flowpolicy.document_text(doc)  # what the operator wrote before sharding
    steps = shards.publish_steps(layout, previous_shards=["sparsegate-flow-policy-0"])
    assert steps == [Step("put", "sparsegate-flow-policy", "policy.json", layout.head),
                     Step("clear", "sparsegate-flow-policy-0")]


@pytest.mark.parametrize("budget", [4096, 9000, 30_000])
def test_split_then_join_rebuilds_the_document(budget: int) -> None:
    doc = document()
    layout = shards.split(doc, max_bytes=budget, max_shards=1000)
    assert len(layout.shards) > 1
    assert all(len(text.encode()) <= budget for _, text in layout.shards)
    assert [name for name, _ in layout.shards] == [f"sparsegate-flow-policy-{k}" for k in range(len(layout.shards))]
    head = json.loads(layout.head)
    assert set(head) == {"version", "defaultAction", "shards"} and head["version"] == doc["version"]
    if len(layout.shards) <= shards.MAX_SHARDS:
        rebuilt = shards.join(head, dict(layout.shards))
        assert rebuilt == doc
        assert parse_document(rebuilt).version == doc["version"]


def test_an_identity_spanning_shards_is_merged_back() -> None:
    doc = document(classes=1, per_class=400)  # identity 257 has 4,000 IPs: ~60 KB
    layout = shards.split(doc, max_bytes=20_000)
    holders = [k for k, (_, text) in enumerate(layout.shards)
               if any(i["identity"] == 257 for i in json.loads(text)["identities"])]
    assert len(holders) > 1
    assert shards.join(json.loads(layout.head), dict(layout.shards))["identities"] == doc["identities"]


def test_missing_or_stale_shard_is_not_ready() -> None:
    old = shards.split(document(port=8080), max_bytes=20_000)
    new = shards.split(document(port=9090), max_bytes=20_000)
    head = json.loads(new.head)
    texts = dict(new.shards)
    missing = dict(texts)
    missing.pop(new.shards[-1][0])
    with pytest.raises(ShardsNotReady, match=r"shard sparsegate-flow-policy-\d+ of version sha256:\w+ is missing"):
        shards.join(head, missing)
    # Half-updated: the new head with one shard still at the old content (the writer is mid-way).
    half = {**texts, new.shards[0][0]: dict(old.shards)[new.shards[0][0]]}
    assert half != texts
    with pytest.raises(ShardsNotReady, match="sparsegate-flow-policy-0: digest sha256:"):
        shards.join(head, half)
    # The old head with new shards (the writer has put shards but not the head yet).
    with pytest.raises(ShardsNotReady):
        shards.join(json.loads(old.head), texts)


def test_shards_matching_their_digests_but_not_the_version_are_refused() -> None:
    layout = shards.split(document(), max_bytes=20_000)
    name, text = layout.shards[1]
    body = json.loads(text)
    body["rules"] = body.get("rules", []) + [{"srcIdentity": 256, "dstIdentity": 256, "dstPort": 1, "action": "allow"}]
    forged_text = json.dumps(body)
    head = json.loads(layout.head)
    head["shards"][1]["digest"] = shards.digest(forged_text)  # a head that agrees with the forged shard
    with pytest.raises(ShardsNotReady, match="rebuild a document of version"):
        shards.join(head, {**dict(layout.shards), name: forged_text})


def test_head_naming_other_configmaps_is_an_error() -> None:
    layout = shards.split(document(), max_bytes=20_000)
    head = json.loads(layout.head)
    head["shards"][0]["name"] = "kube-root-ca.crt"
    with pytest.raises(FlowPolicyError, match=r"shards\[0\]\.name: must be 'sparsegate-flow-policy-0'"):
        shards.join(head, dict(layout.shards))


def test_too_many_shards_is_an_error_with_numbers() -> None:
    with pytest.raises(FlowPolicyError, match=r"needs \d+ shards of 4096 bytes, at most 16 are published"):
        shards.split(document(per_class=400), max_bytes=4096)
    with pytest.raises(FlowPolicyError, match="below the minimum 4096"):
        shards.split(document(), max_bytes=4095)


def test_a_head_is_refused_by_the_pre_sharding_parser() -> None:
    layout = shards.split(document(), max_bytes=20_000)
    with pytest.raises(FlowPolicyError, match=r"unknown top-level fields: \['shards'\]"):
        parse_document(layout.head)  # an agent of before keeps its policy


def test_publish_steps_put_shards_then_head_then_clear_unnamed() -> None:
    big = shards.split(document(), max_bytes=20_000)
    n = len(big.shards)
    previous = [f"sparsegate-flow-policy-{k}" for k in range(n + 2)]
    steps = shards.publish_steps(big, previous_shards=previous)
    assert [(s.action, s.name) for s in steps] == (
        [("put", f"sparsegate-flow-policy-{k}") for k in range(n)] + [("put", "sparsegate-flow-policy")]
        + [("clear", f"sparsegate-flow-policy-{k}") for k in (n, n + 1)])
    assert {s.key for s in steps[:n]} == {"shard.json"} and steps[n].key == "policy.json"
    assert shards.shards_named(big.head) == [name for name, _ in big.shards]
    assert shards.shards_named(flowpolicy.document_text(document(classes=1, per_class=1))) == []
