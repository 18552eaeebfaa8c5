"""Pure builders of Ethernet frames for BPF_PROG_TEST_RUN tests and benchmarks.

Checksums are computed for the IPv4 header only; the XDP program never reads L4
checksums and test_run does not validate them. ``tcp_frame``/``udp_frame`` build IPv6 when
given IPv6 addresses.
"""
from __future__ import annotations

import ipaddress
import struct

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
ETH_P_ARP = 0x0806
ETH_P_8021Q = 0x8100
ETH_P_8021AD = 0x88A8

SRC_MAC = bytes.fromhex("020000000001")
DST_MAC = bytes.fromhex("020000000002")

TCP_SYN = 0x02
TCP_ACK = 0x10


def ethernet(*, ethertype: int, payload: bytes = b"") -> bytes:
    return DST_MAC + SRC_MAC + struct.pack("!H", ethertype) + payload


def vlan_tagged(frame: bytes, *tags: tuple[int, int]) -> bytes:
    """`frame` (an Ethernet frame) with VLAN tags (TPID, VID), outermost first, after its MAC addresses."""
    return frame[:12] + b"".join(struct.pack("!HH", tpid, vid) for tpid, vid in tags) + frame[12:]


def ipv4_checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def ipv4(
    *,
    src: str,
    dst: str,
    proto: int,
    payload: bytes = b"",
    ihl: int = 5,
    version: int = 4,
    flags_frag: int = 0,
    options: bytes = b"",
) -> bytes:
    """An IPv4 header (+ options + payload). ihl/version/flags_frag can be set to malformed values."""
    total_len = ihl * 4 + len(payload) if ihl >= 5 else 20 + len(payload)
    header = struct.pack(
        "!BBHHHBBH4s4s",
        (version << 4) | (ihl & 0xF),
        0,
        total_len & 0xFFFF,
        0x1234,
        flags_frag,
        64,
        proto,
        0,
        ipaddress.IPv4Address(src).packed,
        ipaddress.IPv4Address(dst).packed,
    )
    header += options
    csum = ipv4_checksum(header + (b"\0" if len(header) % 2 else b""))
    header = header[:10] + struct.pack("!H", csum) + header[12:]
    return header + payload


def ipv6(*, src: str, dst: str, next_header: int, payload: bytes = b"", version: int = 6) -> bytes:
    """An IPv6 fixed header (40 bytes) + payload; ``version`` can be set to a malformed value."""
    return struct.pack("!IHBB16s16s", version << 28, len(payload), next_header, 64,
                       ipaddress.IPv6Address(src).packed, ipaddress.IPv6Address(dst).packed) + payload


def ext_header(*, next_header: int, length_units: int = 0) -> bytes:
    """A generic IPv6 extension header (hop-by-hop / destination options layout): 8 bytes per unit + 8."""
    return struct.pack("!BB", next_header, length_units) + b"\x01\x04\0\0\0\0" + b"\0" * (8 * length_units)


def _ip(*, src: str, dst: str, proto: int, payload: bytes) -> bytes:
    """Ethernet frame of the family of ``src``."""
    if ipaddress.ip_address(src).version == 6:
        return ethernet(ethertype=ETH_P_IPV6, payload=ipv6(src=src, dst=dst, next_header=proto, payload=payload))
    return ethernet(ethertype=ETH_P_IP, payload=ipv4(src=src, dst=dst, proto=proto, payload=payload))


def tcp(*, sport: int, dport: int, flags: int = TCP_ACK, payload: bytes = b"", doff: int = 5) -> bytes:
    return struct.pack("!HHIIBBHHH", sport, dport, 1, 0, doff << 4, flags, 65535, 0, 0) + payload


def udp(*, sport: int, dport: int, payload: bytes = b"") -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


def tcp_frame(*, src: str, dst: str, sport: int, dport: int, flags: int = TCP_ACK, payload: bytes = b"") -> bytes:
    return _ip(src=src, dst=dst, proto=6, payload=tcp(sport=sport, dport=dport, flags=flags, payload=payload))


def udp_frame(*, src: str, dst: str, sport: int, dport: int, payload: bytes = b"") -> bytes:
    return _ip(src=src, dst=dst, proto=17, payload=udp(sport=sport, dport=dport, payload=payload))


def ipv6_frame(*, payload: bytes = b"\0" * 40) -> bytes:
    return ethernet(ethertype=ETH_P_IPV6, payload=payload)
