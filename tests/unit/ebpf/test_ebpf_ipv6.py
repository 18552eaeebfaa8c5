"""IPv6 in the XDP program (BPF_PROG_TEST_RUN on synthetic frames): parsed, counted per flow with
its addresses, judged by the same identity records as IPv4 (one inner map, A/B swap), extension
headers judged by the destination's default, malformed headers counted and passed."""
from __future__ import annotations

import socket

import pytest

from sparsegate_ebpf import packets as P
from sparsegate_ebpf.maps import ACTION_ALLOW, ACTION_DENY, CT_OUTBOUND, Counter, addr_bytes, ip_of, port_to_be16
from sparsegate_ebpf.metrics import AgentState, XdpCollector
from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testing import counters, flows, verdicts
from sparsegate_ebpf.testrun import run_xdp

pytestmark = pytest.mark.bpf

CLIENT6, MODEL6, OTHER6, NODE6 = "fd00:3::1", "fd00:3::2", "fd00:3::3", "fd00:3::fe"
CLIENT4, MODEL4 = "10.3.0.1", "10.3.0.2"
TCP, UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP
HOP_BY_HOP, FRAGMENT, ICMPV6 = 0, 44, 58


def run(prog: LoadedProgram, frame: bytes, repeat: int = 1) -> str:
    return run_xdp(prog_fd=prog.prog_fd, data=frame, repeat=repeat).verdict


def syn(src: str, dst: str, sport: int, dport: int) -> bytes:
    return P.tcp_frame(src=src, dst=dst, sport=sport, dport=dport, flags=P.TCP_SYN)


def raw6(next_header: int, payload: bytes, *, src: str = CLIENT6, dst: str = MODEL6, version: int = 6) -> bytes:
    return P.ethernet(ethertype=P.ETH_P_IPV6, payload=P.ipv6(src=src, dst=dst, next_header=next_header,
                                                            payload=payload, version=version))


def nonzero(prog: LoadedProgram) -> dict[Counter, int]:
    return {c: n for c, n in counters(prog).items() if n}


def install(prog: LoadedProgram, *, default: str = "deny", extra_sources: tuple[str, ...] = ()) -> PolicySwapper:
    """Dual-stack identities: the client and the model pod each with an IPv4 and an IPv6 address;
    the client may reach the model on tcp/8080 and udp/9000."""
    doc = {"version": "v6", "defaultAction": default,
           "identities": [{"identity": 256, "ips": [CLIENT4, CLIENT6]}, {"identity": 257, "ips": [MODEL4, MODEL6]}],
           "rules": [{"srcIdentity": 256, "dstIdentity": 257, "dstPort": 8080, "protocol": "tcp", "action": "allow",
                      "rule": "m/p#0"},
                     {"srcIdentity": 256, "dstIdentity": 257, "dstPort": 9000, "protocol": "udp", "action": "allow",
                      "rule": "m/p#1"}]}
    swapper = PolicySwapper(bpf=prog.bpf)
    swapper.apply(parse_policy(doc), extra_sources=extra_sources)
    return swapper


def test_ipv6_tcp_and_udp_flows_counted_with_their_addresses(telemetry_prog: LoadedProgram) -> None:
    tcp = P.tcp_frame(src=CLIENT6, dst=MODEL6, sport=40000, dport=8080, payload=b"x" * 100)
    assert run(telemetry_prog, tcp, repeat=5) == "pass"
    assert run(telemetry_prog, P.udp_frame(src=CLIENT6, dst=MODEL6, sport=5353, dport=9000, payload=b"y"),
               repeat=3) == "pass"
    assert nonzero(telemetry_prog) == {Counter.IPV6: 8, Counter.TCP: 5, Counter.UDP: 3}
    got = flows(telemetry_prog)
    key = (addr_bytes(CLIENT6), addr_bytes(MODEL6), port_to_be16(40000), port_to_be16(8080), TCP)
    assert got[key].packets == 5 and got[key].bytes == 5 * len(tcp)
    assert got[key].first_seen_jiffies <= got[key].last_seen_jiffies
    assert (addr_bytes(CLIENT6), addr_bytes(MODEL6), port_to_be16(5353), port_to_be16(9000), UDP) in got
    assert len(got) == 2


def test_ipv6_handshake_rtt_from_syn_to_syn_ack(telemetry_prog: LoadedProgram) -> None:
    run(telemetry_prog, syn(CLIENT6, MODEL6, 40000, 80))
    run(telemetry_prog, P.tcp_frame(src=MODEL6, dst=CLIENT6, sport=80, dport=40000, flags=P.TCP_SYN | P.TCP_ACK))
    hs = {(bytes(k.saddr), k.dport): v for k, v in telemetry_prog.bpf[b"handshakes"].items()}
    h = hs[(addr_bytes(CLIENT6), port_to_be16(80))]
    assert h.samples == 1 and 0 < h.last_rtt_ns < 10**9


def test_exporter_labels_ipv6_flows_with_their_addresses(telemetry_prog: LoadedProgram) -> None:
    run(telemetry_prog, P.udp_frame(src=CLIENT6, dst=MODEL6, sport=5353, dport=9000), repeat=2)
    run(telemetry_prog, P.udp_frame(src=CLIENT4, dst=MODEL4, sport=5353, dport=9000), repeat=1)
    state = AgentState(bpf_available=True, program=telemetry_prog, enforcement="off")
    samples = {m.name: m.samples for m in XdpCollector(state=state).collect()}
    flow_packets = {(s.labels["src"], s.labels["dst"], s.labels["dport"], s.labels["proto"]): s.value
                    for s in samples["sparsegate_xdp_flow_packets"]}
    assert flow_packets == {(CLIENT6, MODEL6, "9000", "udp"): 2, (CLIENT4, MODEL4, "9000", "udp"): 1}
    types = {s.labels["type"]: s.value for s in samples["sparsegate_xdp_packets"]}
    assert (types["ipv6"], types["ipv4"], types["udp"]) == (2, 1, 3)


def test_an_ipv6_flow_of_ipv4_mapped_addresses_is_not_labelled_as_the_ipv4_flow(telemetry_prog: LoadedProgram) -> None:
    """An IPv6 packet from ::ffff:10.3.0.1 (which the kernel's IPv6 input drops, but XDP counts in
    `flows6`) was labelled src="10.3.0.1": one label set for two flows (Prometheus keeps one sample,
    so a crafted one could hide the real IPv4 flow's series), and the port totals kept one of them."""
    run(telemetry_prog, P.udp_frame(src=CLIENT4, dst=MODEL4, sport=5353, dport=9000), repeat=1)
    run(telemetry_prog, P.udp_frame(src=f"::ffff:{CLIENT4}", dst=f"::ffff:{MODEL4}", sport=5353, dport=9000), repeat=3)
    state = AgentState(bpf_available=True, program=telemetry_prog, enforcement="off")
    samples = {m.name: m.samples for m in XdpCollector(state=state).collect()}
    flow_packets = [((s.labels["src"], s.labels["dst"]), s.value) for s in samples["sparsegate_xdp_flow_packets"]
                    if s.name.endswith("_total")]
    assert sorted(flow_packets) == [((CLIENT4, MODEL4), 1), ((f"::ffff:{CLIENT4}", f"::ffff:{MODEL4}"), 3)]
    ports = {s.labels["port"]: s.value for s in samples["sparsegate_xdp_port_packets"] if s.name.endswith("_total")}
    assert ports == {"9000": 4}


@pytest.mark.parametrize(("frame", "expected"), [
    (P.ethernet(ethertype=P.ETH_P_IPV6, payload=b"\x60" + b"\0" * 30), {Counter.IPV6_TRUNCATED: 1}),
    (raw6(TCP, P.tcp(sport=1, dport=8080), version=4), {Counter.IPV6_BAD_HEADER: 1}),
    (raw6(TCP, b"\0" * 10), {Counter.IPV6: 1, Counter.L4_TRUNCATED: 1}),
    (raw6(ICMPV6, b"\x87\0" + b"\0" * 22), {Counter.IPV6: 1, Counter.IPV6_OTHER_PROTO: 1}),  # neighbour solicitation
], ids=["truncated", "version4", "l4-truncated", "icmpv6"])
def test_malformed_and_non_tcp_udp_ipv6_passes_even_to_a_policed_destination(
        enforce_prog: LoadedProgram, frame: bytes, expected: dict) -> None:
    install(enforce_prog)
    assert run(enforce_prog, frame) == "pass"
    assert nonzero(enforce_prog) == expected
    assert flows(enforce_prog) == {}


def test_ipv6_allowed_flows_pass_and_others_are_dropped_by_the_same_identities(enforce_prog: LoadedProgram) -> None:
    install(enforce_prog)
    assert run(enforce_prog, syn(CLIENT6, MODEL6, 40000, 8080)) == "pass"
    assert run(enforce_prog, P.udp_frame(src=CLIENT6, dst=MODEL6, sport=1, dport=9000), repeat=3) == "pass"
    assert run(enforce_prog, syn(CLIENT6, MODEL6, 40001, 8081)) == "drop"  # no rule for the port
    assert run(enforce_prog, syn(OTHER6, MODEL6, 40002, 8080)) == "drop"  # no identity
    assert run(enforce_prog, syn(CLIENT4, MODEL4, 40003, 8080)) == "pass"  # IPv4 of the same pods
    assert run(enforce_prog, syn(CLIENT6, OTHER6, 40004, 22)) == "pass"  # not policed
    c = counters(enforce_prog)
    assert (c[Counter.POLICY_ALLOW], c[Counter.POLICY_DENY], c[Counter.UNPOLICED]) == (5, 2, 1)
    assert verdicts(enforce_prog) == {(1, 1, ACTION_ALLOW): 2, (1, 2, ACTION_ALLOW): 3, (1, 0, ACTION_DENY): 2}
    dropped = {(ip_of_bytes(s), ip_of_bytes(d), socket.ntohs(dport)): t.dropped
               for (s, d, _sport, dport, _proto), t in flows(enforce_prog).items()}
    assert dropped == {(CLIENT6, MODEL6, 8080): 0, (CLIENT6, MODEL6, 9000): 0, (CLIENT6, MODEL6, 8081): 1,
                       (OTHER6, MODEL6, 8080): 1, (CLIENT4, MODEL4, 8080): 0, (CLIENT6, OTHER6, 22): 0}


def ip_of_bytes(raw: bytes) -> str:
    from sparsegate_ebpf.maps import Addr

    return ip_of(Addr.from_buffer_copy(raw))


def test_ipv6_node_source_and_tracked_replies_pass(enforce_prog: LoadedProgram) -> None:
    install(enforce_prog, extra_sources=(NODE6,))
    assert run(enforce_prog, syn(NODE6, MODEL6, 40000, 10250)) == "pass"  # a kubelet probe over IPv6
    # The model pod opens a UDP flow (seen where its egress is our ingress): the reply passes.
    assert run(enforce_prog, P.udp_frame(src=MODEL6, dst=OTHER6, sport=40124, dport=123)) == "pass"
    ct = {(bytes(k.saddr), k.dport): v.kind for k, v in enforce_prog.bpf[b"conntrack"].items()}
    assert ct == {(addr_bytes(MODEL6), socket.htons(123)): CT_OUTBOUND}
    assert run(enforce_prog, P.udp_frame(src=OTHER6, dst=MODEL6, sport=123, dport=40124)) == "pass"
    c = counters(enforce_prog)
    assert (c[Counter.ALLOWED_SOURCE], c[Counter.CT_REPLY], c[Counter.POLICY_DENY]) == (1, 1, 0)


def test_extension_headers_are_judged_by_the_destination_default(enforce_prog: LoadedProgram) -> None:
    """A hop-by-hop or fragment header in front of TCP hides the ports: to a policed destination the
    default action decides (deny: dropped, even for a port the rules allow); elsewhere it passes."""
    hidden = P.ext_header(next_header=TCP) + P.tcp(sport=40000, dport=8080, flags=P.TCP_SYN)
    install(enforce_prog, extra_sources=(NODE6,))
    assert run(enforce_prog, raw6(HOP_BY_HOP, hidden)) == "drop"
    assert run(enforce_prog, raw6(FRAGMENT, hidden)) == "drop"
    assert run(enforce_prog, raw6(HOP_BY_HOP, hidden, dst=OTHER6)) == "pass"  # not policed
    assert run(enforce_prog, raw6(HOP_BY_HOP, hidden, src=NODE6)) == "pass"  # always-allowed source
    c = counters(enforce_prog)
    assert (c[Counter.IPV6_EXT_HEADER], c[Counter.POLICY_DENY], c[Counter.ALLOWED_SOURCE]) == (4, 2, 1)
    assert flows(enforce_prog) == {}  # no ports: no flow entry
    assert verdicts(enforce_prog) == {(1, 0, ACTION_DENY): 2}
    install(enforce_prog, default="allow")
    assert run(enforce_prog, raw6(HOP_BY_HOP, hidden)) == "pass"


def test_audit_mode_counts_ipv6_would_be_drops(audit_prog: LoadedProgram) -> None:
    install(audit_prog)
    assert run(audit_prog, syn(OTHER6, MODEL6, 40000, 8080)) == "pass"
    assert run(audit_prog, raw6(HOP_BY_HOP, P.ext_header(next_header=UDP) + P.udp(sport=1, dport=9000))) == "pass"
    c = counters(audit_prog)
    assert (c[Counter.POLICY_DENY], c[Counter.AUDIT_DENY]) == (2, 2)


def test_a_swap_rejudges_ipv6_flows(enforce_prog: LoadedProgram) -> None:
    swapper = install(enforce_prog)
    frame = P.udp_frame(src=CLIENT6, dst=MODEL6, sport=1, dport=9000)
    assert run(enforce_prog, frame, repeat=2) == "pass"
    swapper.apply(parse_policy({"version": "narrowed", "defaultAction": "deny", "identities": [], "rules": [],
                                "policedDestinations": [MODEL6]}))
    assert run(enforce_prog, frame) == "drop"
    assert verdicts(enforce_prog) == {(1, 2, ACTION_ALLOW): 2, (2, 0, ACTION_DENY): 1}
