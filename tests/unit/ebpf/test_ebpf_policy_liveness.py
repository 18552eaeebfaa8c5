"""The agent drops a deleted RoutingPolicy's allow entries on its own (policysource.LivePolicyFilter)."""
from __future__ import annotations

import json

from sparsegate_contracts import flowpolicy

from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policysource import LivePolicyFilter


def published() -> str:
    rows = [flowpolicy.entry(src_ip="10.0.0.1", dst_ip="10.0.0.9", dst_port=8080, protocol="tcp", action="allow",
                             rule="a/keep#0"),
            flowpolicy.entry(src_ip="10.0.0.2", dst_ip="10.0.0.9", dst_port=8080, protocol="tcp", action="allow",
                             rule="b/gone#0"),
            flowpolicy.entry(src_ip="10.0.0.3", dst_ip="10.0.0.9", dst_port=8080, protocol="tcp", action="deny",
                             rule="b/gone#1")]
    return flowpolicy.document_text(flowpolicy.build_document(entries=rows))


def rules(text: str) -> list[str]:
    return [e.rule for e in parse_policy(text).entries]


def test_until_policies_are_listed_documents_pass_unchanged() -> None:
    out: list[str] = []
    f = LivePolicyFilter(out.append)
    f.document(published())
    assert out == [published()]


def test_allow_entries_of_deleted_policies_go_and_deny_entries_stay() -> None:
    out: list[str] = []
    f = LivePolicyFilter(out.append)
    f.document(published())
    f.policies({"a/keep", "b/gone"})
    assert len(out) == 1  # nothing dropped: the same text is not re-emitted
    f.policies({"a/keep"})
    assert rules(out[-1]) == ["a/keep#0", "b/gone#1"]
    assert f.dropped_entries == 1
    assert parse_policy(out[-1]).version == flowpolicy.version_of(
        {k: v for k, v in json.loads(out[-1]).items() if k != "version"})
    # A new publication by the operator is filtered against the same live set.
    f.document(published())
    assert rules(out[-1]) == ["a/keep#0", "b/gone#1"]
    # The policy comes back (recreated): its entries are enforced again as published.
    f.policies({"a/keep", "b/gone"})
    assert rules(out[-1]) == ["a/keep#0", "b/gone#0", "b/gone#1"]


def test_no_live_policies_leaves_only_denies_and_the_default() -> None:
    narrowed = flowpolicy.without_policies(json.loads(published()), live=())
    assert narrowed is not None
    assert [e["action"] for e in narrowed["entries"]] == ["deny"]
    assert narrowed["defaultAction"] == "deny"


def test_garbage_is_forwarded_for_the_agent_parser_to_reject() -> None:
    out: list[str] = []
    f = LivePolicyFilter(out.append)
    f.policies(set())
    f.document("{not json")
    assert out == ["{not json"]
