"""Scoped, stateful verdicts of the XDP program on synthetic frames (BPF_PROG_TEST_RUN).

Only packets to a policed destination are judged; node addresses / the operator, DNS, replies of
tracked flows and TCP without SYN pass before the allow-list; overlay UDP to a node is counted; audit
mode counts would-be drops and drops nothing.
"""
from __future__ import annotations

import socket

import pytest

from sparsegate_ebpf import packets as P
from sparsegate_ebpf.maps import ACTION_ALLOW, ACTION_DENY, CT_ALLOWED, CT_OUTBOUND, Counter, addr_bytes
from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testing import counters, flows, verdicts
from sparsegate_ebpf.testrun import run_xdp

pytestmark = pytest.mark.bpf

CLIENT, MODEL, OTHER, NODE, OPERATOR = "10.3.0.1", "10.3.0.2", "10.3.0.3", "10.3.0.254", "10.3.0.100"


def run(prog: LoadedProgram, frame: bytes, repeat: int = 1) -> str:
    return run_xdp(prog_fd=prog.prog_fd, data=frame, repeat=repeat).verdict


def syn(src: str, dst: str, sport: int, dport: int) -> bytes:
    return P.tcp_frame(src=src, dst=dst, sport=sport, dport=dport, flags=P.TCP_SYN)


def ack(src: str, dst: str, sport: int, dport: int) -> bytes:
    return P.tcp_frame(src=src, dst=dst, sport=sport, dport=dport, flags=P.TCP_ACK)


def udp(src: str, dst: str, sport: int, dport: int) -> bytes:
    return P.udp_frame(src=src, dst=dst, sport=sport, dport=dport, payload=b"x")


def install(prog: LoadedProgram, *, allow_port: int | None = 8080, extra_sources: tuple[str, ...] = (NODE,),
            swapper: PolicySwapper | None = None) -> PolicySwapper:
    """MODEL is policed; CLIENT may reach it on `allow_port`; the operator is always allowed."""
    entries = [] if allow_port is None else [
        {"srcIP": CLIENT, "dstIP": MODEL, "dstPort": allow_port, "protocol": "tcp", "action": "allow", "rule": "m/p#0"},
        {"srcIP": CLIENT, "dstIP": MODEL, "dstPort": allow_port, "protocol": "udp", "action": "allow", "rule": "m/p#1"}]
    swapper = swapper or PolicySwapper(bpf=prog.bpf)
    swapper.apply(parse_policy({"defaultAction": "deny", "entries": entries, "policedDestinations": [MODEL],
                                "allowedSources": [OPERATOR]}), extra_sources=extra_sources)
    return swapper


def test_only_policed_destinations_are_judged(enforce_prog: LoadedProgram) -> None:
    install(enforce_prog)
    assert run(enforce_prog, syn(OTHER, MODEL, 40000, 8080)) == "drop"      # not allowed, policed
    assert run(enforce_prog, syn(OTHER, CLIENT, 40000, 8080)) == "pass"     # not policed
    assert run(enforce_prog, udp(OTHER, CLIENT, 40000, 9999)) == "pass"
    assert run(enforce_prog, syn(CLIENT, MODEL, 40000, 8080)) == "pass"     # allowed by a rule
    c = counters(enforce_prog)
    assert (c[Counter.POLICY_DENY], c[Counter.UNPOLICED], c[Counter.POLICY_ALLOW]) == (1, 2, 1)


def test_node_addresses_and_the_operator_always_reach_policed_destinations(enforce_prog: LoadedProgram) -> None:
    install(enforce_prog, allow_port=None)  # nothing allowed by rules
    for src in (NODE, OPERATOR):
        assert run(enforce_prog, syn(src, MODEL, 40000, 8080)) == "pass"    # kubelet probe / admin
        assert run(enforce_prog, syn(src, MODEL, 40000, 8443)) == "pass"
    assert run(enforce_prog, syn(OTHER, MODEL, 40000, 8080)) == "drop"
    assert counters(enforce_prog)[Counter.ALLOWED_SOURCE] == 4
    assert verdicts(enforce_prog) == {(1, 0, ACTION_DENY): 1}  # the allowed sources never reach the rules


def test_dns_passes_both_ways_but_a_syn_from_port_53_is_still_judged(enforce_prog: LoadedProgram) -> None:
    install(enforce_prog, allow_port=None)
    assert run(enforce_prog, udp(OTHER, MODEL, 53, 41000)) == "pass"         # a DNS answer to the model pod
    assert run(enforce_prog, P.tcp_frame(src=OTHER, dst=MODEL, sport=53, dport=41001,
                                         flags=P.TCP_SYN | P.TCP_ACK)) == "pass"
    assert run(enforce_prog, udp(OTHER, MODEL, 41002, 53)) == "pass"         # a query to port 53
    assert run(enforce_prog, syn(OTHER, MODEL, 53, 8080)) == "drop"          # source port 53 opens nothing
    assert counters(enforce_prog)[Counter.DNS] == 3


@pytest.mark.parametrize("port", [4789, 8472, 6081], ids=["vxlan", "vxlan-linux", "geneve"])
def test_overlay_udp_to_a_destination_not_policed_is_counted_as_overlay(enforce_prog: LoadedProgram,
                                                                        port: int) -> None:
    install(enforce_prog, allow_port=None)
    assert run(enforce_prog, udp(OTHER, NODE, 40000, port), repeat=3) == "pass"  # cached after the first
    assert run(enforce_prog, udp(OTHER, MODEL, 40000, port)) == "drop"  # a policed pod's own port: judged
    c = counters(enforce_prog)
    assert (c[Counter.OVERLAY], c[Counter.UNPOLICED], c[Counter.POLICY_DENY]) == (3, 0, 1)


def test_replies_to_a_flow_the_model_pod_opened_pass_when_its_outbound_packet_was_seen(
        enforce_prog: LoadedProgram) -> None:
    install(enforce_prog, allow_port=None)
    # No outbound seen: a UDP "reply" is just an unsolicited datagram, judged and dropped.
    assert run(enforce_prog, udp(OTHER, MODEL, 123, 40123)) == "drop"
    # The model pod sends first (seen where its egress is our ingress): tracked, its replies pass.
    assert run(enforce_prog, udp(MODEL, OTHER, 40124, 123)) == "pass"
    ct = {(bytes(k.saddr), k.dport): v.kind for k, v in enforce_prog.bpf[b"conntrack"].items()}
    assert ct == {(addr_bytes(MODEL), socket.htons(123)): CT_OUTBOUND}
    assert run(enforce_prog, udp(OTHER, MODEL, 123, 40124), repeat=4) == "pass"
    c = counters(enforce_prog)
    assert (c[Counter.CT_REPLY], c[Counter.POLICY_DENY]) == (4, 1)


def test_an_allowed_flow_is_tracked_and_its_reverse_direction_is_a_reply(enforce_prog: LoadedProgram) -> None:
    # Both ends policed (model pod to model pod): the reply direction is judged as a reply.
    entry = {"srcIP": CLIENT, "dstIP": MODEL, "dstPort": 8080, "protocol": "tcp", "action": "allow"}
    PolicySwapper(bpf=enforce_prog.bpf).apply(parse_policy({"defaultAction": "deny", "entries": [entry],
                                                            "policedDestinations": [CLIENT, MODEL]}))
    assert run(enforce_prog, syn(CLIENT, MODEL, 40000, 8080)) == "pass"
    assert [v.kind for v in enforce_prog.bpf[b"conntrack"].values()] == [CT_ALLOWED]
    synack = P.tcp_frame(src=MODEL, dst=CLIENT, sport=8080, dport=40000, flags=P.TCP_SYN | P.TCP_ACK)
    assert run(enforce_prog, synack) == "pass"
    assert run(enforce_prog, syn(MODEL, CLIENT, 40001, 8080)) == "drop"  # not a reply: a new attempt
    assert counters(enforce_prog)[Counter.CT_REPLY] == 1


def test_tcp_without_syn_and_no_state_passes_but_narrowing_cuts_a_judged_flow(enforce_prog: LoadedProgram) -> None:
    swapper = install(enforce_prog)
    # An ACK nobody judged: the reply to a connection the pod opened unseen, or an attacker's probe
    # (the pod's stack answers with a reset: no connection opens without a SYN).
    assert run(enforce_prog, ack(OTHER, MODEL, 443, 40000)) == "pass"
    assert counters(enforce_prog)[Counter.TCP_UNTRACKED] == 1
    assert run(enforce_prog, syn(CLIENT, MODEL, 40001, 8080)) == "pass"
    assert run(enforce_prog, ack(CLIENT, MODEL, 40001, 8080), repeat=5) == "pass"
    assert verdicts(enforce_prog) == {(1, 1, ACTION_ALLOW): 6}  # every packet attributed, cached ones too
    install(enforce_prog, allow_port=9090, swapper=swapper)  # generation 2 no longer allows 8080
    assert run(enforce_prog, ack(CLIENT, MODEL, 40001, 8080)) == "drop"
    assert verdicts(enforce_prog)[(2, 0, ACTION_DENY)] == 1


def test_a_swap_rejudges_cached_flows(enforce_prog: LoadedProgram) -> None:
    swapper = install(enforce_prog, allow_port=None)
    frame = udp(CLIENT, MODEL, 40000, 8080)
    assert run(enforce_prog, frame, repeat=3) == "drop"
    install(enforce_prog, allow_port=8080, swapper=swapper)
    assert run(enforce_prog, frame, repeat=2) == "pass"
    assert verdicts(enforce_prog) == {(1, 0, ACTION_DENY): 3, (2, 2, ACTION_ALLOW): 2}
    (key, totals), = flows(enforce_prog).items()
    assert (totals.packets, totals.dropped) == (5, 3)


def test_audit_mode_counts_would_be_drops_and_drops_nothing(audit_prog: LoadedProgram) -> None:
    install(audit_prog)
    assert run(audit_prog, syn(OTHER, MODEL, 40000, 8080), repeat=3) == "pass"
    assert run(audit_prog, udp(OTHER, MODEL, 40000, 8081), repeat=2) == "pass"
    assert run(audit_prog, syn(CLIENT, MODEL, 40001, 8080)) == "pass"
    c = counters(audit_prog)
    assert (c[Counter.AUDIT_DENY], c[Counter.POLICY_DENY], c[Counter.POLICY_ALLOW]) == (5, 5, 1)
    assert verdicts(audit_prog) == {(1, 0, ACTION_DENY): 5, (1, 1, ACTION_ALLOW): 1}
    assert all(t.dropped == 0 for t in flows(audit_prog).values())
