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
