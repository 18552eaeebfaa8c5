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


def _reference_ip_text(value: object) -> str | None:
    """ip_text as it was before its inet_pton fast path: ipaddress alone (None: refused)."""
    import ipaddress
    try:
        if not isinstance(value, str) or "%" in value:
            return None
        ip = ipaddress.ip_address(value)
    except ValueError:
        return None
    return None if ip.version == 6 and ip.ipv4_mapped is not None else str(ip)


def test_ip_text_fast_path_accepts_and_spells_exactly_what_ipaddress_does() -> None:
    """IPv4 text goes through inet_pton (~10x cheaper at 100k addresses); it must accept the same
    strings as ipaddress and write the same canonical text, and addr_of must pack them alike."""
    import ipaddress
    import random

    from sparsegate_ebpf import maps

    rng = random.Random(11)
    octet = [lambda: str(rng.randrange(256)), lambda: str(rng.randrange(1000)), lambda: "0" + str(rng.randrange(10)),
             lambda: " 1", lambda: "0x1", lambda: "", lambda: "-1", lambda: "١"]
    cases: list[object] = ["1.2.3.4\x00", "fe80::1%eth0", "::ffff:1.2.3.4", "FD00::A", "0.0.0.0", 5, None]
    def part() -> str:
        return str(rng.randrange(256)) if rng.random() < 0.9 else rng.choice(octet)()

    cases += [".".join(part() for _ in range(rng.choice([3, 4, 4, 4, 4, 4, 5]))) for _ in range(5000)]
    accepted = 0
    for value in cases:
        try:
            got: str | None = flowpolicy.ip_text(value, where="x")
        except FlowPolicyError:
            got = None
        assert got == _reference_ip_text(value), value
        if got is not None:
            accepted += 1
            ip = ipaddress.ip_address(got)
            packed = bytes(10) + b"\xff\xff" + ip.packed if ip.version == 4 else ip.packed
            assert bytes(maps.addr_of(got)) == packed
    assert 500 < accepted < len(cases) - 500  # both outcomes exercised
