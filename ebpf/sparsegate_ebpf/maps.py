"""ctypes mirrors of the structs in ``sparsegate_flow.h`` (the XDP program's map layouts).

The header is the source of truth; ``tests/unit/ebpf/test_ebpf_maps.py`` parses it and checks
these classes and the counter enum agree field by field, so the two cannot drift silently.
Addresses and ports are kept in network byte order, exactly as the program stores them; an
address of either family is 16 bytes (``Addr``), an IPv4 one as its IPv4-mapped IPv6 form
(``addr_of`` / ``ip_of`` convert).
"""
from __future__ import annotations

import ctypes as ct
import enum
import ipaddress
import socket
import sys
from pathlib import Path
from typing import Any

from sparsegate_contracts import flowpolicy

HEADER_PATH = Path(__file__).with_name("sparsegate_flow.h")
PROGRAM_PATH = Path(__file__).with_name("xdp_flow.bpf.c")

ACTION_ALLOW = 1
ACTION_DENY = 2
POLICY_MAX_ENTRIES = 16384  # the header's SG_POLICY_MAX_ENTRIES: rule ids per pool map (tests check)
POLICY_MAX_RECORDS = flowpolicy.MAP_MAX_ENTRIES  # the header's default SG_POLICY_MAX_RECORDS (tests check)

KEY_ENTRY = 0         # sg_policy_key.kind: all zero, the meta record (before identities: an IP-level entry)
KEY_POLICED_DST = 1   # only daddr set: a destination the policy judges (value: its identity)
KEY_ALLOWED_SRC = 2   # before identities: a source always allowed (now a KEY_SOURCE with IDENTITY_ALLOWED)
KEY_SOURCE = 3        # only saddr set: the source address's identity
KEY_RULE = 4          # (source identity, destination identity, dst port, protocol)

IDENTITY_ALLOWED = flowpolicy.IDENTITY_ALLOWED  # SG_IDENTITY_ALLOWED

CT_ALLOWED = 1
CT_OUTBOUND = 2

CLASS_RULE_ALLOW = 1
CLASS_RULE_DENY = 2
CLASS_ALLOWED_SOURCE = 3
CLASS_DNS = 4
CLASS_CT_REPLY = 5
CLASS_TCP_UNTRACKED = 6
CLASS_UNPOLICED = 7
CLASS_OVERLAY = 8

PROTO_NUMBERS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}
PROTO_NAMES = {v: k for k, v in PROTO_NUMBERS.items()}


class Counter(enum.IntEnum):
    """Index into the per-CPU packet-type counters (``enum sg_counter_index``)."""

    ETH_TRUNCATED = 0
    IPV4 = 1
    IPV6 = 2
    ARP = 3
    VLAN = 4
    OTHER_L2 = 5
    IPV4_TRUNCATED = 6
    IPV4_BAD_HEADER = 7
    IPV4_FRAGMENT = 8
    L4_TRUNCATED = 9
    IPV4_OTHER_PROTO = 10
    TCP = 11
    UDP = 12
    POLICY_ALLOW = 13
    POLICY_DENY = 14
    NO_POLICY = 15
    FLOW_TABLE_FULL = 16
    UNPOLICED = 17
    ALLOWED_SOURCE = 18
    DNS = 19
    OVERLAY = 20
    CT_REPLY = 21
    TCP_UNTRACKED = 22
    AUDIT_DENY = 23
    IPV6_TRUNCATED = 24
    IPV6_BAD_HEADER = 25
    IPV6_EXT_HEADER = 26
    IPV6_OTHER_PROTO = 27


COUNTER_MAX = 28

Addr = ct.c_uint32 * 4
"""An address field of the program's keys: 16 bytes, network order (IPv4 mapped, see addr_of)."""


class FlowKey(ct.Structure):
    _fields_ = [
        ("saddr", Addr),
        ("daddr", Addr),
        ("sport", ct.c_uint16),
        ("dport", ct.c_uint16),
        ("proto", ct.c_uint8),
        ("pad", ct.c_uint8 * 3),
    ]


class FlowKey4(ct.Structure):
    _fields_ = [
        ("saddr", ct.c_uint32),
        ("daddr", ct.c_uint32),
        ("sport", ct.c_uint16),
        ("dport", ct.c_uint16),
        ("proto", ct.c_uint8),
        ("pad", ct.c_uint8 * 3),
    ]


class FlowStats(ct.Structure):
    _fields_ = [
        ("packets", ct.c_uint64),
        ("bytes", ct.c_uint64),
        ("dropped", ct.c_uint64),
        ("first_seen_jiffies", ct.c_uint64),
        ("last_seen_jiffies", ct.c_uint64),
        ("ct_generation", ct.c_uint32),
        ("ct_rule", ct.c_uint16),
        ("ct_class", ct.c_uint8),
        ("ct_slot", ct.c_uint8),
    ]


class CtVal(ct.Structure):
    _fields_ = [
        ("generation", ct.c_uint32),
        ("rule_id", ct.c_uint16),
        ("kind", ct.c_uint8),
        ("pad", ct.c_uint8),
    ]


class Handshake(ct.Structure):
    _fields_ = [
        ("syn_ns", ct.c_uint64),
        ("last_rtt_ns", ct.c_uint64),
        ("rtt_sum_ns", ct.c_uint64),
        ("samples", ct.c_uint64),
    ]


class CounterVal(ct.Structure):
    _fields_ = [("packets", ct.c_uint64), ("bytes", ct.c_uint64)]


class ClockSample(ct.Structure):
    """What sg_clock writes (flowclock.py reads it)."""

    _fields_ = [("jiffies", ct.c_uint64), ("mono_ns", ct.c_uint64)]


class PolicyKey(ct.Structure):
    _fields_ = [
        ("saddr", Addr),
        ("daddr", Addr),
        ("dport", ct.c_uint16),
        ("proto", ct.c_uint8),
        ("kind", ct.c_uint8),
    ]


class PolicyKeyV4(ct.Structure):
    """``sg_policy_key`` of the IPv4-only programs before this one (one __u32 per address or
    identity): what inherit.py may read from a predecessor (``upgrade_key`` converts it)."""

    _fields_ = [
        ("saddr", ct.c_uint32),
        ("daddr", ct.c_uint32),
        ("dport", ct.c_uint16),
        ("proto", ct.c_uint8),
        ("kind", ct.c_uint8),
    ]


class PolicyVal(ct.Structure):
    _fields_ = [
        ("action", ct.c_uint32),
        ("rule_id", ct.c_uint32),
        ("generation", ct.c_uint32),
        ("slot", ct.c_uint16),
        ("identity", ct.c_uint16),
    ]


class VerdictKey(ct.Structure):
    _fields_ = [
        ("generation", ct.c_uint32),
        ("rule_id", ct.c_uint32),
        ("action", ct.c_uint32),
        ("pad", ct.c_uint32),
    ]


# Header struct name -> mirror, for the drift test and load-time size checks.
STRUCTS: dict[str, type[ct.Structure]] = {
    "sg_flow_key": FlowKey,
    "sg_flow4_key": FlowKey4,
    "sg_flow_stats": FlowStats,
    "sg_ct_val": CtVal,
    "sg_handshake": Handshake,
    "sg_counter": CounterVal,
    "sg_clock_sample": ClockSample,
    "sg_policy_key": PolicyKey,
    "sg_policy_val": PolicyVal,
    "sg_verdict_key": VerdictKey,
}


_V4_MAPPED = bytes(10) + b"\xff\xff"


def addr_of(ip: str) -> Any:
    """An IPv4 or IPv6 address as the program keys it (``Addr``): IPv6 as is, IPv4 as
    ::ffff:a.b.c.d."""
    try:  # fast path (a document of 100k addresses spent most of its compile in ipaddress)
        return Addr.from_buffer_copy(_V4_MAPPED + socket.inet_pton(socket.AF_INET, ip))
    except (OSError, ValueError):  # ValueError: e.g. an embedded NUL
        pass
    parsed = ipaddress.ip_address(ip)
    packed = _V4_MAPPED + parsed.packed if parsed.version == 4 else parsed.packed
    return Addr.from_buffer_copy(packed)


def ip_of(addr: Any) -> str:
    """The address text of a key's ``Addr`` (an IPv4-mapped one as the IPv4 address)."""
    ip = ipaddress.IPv6Address(bytes(addr))
    return str(ip.ipv4_mapped or ip)


def addr_bytes(ip: str) -> bytes:
    """``bytes(addr_of(ip))``: a hashable form, for comparing keys read from the maps."""
    return bytes(addr_of(ip))


def flow_addr_bytes(value: Any) -> bytes:
    """An address field of either flow table's key (`flows`: a __u32, `flows6`: an ``Addr``) as
    ``addr_bytes`` gives it."""
    if isinstance(value, int):
        return _V4_MAPPED + value.to_bytes(4, sys.byteorder)
    return bytes(value)


def flow_ip(value: Any) -> str:
    """The address text of a flow key's address field (either table). `flows6` holds IPv6 packets
    only: an IPv4-mapped address there (which the kernel's IPv6 input drops) reads ::ffff:a.b.c.d,
    never as the IPv4 flow of `flows` with the same addresses (one series for two flows)."""
    if isinstance(value, int):
        return be32_to_ip(value)
    ip = ipaddress.IPv6Address(bytes(value))
    return f"::ffff:{ip.ipv4_mapped}" if ip.ipv4_mapped else str(ip)


def identity_addr(identity: int) -> Any:
    """A rule key's identity field (``Addr`` whose first word is the identity, host order)."""
    return Addr(identity)


def upgrade_key(old: PolicyKeyV4) -> PolicyKey:
    """A record key of an IPv4-only program, as this program keys it: addresses mapped, identities
    (SG_KEY_RULE) in the first word; the meta record's all-zero key stays all zero."""
    def widen(value: int, *, address: bool) -> Any:
        if address and value:
            return Addr.from_buffer_copy(_V4_MAPPED + value.to_bytes(4, sys.byteorder))
        return Addr(value)

    address = old.kind != KEY_RULE
    return PolicyKey(saddr=widen(old.saddr, address=address), daddr=widen(old.daddr, address=address),
                     dport=old.dport, proto=old.proto, kind=old.kind)


def ip_to_be32(ip: str) -> int:
    """Dotted quad -> the u32 the kernel reads from the header (network order, native int)."""
    return int.from_bytes(ipaddress.IPv4Address(ip).packed, sys.byteorder)


def be32_to_ip(value: int) -> str:
    return str(ipaddress.IPv4Address(value.to_bytes(4, sys.byteorder)))


def port_to_be16(port: int) -> int:
    return socket.htons(port)


def be16_to_port(value: int) -> int:
    return socket.ntohs(value)
