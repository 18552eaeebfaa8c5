"""The agent's ConfigMap source rebuilds a sharded flow policy only from a consistent set: a head with
its shards half-updated is not forwarded (the live policy stays), and the single layout passes as is."""
from __future__ import annotations

import json

import pytest

from sparsegate_contracts import flowpolicy, flowpolicy_shards
from sparsegate_contracts.flowpolicy_shards import ShardsNotReady
from sparsegate_ebpf.policy import compile_policy, parse_policy
from sparsegate_ebpf.policysource import assemble

HEAD = flowpolicy.CONFIGMAP_NAME


def document(port: int, callers: int = 2000) -> dict:
    ids = [{"identity": 256, "ips": ["10.0.0.1", "fd00::1"]},
           {"identity": 257, "ips": [f"10.1.{j // 256}.{j % 256}" for j in range(callers)]}]
    rules = [{"srcIdentity": 257, "dstIdentity": 256, "dstPort": port, "protocol": "tcp", "action": "allow",
              "rule": "models/p#0"}]
    return flowpolicy.build_document(rules=rules, identities=ids, allowed_sources=["10.9.0.1"])


def published(doc: dict) -> tuple[str, dict[str, str]]:
    layout = flowpolicy_shards.split(doc, max_bytes=8192)
    return layout.head, dict(layout.shards)


def test_consistent_shards_give_the_document_the_agent_loads() -> None:
    doc = document(8080)
    head, shards = published(doc)
    assert len(shards) > 1
    text = assemble(head, shards.get, head_name=HEAD)
    policy = parse_policy(text)
    assert policy.version == doc["version"] and len(dict(policy.identities)[257]) == 2000
    compile_policy(policy, generation=1)  # loadable as a whole


def test_half_updated_set_is_kept_out() -> None:
    old_head, old_shards = published(document(8080))
    new_head, new_shards = published(document(9090))
    # The writer put the first new shard and stopped: the old head no longer matches its shards.
    midway = {**old_shards, f"{HEAD}-0": new_shards[f"{HEAD}-0"]}
    with pytest.raises(ShardsNotReady, match=f"{HEAD}-0: digest"):
        assemble(old_head, midway.get, head_name=HEAD)
    # A new head whose last shard is still missing.
    missing = {k: v for k, v in new_shards.items() if k != max(new_shards)}
    with pytest.raises(ShardsNotReady, match="is missing"):
        assemble(new_head, missing.get, head_name=HEAD)
    # Once all are written, the new document passes.
    assert json.loads(assemble(new_head, new_shards.get, head_name=HEAD))["rules"][0]["dstPort"] == 9090


def test_single_layout_passes_unchanged() -> None:
    text = flowpolicy.document_text(document(8080, callers=3))
    assert assemble(text, lambda name: pytest.fail(f"read shard {name}"), head_name=HEAD) == text
    assert assemble("not json", dict().get, head_name=HEAD) == "not json"  # the parser reports it
