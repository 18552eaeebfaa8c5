"""Carrying a policy over from another program (inherit.py + PolicySwapper.apply_records_if_empty),
on two real loaded programs: the session's enforcing one plays the predecessor, a second enforcing
one the successor; test_run frames show the successor judging with the carried-over records."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from sparsegate_ebpf import inherit
from sparsegate_ebpf import packets as P
from sparsegate_ebpf.policy import compile_policy, parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.maps import (
    ACTION_ALLOW,
    ACTION_DENY,
    KEY_ALLOWED_SRC,
    KEY_POLICED_DST,
    PROTO_NUMBERS,
    PolicyKey,
    PolicyVal,
    addr_of,
    port_to_be16,
)
from sparsegate_ebpf.programs import BpfUnavailable, LoadedProgram
from sparsegate_ebpf.testing import clear_policy, require_program, reset_maps, verdicts
from sparsegate_ebpf.testrun import run_xdp

pytestmark = pytest.mark.bpf

DOC = {"version": "v7", "defaultAction": "deny", "entries": [
    {"srcIP": "10.1.0.1", "dstIP": "10.1.0.2", "dstPort": 8080, "protocol": "tcp", "action": "allow", "rule": "a#0"},
    {"srcIP": "10.1.0.1", "dstIP": "10.1.0.2", "dstPort": 8081, "protocol": "udp", "action": "deny", "rule": "a#1"}]}


def ip_level_records(doc: dict, *, generation: int, policed: tuple[str, ...] = (),
                     allowed: tuple[str, ...] = ()) -> list[tuple[PolicyKey, PolicyVal]]:
    """The records a program from before identities held for ``doc``: a meta record, one per
    entry keyed by IPs (kind 0), and, from scoped programs, policed destinations and allowed sources."""
    actions = {"allow": ACTION_ALLOW, "deny": ACTION_DENY}
    out = [(PolicyKey(), PolicyVal(action=actions[doc["defaultAction"]], rule_id=0, generation=generation))]
    for i, e in enumerate(doc["entries"], start=1):
        out.append((PolicyKey(saddr=addr_of(e["srcIP"]), daddr=addr_of(e["dstIP"]),
                              dport=port_to_be16(e["dstPort"]), proto=PROTO_NUMBERS[e["protocol"]]),
                    PolicyVal(action=actions[e["action"]], rule_id=i, generation=generation)))
    out += [(PolicyKey(daddr=addr_of(ip), kind=KEY_POLICED_DST),
             PolicyVal(action=out[0][1].action, generation=generation)) for ip in policed]
    out += [(PolicyKey(saddr=addr_of(ip), kind=KEY_ALLOWED_SRC),
             PolicyVal(action=ACTION_ALLOW, generation=generation)) for ip in allowed]
    return out


def prog_id(prog: LoadedProgram) -> int:
    info = inherit._ProgInfo()
    inherit._info(inherit._lib(), prog.prog_fd, info)
    return info.id


def as_bytes(records) -> set[tuple[bytes, bytes]]:
    return {(bytes(k), bytes(v)) for k, v in records}


@pytest.fixture(scope="module")
def _second_enforcing() -> Iterator[LoadedProgram]:
    try:
        prog = require_program(enforce=True)
    except BpfUnavailable as exc:
        pytest.fail(f"XDP program unavailable: {exc} (set up with: sudo dev/setup/bpf.sh)", pytrace=False)
    yield prog
    prog.close()


@pytest.fixture
def successor(_second_enforcing: LoadedProgram) -> LoadedProgram:
    """A second enforcing program (the session one plays the predecessor), with empty maps."""
    reset_maps(_second_enforcing)
    clear_policy(_second_enforcing)
    return _second_enforcing


def test_reads_back_exactly_the_live_records(enforce_prog: LoadedProgram) -> None:
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    swapper.apply(parse_policy({**DOC, "entries": []}))
    swapper.apply(parse_policy(DOC))  # generation 2, in the B map: the live one is read, not the pool's first
    got = inherit.live_policy(prog_id(enforce_prog))
    assert got is not None
    expected = [(k, PolicyVal(action=v.action, rule_id=v.rule_id, generation=v.generation, slot=1,  # the B map
                              identity=v.identity))
                for k, v in compile_policy(parse_policy(DOC), generation=2)]
    assert as_bytes(got) == as_bytes(expected)


def test_a_program_without_policy_has_nothing_to_carry_over(enforce_prog: LoadedProgram) -> None:
    assert inherit.live_policy(prog_id(enforce_prog)) is None  # the fixture emptied the outer slot


def test_an_unknown_program_is_an_error() -> None:
    with pytest.raises(OSError):
        inherit.live_policy(2**31 - 1)


def test_carried_over_records_go_live_only_into_an_empty_swapper(enforce_prog: LoadedProgram,
                                                                 successor: LoadedProgram) -> None:
    PolicySwapper(bpf=enforce_prog.bpf).apply(parse_policy(DOC))
    records = inherit.live_policy(prog_id(enforce_prog))
    swapper = PolicySwapper(bpf=successor.bpf)
    result = swapper.apply_records_if_empty(records)
    # meta, 2 rules, 1 policed destination, 1 source address
    assert result is not None and result.generation == 1 and result.entries == 5
    assert swapper.rule_names[1] == {} and swapper.policy is None
    assert as_bytes(inherit.live_policy(prog_id(successor))) == as_bytes(records)
    # The successor judges with them, attributed to the predecessor's generation.
    frame = P.udp_frame(src="10.1.0.1", dst="10.1.0.2", sport=40000, dport=8081)
    assert run_xdp(prog_fd=successor.prog_fd, data=frame).verdict == "drop"
    frame = P.tcp_frame(src="10.1.0.1", dst="10.1.0.2", sport=40000, dport=8080, flags=P.TCP_SYN)
    assert run_xdp(prog_fd=successor.prog_fd, data=frame).verdict == "pass"
    assert verdicts(successor) == {(1, 2, ACTION_DENY): 1, (1, 1, ACTION_ALLOW): 1}
    assert swapper.apply_records_if_empty(records) is None  # something is live: never overwritten
    nxt = swapper.apply(parse_policy(DOC))
    assert nxt.generation == 2  # documents continue after the carried-over generation


def test_records_without_meta_are_refused(successor: LoadedProgram) -> None:
    records = compile_policy(parse_policy(DOC), generation=1)[1:]
    with pytest.raises(ValueError):
        PolicySwapper(bpf=successor.bpf).apply_records_if_empty(records)


def test_records_of_a_program_from_before_scoped_enforcement_keep_their_destinations_policed(
        successor: LoadedProgram) -> None:
    """Its map has entries and a meta record only (it judged every destination): the destinations
    its entries name stay policed, as for a document without policedDestinations."""
    old = ip_level_records(DOC, generation=4)
    result = PolicySwapper(bpf=successor.bpf).apply_records_if_empty(old)
    # read as identity records: meta, the 2 rules, 1 policed destination, 1 source address
    assert result is not None and result.entries == len(old) + 2
    frame = P.udp_frame(src="10.1.0.1", dst="10.1.0.2", sport=40000, dport=8081)
    assert run_xdp(prog_fd=successor.prog_fd, data=frame).verdict == "drop"


def test_records_of_a_program_from_before_identities_keep_what_they_allowed(successor: LoadedProgram) -> None:
    """IP-level entries, a policed destination no entry names and an always-allowed source: read as
    identity records, the successor passes and drops exactly what they did."""
    old = ip_level_records(DOC, generation=9, policed=("10.1.0.2", "10.1.0.5"), allowed=("10.1.0.9",))
    result = PolicySwapper(bpf=successor.bpf).apply_records_if_empty(old)
    assert result is not None and result.generation == 9
    syn = P.TCP_SYN
    cases = [(P.tcp_frame(src="10.1.0.1", dst="10.1.0.2", sport=40001, dport=8080, flags=syn), "pass"),  # allowed
             (P.udp_frame(src="10.1.0.1", dst="10.1.0.2", sport=40002, dport=8081), "drop"),  # denied
             (P.tcp_frame(src="10.1.0.3", dst="10.1.0.2", sport=40003, dport=8080, flags=syn), "drop"),  # default
             (P.tcp_frame(src="10.1.0.1", dst="10.1.0.5", sport=40004, dport=8080, flags=syn), "drop"),  # policed
             (P.tcp_frame(src="10.1.0.9", dst="10.1.0.5", sport=40005, dport=8080, flags=syn), "pass"),  # allowed src
             (P.tcp_frame(src="10.1.0.3", dst="10.1.0.7", sport=40006, dport=8080, flags=syn), "pass")]  # unpoliced
    assert [run_xdp(prog_fd=successor.prog_fd, data=f).verdict for f, _ in cases] == [v for _, v in cases]


# An IPv4-only predecessor: its inner policy map has 12-byte keys (one __u32 per address). A tiny
# program with that layout and the same map names plays it (the real one is not in this tree).
IPV4_ONLY_PREDECESSOR = b"""
#include "sparsegate_flow.h"
struct v4_policy_key { __u32 saddr; __u32 daddr; __u16 dport; __u8 proto; __u8 kind; };
BPF_HASH(policy_a, struct v4_policy_key, struct sg_policy_val, 64);
BPF_ARRAY_OF_MAPS(policy_outer, "policy_a", 1);
int xdp_v4_only(struct xdp_md *ctx)
{
    int zero = 0;
    return policy_outer.lookup(&zero) ? XDP_PASS : XDP_PASS;
}
"""


def test_records_of_an_ipv4_only_predecessor_are_widened_and_keep_what_they_allowed(
        successor: LoadedProgram) -> None:
    import ctypes as ct

    from bcc import BPF

    from sparsegate_ebpf.maps import IDENTITY_ALLOWED, KEY_RULE, KEY_SOURCE, PolicyKeyV4, ip_to_be32
    from sparsegate_ebpf.programs import cflags

    old = BPF(text=IPV4_ONLY_PREDECESSOR, cflags=cflags(enforce=True)[:1])
    try:
        fn = old.load_func(b"xdp_v4_only", BPF.XDP)
        inner = old[b"policy_a"]
        assert ct.sizeof(inner.Key) == ct.sizeof(PolicyKeyV4) == 12
        # Identity records as the IPv4-only identity program wrote them.
        rows = [(PolicyKeyV4(), PolicyVal(action=ACTION_DENY, generation=6)),
                (PolicyKeyV4(saddr=256, daddr=257, dport=port_to_be16(8080), proto=PROTO_NUMBERS["tcp"],
                             kind=KEY_RULE), PolicyVal(action=ACTION_ALLOW, rule_id=1, generation=6)),
                (PolicyKeyV4(daddr=ip_to_be32("10.1.0.2"), kind=KEY_POLICED_DST),
                 PolicyVal(action=ACTION_DENY, generation=6, identity=257)),
                (PolicyKeyV4(saddr=ip_to_be32("10.1.0.1"), kind=KEY_SOURCE), PolicyVal(generation=6, identity=256)),
                (PolicyKeyV4(saddr=ip_to_be32("10.1.0.9"), kind=KEY_SOURCE),
                 PolicyVal(action=ACTION_ALLOW, generation=6, identity=IDENTITY_ALLOWED))]
        for k, v in rows:
            inner[inner.Key.from_buffer_copy(bytes(k))] = inner.Leaf.from_buffer_copy(bytes(v))
        old[b"policy_outer"][ct.c_int(0)] = ct.c_int(inner.get_fd())
        info = inherit._ProgInfo()
        inherit._info(inherit._lib(), fn.fd, info)
        records = inherit.live_policy(info.id)
    finally:
        old.cleanup()
    assert records is not None and len(records) == len(rows)
    assert all(ct.sizeof(k) == ct.sizeof(PolicyKey) for k, _ in records)
    result = PolicySwapper(bpf=successor.bpf).apply_records_if_empty(records)
    assert result is not None and result.generation == 6
    syn = P.TCP_SYN
    cases = [(P.tcp_frame(src="10.1.0.1", dst="10.1.0.2", sport=40001, dport=8080, flags=syn), "pass"),  # rule
             (P.tcp_frame(src="10.1.0.1", dst="10.1.0.2", sport=40002, dport=8081, flags=syn), "drop"),  # default
             (P.tcp_frame(src="10.1.0.9", dst="10.1.0.2", sport=40003, dport=22, flags=syn), "pass"),  # allowed src
             (P.tcp_frame(src="10.1.0.3", dst="10.1.0.7", sport=40004, dport=8080, flags=syn), "pass")]  # unpoliced
    assert [run_xdp(prog_fd=successor.prog_fd, data=f).verdict for f, _ in cases] == [v for _, v in cases]


def _by_rule(swapper: PolicySwapper) -> dict[tuple[str, int], int]:
    return {key: packets for key, (packets, _) in swapper.verdict_totals_by_rule().items()}


def test_the_predecessors_document_arriving_late_names_the_carried_over_rules(
        enforce_prog: LoadedProgram, successor: LoadedProgram) -> None:
    """Carried over (no document in time), the rules' verdicts read gen<N>/rule<M>; when the
    document arrives and it is the one the predecessor enforced, those verdicts count under the
    rules' names: before, they stayed apart as gen1/rule<M> series while a#0 and a#1 started over
    at 0 (and went when the generation was folded, their packets with them)."""
    PolicySwapper(bpf=enforce_prog.bpf).apply(parse_policy(DOC))
    swapper = PolicySwapper(bpf=successor.bpf)
    assert swapper.apply_records_if_empty(inherit.live_policy(prog_id(enforce_prog))) is not None
    deny = P.udp_frame(src="10.1.0.1", dst="10.1.0.2", sport=40000, dport=8081)
    assert run_xdp(prog_fd=successor.prog_fd, data=deny, repeat=3).verdict == "drop"
    assert _by_rule(swapper)[("gen1/rule2", ACTION_DENY)] == 3  # nothing better is known yet
    swapper.apply(parse_policy(DOC), extra_sources=("10.9.9.9",))  # the node's own sources do not matter
    run_xdp(prog_fd=successor.prog_fd, data=deny, repeat=2)
    got = _by_rule(swapper)
    assert got[("a#1", ACTION_DENY)] == 5
    assert not [rule for rule, _ in got if rule.startswith("gen")]


def test_a_different_document_leaves_the_carried_over_rules_unnamed(
        enforce_prog: LoadedProgram, successor: LoadedProgram) -> None:
    """A newer document may number its rules otherwise: its names are not guessed onto the
    predecessor's rule ids."""
    PolicySwapper(bpf=enforce_prog.bpf).apply(parse_policy(DOC))
    swapper = PolicySwapper(bpf=successor.bpf)
    swapper.apply_records_if_empty(inherit.live_policy(prog_id(enforce_prog)))
    run_xdp(prog_fd=successor.prog_fd, data=P.udp_frame(src="10.1.0.1", dst="10.1.0.2", sport=40000, dport=8081))
    swapper.apply(parse_policy({**DOC, "version": "v8", "entries": DOC["entries"][::-1]}))
    got = _by_rule(swapper)
    assert got[("gen1/rule2", ACTION_DENY)] == 1 and got[("a#1", ACTION_DENY)] == 0
    swapper.apply(parse_policy(DOC))  # too late: only the first document after the carry-over names them
    assert ("gen1/rule2", ACTION_DENY) in _by_rule(swapper)
