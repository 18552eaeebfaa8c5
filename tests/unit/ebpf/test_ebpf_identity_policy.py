"""Identity-form flow policies: the contract's validation, the agent's records and the XDP program's
verdicts on synthetic frames (BPF_PROG_TEST_RUN).

Rules are keyed by (source identity, destination identity, port, protocol); an address's identity
comes from its own record (the ipcache), so one rule covers every pod of a class.
"""
from __future__ import annotations

import json

import pytest

from sparsegate_contracts import flowpolicy
from sparsegate_ebpf import packets as P
from sparsegate_ebpf.maps import ACTION_DENY, IDENTITY_ALLOWED, KEY_POLICED_DST, KEY_RULE, KEY_SOURCE, ip_of
from sparsegate_ebpf.policy import PolicyError, compile_policy, parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testing import verdicts
from sparsegate_ebpf.testrun import run_xdp

WEB, MODEL, BATCH = 300, 400, 500
WEB_IPS, MODEL_IPS, BATCH_IPS = ["10.4.1.1", "10.4.1.2"], ["10.4.0.1", "10.4.0.2"], ["10.4.2.1"]
STRANGER, OPERATOR = "10.4.9.9", "10.4.0.100"


def rule(src: int, dst: int, port: int = 8080, protocol: str = "tcp", action: str = "allow", name: str = "m/p#0") -> dict:
    return {"srcIdentity": src, "dstIdentity": dst, "dstPort": port, "protocol": protocol, "action": action,
            "rule": name}


def document(rules: list[dict] | None = None) -> dict:
    return flowpolicy.build_document(
        identities=[{"identity": WEB, "ips": WEB_IPS}, {"identity": MODEL, "ips": MODEL_IPS},
                    {"identity": BATCH, "ips": BATCH_IPS}],
        rules=[rule(WEB, MODEL), rule(BATCH, MODEL, action="deny", name="m/deny#0")] if rules is None else rules,
        policed_destinations=MODEL_IPS, allowed_sources=[OPERATOR])


@pytest.mark.parametrize(("doc", "message"), [
    ({"identities": [{"identity": 3, "ips": []}], "rules": []}, "identities[0].identity: must be an integer 256..65535"),
    ({"identities": [{"identity": 70000, "ips": []}], "rules": []}, "identities[0].identity"),
    ({"identities": [{"identity": 300, "ips": []}, {"identity": 300, "ips": []}]}, "identities[1].identity: 300 appears twice"),
    ({"identities": [{"identity": 300, "ips": ["10.0.0.1"]}, {"identity": 301, "ips": ["10.0.0.1"]}]},
     "identities[1].ips[0]: 10.0.0.1 already has identity 300"),
    ({"identities": [{"identity": 300, "ips": ["fd00::g"]}]}, "identities[0].ips[0]: not an IPv4 or IPv6 address"),
    ({"identities": [{"identity": 300, "ips": "10.0.0.1"}]}, "identities[0].ips must be a list"),
    ({"identities": [{"identity": 300, "ips": []}], "rules": [rule(300, 301)]},
     "rules[0].dstIdentity: 301 is not an identity of the document"),
    ({"identities": [{"identity": 300, "ips": []}], "rules": [rule(300, 300, port=0)]}, "rules[0].dstPort"),
    ({"identities": [{"identity": 300, "ips": []}], "rules": [rule(300, 300, action="log")]}, "rules[0].action"),
    ({"rules": [], "entries": [{"srcIP": "10.0.0.1", "dstIP": "10.0.0.2", "dstPort": 80, "action": "allow"}]},
     "one form, not both"),
])
def test_invalid_identity_documents_are_rejected_naming_the_field(doc: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_policy(json.dumps(doc))


def test_records_are_one_per_rule_address_and_destination() -> None:
    policy = parse_policy(document())
    assert policy.rule_names() == {0: "default:deny", 1: "m/p#0", 2: "m/deny#0"}
    records = compile_policy(policy, generation=5, extra_sources=("10.4.0.254",))
    rules = {(k.saddr[0], k.daddr[0]): v for k, v in records if k.kind == KEY_RULE}
    assert set(rules) == {(WEB, MODEL), (BATCH, MODEL)} and rules[(BATCH, MODEL)].action == ACTION_DENY
    sources = {ip_of(k.saddr): v.identity for k, v in records if k.kind == KEY_SOURCE}
    assert sources == {**dict.fromkeys(WEB_IPS, WEB), **dict.fromkeys(BATCH_IPS, BATCH),
                       OPERATOR: IDENTITY_ALLOWED, "10.4.0.254": IDENTITY_ALLOWED}
    dests = {ip_of(k.daddr): v.identity for k, v in records if k.kind == KEY_POLICED_DST}
    assert dests == dict.fromkeys(MODEL_IPS, MODEL)
    # What the operator counts before publishing is what the agent writes (plus meta and node addresses).
    assert flowpolicy.map_records(document()) + 1 + 1 == len(records)


@pytest.mark.bpf
def test_the_program_judges_by_identity(enforce_prog: LoadedProgram) -> None:
    PolicySwapper(bpf=enforce_prog.bpf).apply(parse_policy(document()))

    def verdict(src: str, dst: str, dport: int = 8080, sport: int = 41000) -> str:
        frame = P.tcp_frame(src=src, dst=dst, sport=sport, dport=dport, flags=P.TCP_SYN)
        return run_xdp(prog_fd=enforce_prog.prog_fd, data=frame).verdict

    # Every pod of the web class reaches every pod of the model class through the one rule.
    assert [verdict(s, d) for s in WEB_IPS for d in MODEL_IPS] == ["pass"] * 4
    assert verdict(WEB_IPS[0], MODEL_IPS[0], dport=8081) == "drop"  # no rule for the port
    assert verdict(BATCH_IPS[0], MODEL_IPS[1]) == "drop"  # a deny rule
    assert verdict(STRANGER, MODEL_IPS[0]) == "drop"  # no identity: the default
    assert verdict(OPERATOR, MODEL_IPS[0], dport=9443) == "pass"  # always allowed
    assert verdict(STRANGER, WEB_IPS[0]) == "pass"  # not policed
    got = verdicts(enforce_prog)
    assert got[(1, 1, 1)] == 4 and got[(1, 2, ACTION_DENY)] == 1 and got[(1, 0, ACTION_DENY)] == 2


@pytest.mark.bpf
def test_verdicts_of_many_swaps_keep_their_totals_in_a_bounded_table(enforce_prog: LoadedProgram) -> None:
    """Every swap retires a slot's counters; generations before the last retired one leave the
    `verdicts` hash for totals by rule name, so the hash holds one generation (it grew by one a swap
    until updates failed, E2BIG) and a rule's exported total only grows."""
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    seen = []
    for n in range(6):
        swapper.apply(parse_policy(document()))
        frame = P.tcp_frame(src=WEB_IPS[0], dst=MODEL_IPS[0], sport=42000 + n, dport=8080, flags=P.TCP_SYN)
        assert run_xdp(prog_fd=enforce_prog.prog_fd, data=frame).verdict == "pass"
        seen.append(swapper.verdict_totals_by_rule()[("m/p#0", 1)][0])
    assert seen == [1, 2, 3, 4, 5, 6]
    generations = {key.generation for key, _ in enforce_prog.bpf[b"verdicts"].items()}
    # The live generation and the one before are in the two pool slots; the one before them, the
    # last retired, is the only one left in the hash.
    assert generations == {swapper.generation - 2}
    assert not any(name.startswith("gen") for name, _ in swapper.verdict_totals_by_rule())


@pytest.mark.bpf
def test_reusing_a_pool_map_empties_it_without_restarting_the_walk(
        enforce_prog: LoadedProgram, monkeypatch: pytest.MonkeyPatch) -> None:
    """The third swap refills the pool map of the first. bcc's clear() deletes each key as it walks
    it, and the kernel continues a walk from a key that is gone at the first bucket: every delete
    rescanned the buckets already emptied (115 s for 101,800 records in a 1,048,576-record map, with
    the swapper's lock held and every scrape waiting for it). No step of the walk may start over."""
    doc = document()
    doc["identities"][0]["ips"] = [f"10.5.{i // 250}.{i % 250 + 1}" for i in range(500)]
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    swapper.apply(parse_policy(doc))
    swapper.apply(parse_policy(doc))
    pool_a = enforce_prog.bpf[b"policy_a"]
    cls = type(pool_a)
    walk, lookup = cls.next, cls.__getitem__
    restarts = 0

    def next_key(self, key):  # noqa: ANN001, ANN202 (bcc's own signature)
        nonlocal restarts
        if self is pool_a and key is not None:
            try:
                lookup(self, key)
            except KeyError:  # gone: the kernel answers with the first key of the map
                restarts += 1
        return walk(self, key)

    monkeypatch.setattr(cls, "next", next_key)
    swapper.apply(parse_policy(doc))
    monkeypatch.undo()
    assert swapper.slots[0].generation == 3
    assert restarts == 0
    frame = P.tcp_frame(src="10.5.1.100", dst=MODEL_IPS[0], sport=42000, dport=8080, flags=P.TCP_SYN)
    assert run_xdp(prog_fd=enforce_prog.prog_fd, data=frame).verdict == "pass"


@pytest.mark.bpf
def test_a_class_without_a_rule_to_a_destination_class_is_denied_by_default(enforce_prog: LoadedProgram) -> None:
    # web may reach batch (not policed here: no rule names it as a destination, none listed)
    doc = flowpolicy.build_document(identities=[{"identity": WEB, "ips": WEB_IPS}, {"identity": MODEL, "ips": MODEL_IPS}],
                                    rules=[rule(MODEL, WEB)])
    PolicySwapper(bpf=enforce_prog.bpf).apply(parse_policy(doc))
    syn = P.TCP_SYN
    assert run_xdp(prog_fd=enforce_prog.prog_fd,
                   data=P.tcp_frame(src=MODEL_IPS[0], dst=WEB_IPS[1], sport=41000, dport=8080, flags=syn)).verdict == "pass"
    assert run_xdp(prog_fd=enforce_prog.prog_fd,
                   data=P.tcp_frame(src=WEB_IPS[0], dst=WEB_IPS[1], sport=41001, dport=8080, flags=syn)).verdict == "drop"


def test_addresses_beyond_the_rule_range_fit_the_map() -> None:
    """The map holds 65,536 records: 20,000 callers of one class is one rule and 20,000 addresses."""
    callers = [f"10.{20 + i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(20_000)]
    doc = flowpolicy.build_document(identities=[{"identity": WEB, "ips": callers}, {"identity": MODEL, "ips": MODEL_IPS}],
                                    rules=[rule(WEB, MODEL)])
    records = compile_policy(parse_policy(doc), generation=1)
    assert len(records) == 1 + 1 + 2 + 20_000  # meta, rule, destinations, addresses


def test_more_rules_than_verdict_counters_are_refused() -> None:
    doc = flowpolicy.build_document(identities=[{"identity": WEB, "ips": WEB_IPS}, {"identity": MODEL, "ips": MODEL_IPS}],
                                    rules=[rule(WEB, MODEL, port=1 + i % 60000, name=f"m/p#{i}") for i in range(16_384)])
    with pytest.raises(PolicyError, match="16384 rules exceed the 16383 rules the agent counts verdicts for"):
        parse_policy(doc)


@pytest.mark.bpf
def test_verdict_series_of_deleted_rules_do_not_outlive_the_policies(enforce_prog: LoadedProgram) -> None:
    """Every rule is named after its RoutingPolicy (``ns/name#id``): a rule's folded total is kept
    while a generation in the maps still names it, then dropped with its series. Kept for good,
    each RoutingPolicy ever created (one per tenant, per rollout) stayed a
    ``sparsegate_xdp_policy_verdicts`` series of every agent for the agent's life."""
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    for n in range(20):
        name = f"m/policy-{n}#0"  # a RoutingPolicy created, then replaced by the next one
        swapper.apply(parse_policy(document([rule(WEB, MODEL, name=name)])))
        frame = P.tcp_frame(src=WEB_IPS[0], dst=MODEL_IPS[0], sport=43000 + n, dport=8080, flags=P.TCP_SYN)
        assert run_xdp(prog_fd=enforce_prog.prog_fd, data=frame).verdict == "pass"
        assert swapper.verdict_totals_by_rule()[(name, 1)][0] == 1
    names = {name for name, _ in swapper.verdict_totals_by_rule()}
    # The rules of the generations still in the maps (live, previous, last retired), nothing older.
    assert names <= {"default:deny", "m/policy-17#0", "m/policy-18#0", "m/policy-19#0"}, sorted(names)
    # A rule that lives on keeps its total across every swap.
    for n in range(5):
        swapper.apply(parse_policy(document()))
        frame = P.tcp_frame(src=WEB_IPS[0], dst=MODEL_IPS[0], sport=44000 + n, dport=8080, flags=P.TCP_SYN)
        assert run_xdp(prog_fd=enforce_prog.prog_fd, data=frame).verdict == "pass"
    assert swapper.verdict_totals_by_rule()[("m/p#0", 1)][0] == 5


@pytest.mark.bpf
def test_every_live_rule_has_a_verdict_series_at_zero_before_its_first_packet(enforce_prog: LoadedProgram) -> None:
    """rate() counts a series from its first sample: a rule's series born with its first packets
    (a deny rule's one burst) lost them on the dashboard's "XDP verdicts by rule" panel."""
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    swapper.apply(parse_policy(document()))
    totals = swapper.verdict_totals_by_rule()
    assert totals[("m/p#0", 1)] == (0, 0) and totals[("m/deny#0", ACTION_DENY)] == (0, 0)
    assert totals[("default:deny", ACTION_DENY)] == (0, 0)
    frame = P.tcp_frame(src=BATCH_IPS[0], dst=MODEL_IPS[0], sport=45000, dport=8080, flags=P.TCP_SYN)
    assert run_xdp(prog_fd=enforce_prog.prog_fd, data=frame).verdict == "drop"
    assert swapper.verdict_totals_by_rule()[("m/deny#0", ACTION_DENY)][0] == 1
