"""The XDP program on synthetic frames via BPF_PROG_TEST_RUN (real kernel, no interface)."""
from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from sparsegate_ebpf import packets as P
from sparsegate_ebpf.maps import ACTION_ALLOW, ACTION_DENY, KEY_POLICED_DST, Counter, addr_bytes, port_to_be16
from sparsegate_ebpf.metrics import AgentState, XdpCollector
from sparsegate_ebpf.policy import compile_policy, parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testing import counters, flows, ports, verdicts
from sparsegate_ebpf.testrun import run_xdp

pytestmark = pytest.mark.bpf

A, B = "10.1.0.1", "10.1.0.2"
TCP, UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP


def run(prog: LoadedProgram, frame: bytes, repeat: int = 1) -> str:
    return run_xdp(prog_fd=prog.prog_fd, data=frame, repeat=repeat).verdict


def fkey(src: str, dst: str, sport: int, dport: int, proto: int) -> tuple[bytes, bytes, int, int, int]:
    return (addr_bytes(src), addr_bytes(dst), port_to_be16(sport), port_to_be16(dport), proto)


def only(prog: LoadedProgram, *expected: Counter) -> None:
    """Exactly these packet-type counters are non-zero (each == 1 per frame sent)."""
    got = {c: n for c, n in counters(prog).items() if n}
    assert set(got) == set(expected), got


def policy(entries: list[dict], default: str = "deny", policed: list[str] | None = None) -> object:
    doc = {"version": "t", "defaultAction": default, "entries": entries}
    if policed is not None:
        doc["policedDestinations"] = policed
    return parse_policy(doc)


def syn(src: str, dst: str, sport: int, dport: int) -> bytes:
    """A connection attempt: what the policy judges for TCP."""
    return P.tcp_frame(src=src, dst=dst, sport=sport, dport=dport, flags=P.TCP_SYN)


def allow(dport: int, proto: str = "tcp", rule: str = "r") -> dict:
    return {"srcIP": A, "dstIP": B, "dstPort": dport, "protocol": proto, "action": "allow", "rule": rule}


# --- parsing and telemetry -------------------------------------------------------------

def test_tcp_flow_counted_with_ports_bytes_and_timestamps(telemetry_prog: LoadedProgram) -> None:
    frame = P.tcp_frame(src=A, dst=B, sport=40000, dport=8080, payload=b"x" * 100)
    before = telemetry_prog.clock.sample().jiffies
    assert run(telemetry_prog, frame, repeat=5) == "pass"
    after = telemetry_prog.clock.sample().jiffies
    only(telemetry_prog, Counter.IPV4, Counter.TCP)
    assert counters(telemetry_prog)[Counter.TCP] == 5
    (key, t), = flows(telemetry_prog).items()
    assert key == fkey(A, B, 40000, 8080, TCP)
    assert (t.packets, t.bytes, t.dropped) == (5, 5 * len(frame), 0)
    # Stamped in jiffies: the tick count the program's clock function reads before and after.
    assert before <= t.first_seen_jiffies <= t.last_seen_jiffies <= after
    assert ports(telemetry_prog) == {(8080, TCP): (5, 5 * len(frame))}


def test_udp_flow_and_per_port_totals(telemetry_prog: LoadedProgram) -> None:
    for sport in (1000, 1001):
        run(telemetry_prog, P.udp_frame(src=A, dst=B, sport=sport, dport=53, payload=b"q"))
    run(telemetry_prog, P.udp_frame(src=B, dst=A, sport=53, dport=1000))
    f = flows(telemetry_prog)
    assert set(f) == {fkey(A, B, 1000, 53, UDP), fkey(A, B, 1001, 53, UDP), fkey(B, A, 53, 1000, UDP)}
    assert ports(telemetry_prog)[(53, UDP)][0] == 2
    assert ports(telemetry_prog)[(1000, UDP)][0] == 1


@pytest.mark.parametrize(
    ("frame", "counted"),
    [
        (P.ethernet(ethertype=P.ETH_P_ARP, payload=b"\0" * 28), [Counter.ARP]),
        # Tagged: the tag is skipped, the frame inside counted by its own type.
        (P.ethernet(ethertype=P.ETH_P_8021Q, payload=b"\0" * 46), [Counter.VLAN, Counter.OTHER_L2]),
        (P.ethernet(ethertype=0x88CC, payload=b"\0" * 46), [Counter.OTHER_L2]),
    ],
    ids=["arp", "vlan", "lldp"],
)
def test_non_ip_frames_pass_untouched_and_counted_by_type(enforce_prog: LoadedProgram, frame: bytes,
                                                             counted: list[Counter]) -> None:
    PolicySwapper(bpf=enforce_prog.bpf).apply(policy([]))  # default deny must not touch them
    out = run_xdp(prog_fd=enforce_prog.prog_fd, data=frame)
    assert out.verdict == "pass" and out.data_out == frame
    only(enforce_prog, *counted)
    assert flows(enforce_prog) == {}


def ipv4_raw(**kw: object) -> bytes:
    return P.ethernet(ethertype=P.ETH_P_IP, payload=P.ipv4(src=A, dst=B, **kw))


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (P.ethernet(ethertype=P.ETH_P_IP), [Counter.IPV4_TRUNCATED]),
        (ipv4_raw(proto=TCP)[:14 + 19], [Counter.IPV4_TRUNCATED]),
        (ipv4_raw(proto=TCP, ihl=4, payload=P.tcp(sport=1, dport=2)), [Counter.IPV4_BAD_HEADER]),
        (ipv4_raw(proto=TCP, ihl=0, payload=P.tcp(sport=1, dport=2)), [Counter.IPV4_BAD_HEADER]),
        (ipv4_raw(proto=TCP, version=6, payload=P.tcp(sport=1, dport=2)), [Counter.IPV4_BAD_HEADER]),
        # IHL 15 announces 60 header bytes, the frame ends after 28.
        (ipv4_raw(proto=UDP, ihl=15, payload=P.udp(sport=1, dport=2)), [Counter.IPV4_TRUNCATED]),
        (ipv4_raw(proto=TCP, payload=P.tcp(sport=1, dport=2)[:10]), [Counter.IPV4, Counter.L4_TRUNCATED]),
        (ipv4_raw(proto=TCP, payload=P.tcp(sport=1, dport=2, doff=4)), [Counter.IPV4, Counter.L4_TRUNCATED]),
        (ipv4_raw(proto=UDP, payload=P.udp(sport=1, dport=2)[:4]), [Counter.IPV4, Counter.L4_TRUNCATED]),
        (ipv4_raw(proto=socket.IPPROTO_ICMP, payload=b"\x08\0" + b"\0" * 6), [Counter.IPV4, Counter.IPV4_OTHER_PROTO]),
        # Non-first fragment: its payload looks like ports but must not be read as a header.
        (ipv4_raw(proto=UDP, flags_frag=100, payload=P.udp(sport=1, dport=2)),
         [Counter.IPV4, Counter.IPV4_FRAGMENT]),
    ],
    ids=["eth-only", "ip-cut", "ihl4", "ihl0", "version6", "options-cut", "tcp-cut", "tcp-doff4",
         "udp-cut", "icmp", "later-fragment"],
)
def test_malformed_and_unpoliced_ipv4_counted_and_passed_even_under_default_deny(
        enforce_prog: LoadedProgram, frame: bytes, expected: list[Counter]) -> None:
    PolicySwapper(bpf=enforce_prog.bpf).apply(policy([]))
    assert run(enforce_prog, frame) == "pass"
    only(enforce_prog, *expected)
    assert flows(enforce_prog) == {}
    assert verdicts(enforce_prog) == {}


def test_ip_options_are_skipped_to_find_the_real_ports(telemetry_prog: LoadedProgram) -> None:
    frame = P.ethernet(ethertype=P.ETH_P_IP, payload=P.ipv4(
        src=A, dst=B, proto=TCP, ihl=6, options=b"\x01\x01\x01\x00", payload=P.tcp(sport=5555, dport=443)))
    assert run(telemetry_prog, frame) == "pass"
    assert set(flows(telemetry_prog)) == {fkey(A, B, 5555, 443, TCP)}


def test_first_fragment_carries_ports_and_is_judged(enforce_prog: LoadedProgram) -> None:
    PolicySwapper(bpf=enforce_prog.bpf).apply(policy([], policed=[B]))
    frame = ipv4_raw(proto=UDP, flags_frag=0x2000, payload=P.udp(sport=7, dport=9, payload=b"a" * 8))
    assert run(enforce_prog, frame) == "drop"
    only(enforce_prog, Counter.IPV4, Counter.IPV4_FRAGMENT, Counter.UDP, Counter.POLICY_DENY)


# --- policy -----------------------------------------------------------------------------

def test_no_policy_installed_passes_and_counts(enforce_prog: LoadedProgram) -> None:
    assert run(enforce_prog, P.tcp_frame(src=A, dst=B, sport=1, dport=2)) == "pass"
    only(enforce_prog, Counter.IPV4, Counter.TCP, Counter.NO_POLICY)


def test_policy_allows_listed_flow_drops_the_rest_and_attributes_rules(enforce_prog: LoadedProgram) -> None:
    deny_rule = {"srcIP": A, "dstIP": B, "dstPort": 9090, "protocol": "tcp", "action": "deny", "rule": "ns/x#deny"}
    res = PolicySwapper(bpf=enforce_prog.bpf).apply(policy([allow(8080, rule="ns/x#ok"), deny_rule], default="deny"))
    g = res.generation
    ok = syn(A, B, 40000, 8080)
    assert run(enforce_prog, ok, repeat=3) == "pass"
    assert run(enforce_prog, syn(A, B, 40000, 9090)) == "drop"
    assert run(enforce_prog, syn(A, B, 40000, 7070)) == "drop"
    # Same ports, other protocol: not listed -> default deny. Reversed direction: A is not a
    # policed destination (no entry names it), so it passes unjudged.
    assert run(enforce_prog, P.udp_frame(src=A, dst=B, sport=40000, dport=8080)) == "drop"
    assert run(enforce_prog, syn(B, A, 8080, 40000)) == "pass"
    assert verdicts(enforce_prog) == {(g, 1, ACTION_ALLOW): 3, (g, 2, ACTION_DENY): 1, (g, 0, ACTION_DENY): 2}
    c = counters(enforce_prog)
    assert (c[Counter.POLICY_ALLOW], c[Counter.POLICY_DENY], c[Counter.UNPOLICED]) == (3, 3, 1)
    f = flows(enforce_prog)
    assert (f[fkey(A, B, 40000, 8080, TCP)].packets, f[fkey(A, B, 40000, 8080, TCP)].dropped) == (3, 0)
    assert (f[fkey(A, B, 40000, 9090, TCP)].packets, f[fkey(A, B, 40000, 9090, TCP)].dropped) == (1, 1)


def test_default_allow_with_explicit_deny(enforce_prog: LoadedProgram) -> None:
    deny = {**allow(22), "action": "deny"}
    PolicySwapper(bpf=enforce_prog.bpf).apply(policy([deny], default="allow"))
    assert run(enforce_prog, syn(A, B, 1, 22)) == "drop"
    assert run(enforce_prog, syn(A, B, 1, 23)) == "pass"


def test_telemetry_only_program_never_drops(telemetry_prog: LoadedProgram) -> None:
    assert run(telemetry_prog, P.tcp_frame(src=A, dst=B, sport=1, dport=2), repeat=10) == "pass"
    only(telemetry_prog, Counter.IPV4, Counter.TCP)


def test_tcp_handshake_rtt_from_syn_to_syn_ack(telemetry_prog: LoadedProgram) -> None:
    run(telemetry_prog, P.tcp_frame(src=A, dst=B, sport=40000, dport=80, flags=P.TCP_SYN))
    run(telemetry_prog, P.tcp_frame(src=B, dst=A, sport=80, dport=40000, flags=P.TCP_SYN | P.TCP_ACK))
    run(telemetry_prog, P.tcp_frame(src=B, dst=A, sport=80, dport=40000, flags=P.TCP_SYN | P.TCP_ACK))  # dup
    hs = {(bytes(k.saddr), k.dport): v for k, v in telemetry_prog.bpf[b"handshakes"].items()}
    h = hs[(addr_bytes(A), port_to_be16(80))]
    assert h.samples == 1 and h.syn_ns == 0
    assert 0 < h.last_rtt_ns == h.rtt_sum_ns < 10**9


def test_handshake_rtt_series_are_one_per_client_server_and_port(telemetry_prog: LoadedProgram) -> None:
    """Each connection has its own entry (its own client port), but the series are labelled by
    client, server and server port only: three connections were three samples with the same labels
    in one exposition (Prometheus keeps one of them). One series: the mean over every connection,
    the last RTT of those handshaken since the previous scrape."""
    def handshake(sport: int, *, wait: float = 0.0) -> None:
        run(telemetry_prog, P.tcp_frame(src=A, dst=B, sport=sport, dport=8080, flags=P.TCP_SYN))
        time.sleep(wait)
        run(telemetry_prog, P.tcp_frame(src=B, dst=A, sport=8080, dport=sport, flags=P.TCP_SYN | P.TCP_ACK))

    collector = XdpCollector(state=AgentState(bpf_available=True, program=telemetry_prog, enforcement="off"))

    def scrape() -> tuple[float, float]:
        got = {m.name: m.samples for m in collector.collect()}
        (last,) = got["sparsegate_xdp_tcp_handshake_rtt_seconds"]
        (mean,) = got["sparsegate_xdp_tcp_handshake_rtt_mean_seconds"]
        assert last.labels == mean.labels == {"src": A, "dst": B, "dport": "8080"}
        return last.value, mean.value

    handshake(40000)
    handshake(40001, wait=0.2)
    handshake(40002)
    hs = [h for _, h in telemetry_prog.bpf[b"handshakes"].items()]
    assert len(hs) == 3
    last, mean = scrape()
    assert mean == pytest.approx(sum(h.rtt_sum_ns for h in hs) / 3 / 1e9)
    assert last == max(h.last_rtt_ns for h in hs) / 1e9 >= 0.2  # of the three since start, the slowest
    assert scrape() == (last, mean)  # nothing new: unchanged
    handshake(40003)  # only this one since the last scrape
    quick = max(h.last_rtt_ns for k, h in telemetry_prog.bpf[b"handshakes"].items() if k.sport == port_to_be16(40003))
    assert scrape()[0] == quick / 1e9 < last


# --- atomic swap --------------------------------------------------------------------------

def two_policies() -> tuple[object, object]:
    """Both allow A->B:8080/tcp, under different rule ids; they differ elsewhere."""
    pa = policy([allow(8080, rule="A#0"), {**allow(9000), "action": "deny", "rule": "A#1"}])
    pb = policy([allow(7000, rule="B#0"), allow(9000, rule="B#1"), allow(8080, rule="B#2")])
    return pa, pb


def test_swaps_under_load_never_drop_and_each_packet_sees_one_generation(enforce_prog: LoadedProgram) -> None:
    pa, pb = two_policies()
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    swapper.apply(pa)
    frame = syn(A, B, 40000, 8080)
    stop = threading.Event()
    results: list[str] = []
    runs = 0

    def traffic() -> None:
        nonlocal runs
        while not stop.is_set():
            results.append(run(enforce_prog, frame, repeat=200))
            runs += 200

    t = threading.Thread(target=traffic)
    t.start()
    try:
        for i in range(100):
            swapper.apply(pb if i % 2 == 0 else pa)
    finally:
        stop.set()
        t.join(30)
    assert set(results) == {"pass"}
    # The generations still in the maps (the last retired one and the two in the pool slots), by
    # generation; the older ones were folded into totals by rule name at each swap.
    v = verdicts(enforce_prog)
    expected_rule = {g: (1 if g % 2 == 1 else 3) for g in range(1, swapper.generation + 1)}  # A: odd gens
    assert all(rule == expected_rule[g] and action == ACTION_ALLOW for g, rule, action in v), v
    folded = swapper.retired_by_rule
    names = {*pa.rule_names().values(), *pb.rule_names().values()}
    assert all(name in names and action == ACTION_ALLOW for name, action in folded), folded
    assert sum(v.values()) + sum(packets for packets, _ in folded.values()) == runs
    assert len({g for g, _, _ in v}) > 1 or folded, "traffic never overlapped a swap"
    assert counters(enforce_prog)[Counter.POLICY_DENY] == 0


def test_in_place_rewrite_would_expose_a_half_applied_policy(enforce_prog: LoadedProgram) -> None:
    """Control: writing the live map record by record (what the A/B swap avoids) drops the
    allowed flow in between (here the destination is policed before its allow entry is written)
    - the hazard the swap test above proves absent."""
    pa, pb = two_policies()
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    res = swapper.apply(pa)
    live = enforce_prog.bpf[res.slot.encode()]
    seen = []
    live.clear()
    # Policed destinations first: until its rule and source records follow, the flow is denied.
    records = sorted(compile_policy(pb, generation=res.generation + 1), key=lambda kv: kv[0].kind != KEY_POLICED_DST)
    for sport, (key, val) in enumerate(records, start=40000):
        live[key] = val
        seen.append(run(enforce_prog, syn(A, B, sport, 8080)))  # a new flow each time: judged afresh
    assert "drop" in seen and seen[-1] == "pass"


def test_test_run_rejects_frames_shorter_than_ethernet(telemetry_prog: LoadedProgram) -> None:
    # The kernel refuses < 14-byte XDP input, so ETH_TRUNCATED is unreachable via test_run.
    with pytest.raises(OSError):
        run(telemetry_prog, b"\0" * 10)
    assert struct.calcsize("!H") == 2
