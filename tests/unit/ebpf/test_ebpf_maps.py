"""maps.py mirrors sparsegate_flow.h: checked by parsing the header (pure, no compiler)."""
from __future__ import annotations

import ctypes as ct
import re

from sparsegate_ebpf import maps

C_TYPES = {"__u8": ct.c_uint8, "__u16": ct.c_uint16, "__u32": ct.c_uint32, "__u64": ct.c_uint64}


def header_structs() -> dict[str, list[tuple[str, object, int]]]:
    text = maps.HEADER_PATH.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = {}
    for name, body in re.findall(r"struct (\w+) \{(.*?)\};", text, flags=re.S):
        fields = []
        for ctype, fname, count in re.findall(r"(__u\d+)\s+(\w+)(?:\[(\d+)\])?;", body):
            fields.append((fname, C_TYPES[ctype], int(count or 1)))
        out[name] = fields
    return out


def test_every_header_struct_has_an_identical_ctypes_mirror() -> None:
    structs = header_structs()
    assert set(structs) == set(maps.STRUCTS)
    for name, fields in structs.items():
        mirror = maps.STRUCTS[name]
        got = []
        for fname, ftype in mirror._fields_:
            if issubclass(ftype, ct.Array):
                got.append((fname, ftype._type_, ftype._length_))
            else:
                got.append((fname, ftype, 1))
        assert got == fields, name


def test_counter_enum_matches_header() -> None:
    text = maps.HEADER_PATH.read_text()
    pairs = dict(re.findall(r"SG_CNT_(\w+) = (\d+)", text))
    assert int(pairs.pop("MAX")) == maps.COUNTER_MAX == len(maps.Counter)
    assert {k: int(v) for k, v in pairs.items()} == {c.name: c.value for c in maps.Counter}


def test_constants_match_header() -> None:
    text = maps.HEADER_PATH.read_text()
    assert f"#define SG_ACTION_ALLOW {maps.ACTION_ALLOW}" in text
    assert f"#define SG_ACTION_DENY {maps.ACTION_DENY}" in text
    assert f"#define SG_POLICY_MAX_ENTRIES {maps.POLICY_MAX_ENTRIES}" in text
    assert f"#define SG_POLICY_MAX_RECORDS {maps.POLICY_MAX_RECORDS}" in text


def test_address_and_port_round_trip() -> None:
    assert maps.be32_to_ip(maps.ip_to_be32("10.200.3.4")) == "10.200.3.4"
    assert maps.be16_to_port(maps.port_to_be16(8080)) == 8080


def test_addresses_of_both_families_fit_one_16_byte_field() -> None:
    v4 = maps.addr_of("10.200.3.4")
    assert bytes(v4) == bytes(10) + b"\xff\xff" + bytes([10, 200, 3, 4])  # IPv4-mapped, network order
    assert maps.ip_of(v4) == "10.200.3.4"
    v6 = maps.addr_of("fd00:0::1")
    assert bytes(v6) == bytes.fromhex("fd000000000000000000000000000001") and maps.ip_of(v6) == "fd00::1"
    assert list(maps.identity_addr(300)) == [300, 0, 0, 0]


def test_keys_of_ipv4_only_programs_are_widened() -> None:
    old = maps.PolicyKeyV4(daddr=maps.ip_to_be32("10.0.0.2"), kind=maps.KEY_POLICED_DST)
    new = maps.upgrade_key(old)
    assert (maps.ip_of(new.daddr), bytes(new.saddr), new.kind) == ("10.0.0.2", bytes(16), maps.KEY_POLICED_DST)
    rule = maps.upgrade_key(maps.PolicyKeyV4(saddr=256, daddr=257, dport=maps.port_to_be16(80), proto=6,
                                             kind=maps.KEY_RULE))
    assert (list(rule.saddr), list(rule.daddr), rule.dport, rule.proto) == (
        [256, 0, 0, 0], [257, 0, 0, 0], maps.port_to_be16(80), 6)
    assert bytes(maps.upgrade_key(maps.PolicyKeyV4())) == bytes(ct.sizeof(maps.PolicyKey))  # the meta key
