"""Pure builders of Ethernet frames for BPF_PROG_TEST_RUN tests and benchmarks.

Checksums are computed for the IPv4 header only; the XDP program never reads L4
checksums and test_run does not validate them.
"""
from __future__ import annotations

import ipaddress
import struct

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
ETH_P_ARP = 0x0806
ETH_P_8021Q = 0x8100

SRC_MAC = bytes.fromhex("020000000001")
DST_MAC = bytes.fromhex("020000000002")

TCP_SYN = 0x02
TCP_ACK = 0x10


def ethernet(*, ethertype: int, payload: bytes = b"") -> bytes:
    return DST_MAC + SRC_MAC + struct.pack("!H", ethertype) + payload


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


def tcp(*, sport: int, dport: int, flags: int = TCP_ACK, payload: bytes = b"", doff: int = 5) -> bytes:
    return struct.pack("!HHIIBBHHH", sport, dport, 1, 0, doff << 4, flags, 65535, 0, 0) + payload


def udp(*, sport: int, dport: int, payload: bytes = b"") -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


def tcp_frame(*, src: str, dst: str, sport: int, dport: int, flags: int = TCP_ACK, payload: bytes = b"") -> bytes:
    return ethernet(
        ethertype=ETH_P_IP,
        payload=ipv4(src=src, dst=dst, proto=6, payload=tcp(sport=sport, dport=dport, flags=flags, payload=payload)),
    )


def udp_frame(*, src: str, dst: str, sport: int, dport: int, payload: bytes = b"") -> bytes:
    return ethernet(
        ethertype=ETH_P_IP,
        payload=ipv4(src=src, dst=dst, proto=17, payload=udp(sport=sport, dport=dport, payload=payload)),
    )


def ipv6_frame(*, payload: bytes = b"\0" * 40) -> bytes:
    return ethernet(ethertype=ETH_P_IPV6, payload=payload)
