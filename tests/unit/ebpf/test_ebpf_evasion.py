"""Frames crafted to reach a policed pod past its allow-list (BPF_PROG_TEST_RUN on synthetic frames).

Each was passed by an earlier program although the kernel delivers what it carries (checked on a
veth pair: priority-tagged frames, stacked VID-0 tags and tiny first fragments reach the socket):
a SYN on a 5-tuple whose earlier ACK was cached as `tcp_untracked` (or `dns`), a TCP first fragment
whose SYN flag sits in the next fragment (RFC 1858), a VLAN-tagged frame, UDP to a policed pod's
own overlay port.
"""
from __future__ import annotations

import socket

import pytest

from sparsegate_ebpf import packets as P
from sparsegate_ebpf.maps import ACTION_DENY, Counter
from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testing import counters, flows, verdicts
from sparsegate_ebpf.testrun import run_xdp

pytestmark = pytest.mark.bpf

CLIENT, MODEL, OTHER, NODE = "10.3.0.1", "10.3.0.2", "10.3.0.3", "10.3.0.254"
CLIENT6, MODEL6, OTHER6 = "fd00:3::1", "fd00:3::2", "fd00:3::3"
TCP, UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP
MF = 0x2000


def run(prog: LoadedProgram, frame: bytes) -> str:
    return run_xdp(prog_fd=prog.prog_fd, data=frame).verdict


def install(prog: LoadedProgram) -> None:
    """MODEL (both families) is policed; CLIENT may reach it on tcp/8080 and udp/8080 only."""
    doc = {"defaultAction": "deny",
           "identities": [{"identity": 256, "ips": [CLIENT, CLIENT6]}, {"identity": 257, "ips": [MODEL, MODEL6]}],
           "rules": [{"srcIdentity": 256, "dstIdentity": 257, "dstPort": 8080, "protocol": proto, "action": "allow",
                      "rule": f"m/p#{proto}"} for proto in ("tcp", "udp")]}
    PolicySwapper(bpf=prog.bpf).apply(parse_policy(doc), extra_sources=(NODE,))


def tcp(src: str, dst: str, sport: int, dport: int, flags: int) -> bytes:
    return P.tcp_frame(src=src, dst=dst, sport=sport, dport=dport, flags=flags)


@pytest.mark.parametrize("sport", [40000, 53], ids=["untracked", "from-dns-port"])
def test_a_syn_is_judged_even_when_its_5_tuple_was_cached_as_passing(enforce_prog: LoadedProgram, sport: int) -> None:
    """An ACK first (tcp_untracked, or dns from port 53: both pass and are cached per flow), then a SYN
    on the same 5-tuple: the SYN opens a connection and must meet the rules, not the cached outcome."""
    install(enforce_prog)
    assert run(enforce_prog, tcp(OTHER, MODEL, sport, 9999, P.TCP_ACK)) == "pass"
    assert run(enforce_prog, tcp(OTHER, MODEL, sport, 9999, P.TCP_SYN)) == "drop"
    assert run(enforce_prog, tcp(OTHER6, MODEL6, sport, 9999, P.TCP_ACK)) == "pass"
    assert run(enforce_prog, tcp(OTHER6, MODEL6, sport, 9999, P.TCP_SYN)) == "drop"
    assert verdicts(enforce_prog) == {(1, 0, ACTION_DENY): 2}
    # An allowed connection's SYN (and its retransmission) still passes once its flow is cached.
    for flags in (P.TCP_SYN, P.TCP_ACK, P.TCP_SYN):
        assert run(enforce_prog, tcp(CLIENT, MODEL, 40001, 8080, flags)) == "pass"


def first_fragment(src: str, dport: int, tcp_bytes: int, *, padding: bytes = b"") -> bytes:
    """A TCP SYN's first fragment (MF set) whose IP length covers only `tcp_bytes` of its header;
    `padding`: more frame bytes past that length (Ethernet padding, which the kernel trims)."""
    seg = P.tcp(sport=40000, dport=dport, flags=P.TCP_SYN)
    return P.ethernet(ethertype=P.ETH_P_IP, payload=P.ipv4(src=src, dst=MODEL, proto=TCP, payload=seg[:tcp_bytes],
                                                          flags_frag=MF) + padding)


def test_a_tcp_first_fragment_without_its_flags_is_judged_as_a_connection_attempt(enforce_prog: LoadedProgram) -> None:
    """RFC 1858 tiny fragment: the kernel reassembles 8 TCP bytes (ports, sequence) with a next
    fragment carrying the SYN flag; judged by its ports as a SYN, never as TCP without SYN."""
    install(enforce_prog)
    assert run(enforce_prog, first_fragment(OTHER, 9999, 8)) == "drop"
    # The IP length says 8 TCP bytes; the frame goes on with bytes that read as an ACK's header.
    ack_tail = P.tcp(sport=40000, dport=9999, flags=P.TCP_ACK)[8:]
    assert run(enforce_prog, first_fragment(OTHER, 9999, 8, padding=ack_tail)) == "drop"
    assert run(enforce_prog, first_fragment(CLIENT, 8080, 8)) == "pass"  # the rules still allow
    c = counters(enforce_prog)
    assert (c[Counter.IPV4_FRAGMENT], c[Counter.POLICY_DENY], c[Counter.POLICY_ALLOW], c[Counter.TCP_UNTRACKED],
            c[Counter.L4_TRUNCATED]) == (3, 2, 1, 0, 0)
    # A later fragment carries no header: passed (its first fragment was judged).
    later = P.ethernet(ethertype=P.ETH_P_IP, payload=P.ipv4(src=OTHER, dst=MODEL, proto=TCP, payload=b"\0" * 16,
                                                            flags_frag=1))
    assert run(enforce_prog, later) == "pass"


TAGS = {"802.1q-vid0": [(P.ETH_P_8021Q, 0)], "802.1q-vid100": [(P.ETH_P_8021Q, 100)],
        "qinq": [(P.ETH_P_8021AD, 0), (P.ETH_P_8021Q, 0)]}


@pytest.mark.parametrize("tags", TAGS.values(), ids=TAGS.keys())
def test_vlan_tagged_frames_are_judged_by_the_packet_inside(enforce_prog: LoadedProgram,
                                                            tags: list[tuple[int, int]]) -> None:
    """The kernel strips priority tags (VID 0) and delivers the packet as untagged; a VLAN
    sub-interface takes tagged ones: the packet inside meets the same rules."""
    install(enforce_prog)
    assert run(enforce_prog, P.vlan_tagged(tcp(OTHER, MODEL, 40000, 9999, P.TCP_SYN), *tags)) == "drop"
    assert run(enforce_prog, P.vlan_tagged(tcp(OTHER6, MODEL6, 40000, 9999, P.TCP_SYN), *tags)) == "drop"
    assert run(enforce_prog, P.vlan_tagged(tcp(CLIENT, MODEL, 40000, 8080, P.TCP_SYN), *tags)) == "pass"
    assert run(enforce_prog, P.vlan_tagged(tcp(OTHER, CLIENT, 40000, 9999, P.TCP_SYN), *tags)) == "pass"
    c = counters(enforce_prog)
    assert (c[Counter.VLAN], c[Counter.POLICY_DENY], c[Counter.POLICY_ALLOW], c[Counter.UNPOLICED]) == (4, 2, 1, 1)
    assert len(flows(enforce_prog)) == 4


def test_frames_with_more_vlan_tags_than_parsed_are_denied_under_a_policy(enforce_prog: LoadedProgram) -> None:
    """Three VID-0 tags: the kernel still strips them all and delivers the packet, whose destination
    the program cannot read: denied once a policy is installed, passed before."""
    frame = P.vlan_tagged(tcp(OTHER, MODEL, 40000, 9999, P.TCP_SYN), *[(P.ETH_P_8021Q, 0)] * 3)
    assert run(enforce_prog, frame) == "pass"
    assert counters(enforce_prog)[Counter.NO_POLICY] == 1
    install(enforce_prog)
    assert run(enforce_prog, frame) == "drop"
    assert counters(enforce_prog)[Counter.POLICY_DENY] == 1


def test_a_truncated_vlan_tag_passes_as_a_truncated_frame(enforce_prog: LoadedProgram) -> None:
    install(enforce_prog)
    frame = P.DST_MAC + P.SRC_MAC + bytes.fromhex("8100") + b"\0"  # the tag ends after one byte
    assert run(enforce_prog, frame) == "pass"
    got = {c: n for c, n in counters(enforce_prog).items() if n}
    assert got == {Counter.VLAN: 1, Counter.ETH_TRUNCATED: 1}


def test_a_policed_pods_own_overlay_port_is_judged(enforce_prog: LoadedProgram) -> None:
    """Encapsulation is addressed to nodes; UDP to a policed pod's port 4789 is that pod's traffic."""
    install(enforce_prog)
    for port in (4789, 8472, 6081):
        assert run(enforce_prog, P.udp_frame(src=OTHER, dst=MODEL, sport=40000, dport=port)) == "drop"
    c = counters(enforce_prog)
    assert (c[Counter.OVERLAY], c[Counter.POLICY_DENY]) == (0, 3)
