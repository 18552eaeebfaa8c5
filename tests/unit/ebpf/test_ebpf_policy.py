"""Flow policy documents -> policy map records (pure, no BPF)."""
from __future__ import annotations

import ctypes as ct
import json
import socket

import pytest

from sparsegate_contracts.flowpolicy import FIRST_IDENTITY
from sparsegate_ebpf.maps import (
    ACTION_ALLOW,
    ACTION_DENY,
    IDENTITY_ALLOWED,
    KEY_POLICED_DST,
    KEY_RULE,
    KEY_SOURCE,
    be16_to_port,
    ip_of,
)
from sparsegate_ebpf.policy import PolicyError, compile_policy, parse_policy


def entry(**over: object) -> dict:
    base = {"srcIP": "10.0.0.1", "dstIP": "10.0.0.2", "dstPort": 8080, "protocol": "tcp",
            "action": "allow", "rule": "ns/p#0"}
    base.update(over)
    return base


def test_parses_contract_document_from_json_text() -> None:
    doc = {"version": "sha256:abc", "defaultAction": "deny", "entries": [entry(), entry(dstPort=53, protocol="udp")]}
    policy = parse_policy(json.dumps(doc))
    assert policy.version == "sha256:abc"
    assert policy.default_action == "deny"
    assert [(e.dst_port, e.protocol) for e in policy.entries] == [(8080, "tcp"), (53, "udp")]
    assert policy.rule_names() == {0: "default:deny", 1: "ns/p#0", 2: "ns/p#0"}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("{not json", "not valid JSON"),
        ([], "JSON object"),
        ({"defaultAction": "maybe"}, "defaultAction"),
        ({"entries": [entry(srcIP="10.0.0.300")]}, "entries[0].srcIP"),
        ({"entries": [entry(dstIP="fe80::1%eth0")]}, "entries[0].dstIP"),
        ({"entries": [entry(dstPort=0)]}, "dstPort"),
        ({"entries": [entry(dstPort="80")]}, "dstPort"),
        ({"entries": [entry(dstPort=True)]}, "dstPort"),
        ({"entries": [entry(protocol="icmp")]}, "protocol"),
        ({"entries": [entry(action="log")]}, "entries[0].action"),
        ({"entries": {}}, "must be a list"),
        ({"entries": [], "extra": 1}, "unknown top-level"),
    ],
)
def test_rejects_invalid_documents(doc: object, message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_policy(doc if isinstance(doc, str) else json.dumps(doc))


def test_missing_version_is_content_addressed() -> None:
    a = parse_policy({"entries": [entry()]})
    b = parse_policy({"entries": [entry()]})
    c = parse_policy({"entries": [entry(dstPort=81)]})
    assert a.version == b.version != c.version
    assert a.version.startswith("sha256:")


def test_compiled_records_use_network_byte_order_and_meta_first() -> None:
    policy = parse_policy({"defaultAction": "allow", "entries": [entry(dstPort=8080)]})
    (meta_k, meta_v), (k, v), (dst_k, dst_v), (src_k, src_v) = compile_policy(policy, generation=7)
    assert bytes(meta_k) == bytes(ct.sizeof(meta_k))
    assert (meta_v.action, meta_v.rule_id, meta_v.generation) == (ACTION_ALLOW, 0, 7)
    # An entries-form document gets one identity per address, in address order.
    src_id, dst_id = FIRST_IDENTITY, FIRST_IDENTITY + 1
    assert (k.kind, list(k.saddr), list(k.daddr)) == (KEY_RULE, [src_id, 0, 0, 0], [dst_id, 0, 0, 0])
    assert be16_to_port(k.dport) == 8080 and bytes(k)[32:34] == (8080).to_bytes(2, "big")
    assert k.proto == socket.IPPROTO_TCP
    assert (v.action, v.rule_id, v.generation) == (ACTION_ALLOW, 1, 7)
    # The entry's destination is policed (no policedDestinations given); its record carries the
    # default action and the destination's identity.
    assert (bytes(dst_k.saddr), ip_of(dst_k.daddr), dst_k.dport, dst_k.proto, dst_k.kind) == (
        bytes(16), "10.0.0.2", 0, 0, KEY_POLICED_DST)
    # IPv4-mapped, the IPv4 address as the kernel reads the IP header.
    assert bytes(dst_k)[16:32] == bytes(10) + b"\xff\xff" + socket.inet_aton("10.0.0.2")
    assert (dst_v.action, dst_v.rule_id, dst_v.generation, dst_v.identity) == (ACTION_ALLOW, 0, 7, dst_id)
    # The source address's identity (the ipcache record).
    assert (ip_of(src_k.saddr), bytes(src_k.daddr), src_k.kind) == ("10.0.0.1", bytes(16), KEY_SOURCE)
    assert bytes(src_k)[:16] == bytes(10) + b"\xff\xff" + socket.inet_aton("10.0.0.1")
    assert (src_v.identity, src_v.generation) == (src_id, 7)


def test_deny_wins_over_allow_for_the_same_tuple_in_any_order() -> None:
    for order in (["allow", "deny"], ["deny", "allow"]):
        entries = [entry(action=a, rule=f"r-{a}") for a in order]
        policy = parse_policy({"entries": entries})
        records = compile_policy(policy, generation=1)
        assert len(records) == 4  # meta, the one tuple, its policed destination, its source
        val = records[1][1]
        assert val.action == ACTION_DENY
        assert policy.rule_names()[val.rule_id] == "r-deny"


def test_generation_must_fit_u32_and_be_positive() -> None:
    policy = parse_policy({"entries": []})
    for bad in (0, 2**32):
        with pytest.raises(PolicyError):
            compile_policy(policy, generation=bad)


def test_policed_destinations_and_allowed_sources_compile_to_their_own_records() -> None:
    policy = parse_policy({"entries": [entry()], "policedDestinations": ["10.0.0.2", "10.0.0.3"],
                           "allowedSources": ["10.0.0.9"]})
    assert policy.policed_destinations == ("10.0.0.2", "10.0.0.3") and policy.allowed_sources == ("10.0.0.9",)
    records = compile_policy(policy, generation=3, extra_sources=("10.0.0.8", "10.0.0.9"))
    by_kind: dict[int, dict[str, int]] = {}
    for k, v in records:
        if k.kind in (KEY_POLICED_DST, KEY_SOURCE):
            assert v.generation == 3
            by_kind.setdefault(k.kind, {})[ip_of(k.daddr if k.kind == KEY_POLICED_DST else k.saddr)] = v.identity
    # 10.0.0.3 is policed but no rule names it: no identity, so only the default applies to it.
    assert by_kind == {KEY_POLICED_DST: {"10.0.0.2": FIRST_IDENTITY + 1, "10.0.0.3": 0},
                       KEY_SOURCE: {"10.0.0.1": FIRST_IDENTITY, "10.0.0.8": IDENTITY_ALLOWED,
                                    "10.0.0.9": IDENTITY_ALLOWED}}


def test_an_empty_policed_list_polices_nothing_even_with_entries() -> None:
    policy = parse_policy({"entries": [entry()], "policedDestinations": []})
    assert policy.policed_destinations == ()
    assert [k.kind for k, _ in compile_policy(policy, generation=1)] == [0, KEY_RULE, KEY_SOURCE]


@pytest.mark.parametrize(("doc", "message"), [
    ({"policedDestinations": "10.0.0.1"}, "policedDestinations must be a list"),
    ({"policedDestinations": ["10.0.0.300"]}, r"policedDestinations\[0\]: not an IPv4"),
    ({"allowedSources": ["fd00::1::1"]}, r"allowedSources\[0\]: not an IPv4 or IPv6 address"),
])
def test_bad_policed_or_allowed_lists_are_rejected_naming_the_field(doc: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy(doc)
