"""The flow-policy contract takes IPv6 addresses as well as IPv4 ones (dual-stack pods): canonical
text, one owner per address whatever its spelling, and an error naming the field for bad ones."""
from __future__ import annotations

import pytest

from sparsegate_contracts import flowpolicy
from sparsegate_contracts.flowpolicy import FlowPolicyError, parse_document


def identity_doc(**extra: object) -> dict:
    return {"defaultAction": "deny",
            "identities": [{"identity": 256, "ips": ["10.0.0.1", "FD00:0:0::0001"]},
                           {"identity": 257, "ips": ["fd00::2", "10.0.0.2"]}],
            "rules": [{"srcIdentity": 256, "dstIdentity": 257, "dstPort": 8080, "action": "allow", "rule": "a/b#0"}],
            **extra}


def test_identity_form_with_both_families_in_canonical_text() -> None:
    policy = parse_document(identity_doc(allowedSources=["fd00::9", "10.0.0.9"]))
    assert dict(policy.identities) == {256: ("10.0.0.1", "fd00::1"), 257: ("10.0.0.2", "fd00::2")}
    assert policy.policed_destinations == ("10.0.0.2", "fd00::2")  # the rule's destination identity, both families
    assert policy.allowed_sources == ("10.0.0.9", "fd00::9")


def test_entries_form_and_lists_take_ipv6() -> None:
    doc = {"entries": [flowpolicy.entry(src_ip="fd00:1::1", dst_ip="fd00:2::0:2", dst_port=53, protocol="udp",
                                        action="allow", rule="x")],
           "policedDestinations": ["fd00:2::2", "FD00:2::2"]}
    policy = parse_document(doc)
    assert (policy.entries[0].src_ip, policy.entries[0].dst_ip) == ("fd00:1::1", "fd00:2::2")
    assert policy.policed_destinations == ("fd00:2::2",)


def test_one_address_two_spellings_is_still_one_owner() -> None:
    doc = identity_doc()
    doc["identities"][1]["ips"].append("fd00:0::1")  # identity 256's fd00::1, spelt otherwise
    with pytest.raises(FlowPolicyError, match=r"identities\[1\]\.ips\[2\]: fd00::1 already has identity 256"):
        parse_document(doc)


@pytest.mark.parametrize("patch, message", [
    ({"identities": [{"identity": 256, "ips": ["fd00::1::2"]}]}, r"identities\[0\]\.ips\[0\]: not an IPv4 or IPv6"),
    ({"identities": [{"identity": 256, "ips": ["fe80::1%eth0"]}]}, r"identities\[0\]\.ips\[0\]: not an IPv4 or IPv6"),
    ({"identities": [{"identity": 256, "ips": [167772161]}]}, r"identities\[0\]\.ips\[0\]: not an IPv4 or IPv6"),
    ({"identities": [{"identity": 256, "ips": ["::ffff:10.0.0.1"]}]},
     r"identities\[0\]\.ips\[0\]: '::ffff:10.0.0.1' is an IPv4-mapped IPv6 address; write 10.0.0.1"),
    ({"policedDestinations": ["fd00::g"]}, r"policedDestinations\[0\]: not an IPv4 or IPv6 address: 'fd00::g'"),
    ({"allowedSources": ["10.0.0.1", "2001:db8::/64"]}, r"allowedSources\[1\]: not an IPv4 or IPv6"),
])
def test_bad_addresses_name_the_field(patch: dict, message: str) -> None:
    doc = {"defaultAction": "deny", "identities": [], "rules": [], **patch}
    with pytest.raises(FlowPolicyError, match=message):
        parse_document(doc)


def test_entries_bad_ipv6_names_the_entry_field() -> None:
    doc = {"entries": [{"srcIP": "fd00::1", "dstIP": "fd00:::2", "dstPort": 80, "action": "allow"}]}
    with pytest.raises(FlowPolicyError, match=r"entries\[0\]\.dstIP: not an IPv4 or IPv6 address"):
        parse_document(doc)


def test_map_records_count_each_address_of_either_family() -> None:
    doc = flowpolicy.build_document(rules=identity_doc()["rules"], identities=identity_doc()["identities"],
                                    allowed_sources=["fd00::9"])
    # One rule tuple, two policed destinations (the v4 and v6 address of identity 257), two source
    # addresses of identity 256 and one allowed source.
    assert flowpolicy.map_records(doc) == 1 + 2 + 2 + 1
