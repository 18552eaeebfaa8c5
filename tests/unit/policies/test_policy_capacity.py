"""Flow allow-list capacity (sparsegate.domain.policy_capacity) and its RoutingPolicy condition."""

from __future__ import annotations

import pytest

from sparsegate.domain.policy_capacity import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_RECORDS,
    MAP_RECORDS_ENV,
    MAX_BYTES_ENV,
    MAX_RECORDS_ENV,
    Capacity,
    Footprint,
    check,
)
from sparsegate.domain.policy_status import SyncOutcome, status_patch
from sparsegate_contracts import flowpolicy, flowpolicy_shards
from sparsegate_ebpf.policy import compile_policy, parse_policy


def _document(n_sources: int, n_dests: int = 2) -> dict:
    entries = [flowpolicy.entry(src_ip=f"10.1.{i // 250}.{i % 250 + 1}", dst_ip=f"10.2.0.{d + 1}", dst_port=8080,
                                protocol="tcp", action="allow", rule="models/allow#0")
               for i in range(n_sources) for d in range(n_dests)]
    return flowpolicy.build_document(entries=entries, policed_destinations=[f"10.2.0.{d + 1}" for d in range(n_dests)],
                                     allowed_sources=["10.9.0.1"])


def test_records_counted_as_the_agent_writes_them() -> None:
    doc = _document(30, 3)
    needed, too_large = check(doc, Capacity())
    assert too_large is None
    # The agent writes exactly these records, plus its meta record (no node addresses here).
    assert needed.records + 1 == len(compile_policy(parse_policy(doc), generation=1))
    assert needed.bytes == len(flowpolicy.document_text(doc).encode())


def test_duplicate_tuples_count_once() -> None:
    doc = _document(1, 1)
    twice = flowpolicy.build_document(entries=doc["entries"] * 2, policed_destinations=["10.2.0.1"])
    assert flowpolicy.map_records(twice) == 3  # one entry tuple + one policed destination + its source


def test_too_many_records_reported_with_numbers() -> None:
    doc = _document(10, 2)  # 20 entries + 2 destinations + 10 sources + 1 allowed source
    needed, too_large = check(doc, Capacity(max_records=32))
    assert needed.records == 33 and too_large is not None
    assert "needs 33 policy map records, capacity 32" in too_large.message
    assert "bytes" not in too_large.message.split(";")[0]
    assert check(doc, Capacity(max_records=33))[1] is None


def test_bytes_beyond_one_configmap_are_sharded_not_refused() -> None:
    doc = _document(150, 2)
    size = len(flowpolicy.document_text(doc).encode())
    assert size > 4096
    needed, too_large = check(doc, Capacity(max_bytes=4096))
    assert too_large is None and 1 < needed.shards <= flowpolicy_shards.MAX_SHARDS
    assert check(doc, Capacity(max_bytes=size)) == (Footprint.of(doc, max_bytes=size), None)
    assert Footprint.of(doc, max_bytes=size).shards == 0  # fits one ConfigMap: the single layout


def test_too_many_shards_reported_with_numbers() -> None:
    doc = _document(300, 2)
    needed, too_large = check(doc, Capacity(max_bytes=4096, max_shards=2))
    assert too_large is not None and needed.shards > 2
    assert (f"needs {needed.shards} ConfigMaps of 4096 bytes ({needed.bytes} bytes), capacity 2"
            in too_large.message)


def test_defaults_are_the_real_limits_less_headroom() -> None:
    assert DEFAULT_MAX_RECORDS == flowpolicy.MAP_MAX_ENTRIES - flowpolicy.AGENT_RESERVED_RECORDS
    assert DEFAULT_MAX_BYTES < flowpolicy.CONFIGMAP_MAX_BYTES == 1024 * 1024
    assert Capacity.from_env({}) == Capacity()
    assert Capacity.from_env({MAX_RECORDS_ENV: "40", MAX_BYTES_ENV: ""}) == Capacity(max_records=40)


@pytest.mark.parametrize(("env", "text"), [
    ({MAX_RECORDS_ENV: "lots"}, f"{MAX_RECORDS_ENV}: must be an integer"),
    ({MAX_RECORDS_ENV: "0"}, f"{MAX_RECORDS_ENV}: must be in 1..{DEFAULT_MAX_RECORDS}"),
    ({MAX_BYTES_ENV: str(2 * 1024 * 1024)}, f"{MAX_BYTES_ENV}: must be in 4096..{DEFAULT_MAX_BYTES}"),
    ({MAX_BYTES_ENV: "100"}, f"{MAX_BYTES_ENV}: must be in 4096..{DEFAULT_MAX_BYTES}"),
    ({MAP_RECORDS_ENV: "100"}, f"{MAP_RECORDS_ENV}: must be in 1024..1048576, got 100"),
    ({MAP_RECORDS_ENV: str(2**21)}, f"{MAP_RECORDS_ENV}: must be in 1024..1048576"),
    ({MAP_RECORDS_ENV: "2048", MAX_RECORDS_ENV: "5000"}, f"{MAX_RECORDS_ENV}: must be in 1..1984"),
])
def test_bad_limits_name_the_variable(env: dict, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        Capacity.from_env(env)


def test_the_agents_map_size_sets_the_ceiling_and_the_test_limit_only_lowers_it() -> None:
    """agent.policyMapRecords reaches the operator as SPARSEGATE_FLOW_POLICY_MAP_RECORDS: records
    available = the agents' map less their reserve, above the default as well as below it."""
    big = Capacity.from_env({MAP_RECORDS_ENV: "262144"})
    assert big.max_records == 262144 - flowpolicy.AGENT_RESERVED_RECORDS
    assert Capacity.from_env({MAP_RECORDS_ENV: "262144", MAX_RECORDS_ENV: "70000"}).max_records == 70000
    sources = [f"10.{1 + i // 65536}.{i // 256 % 256}.{i % 256}" for i in range(70_000)]
    document = flowpolicy.build_document(  # one rule from 70,000 callers: over the default map, inside the big one
        rules=[flowpolicy.identity_rule_json(256, 257, 8080, "tcp", "allow", "models/allow#0")],
        identities=[{"identity": 256, "ips": sources}, {"identity": 257, "ips": ["10.200.0.1"]}])
    assert check(document, Capacity())[1] is not None
    assert check(document, big)[1] is None
    assert "agent.policyMapRecords" in check(document, Capacity())[1].message


def test_the_map_capacity_is_one_contract_constant() -> None:
    from sparsegate_ebpf import maps
    assert maps.POLICY_MAX_RECORDS == flowpolicy.MAP_MAX_ENTRIES
    assert maps.POLICY_MAX_ENTRIES == flowpolicy.MAX_RULES + 1  # rule ids 1..MAX_RULES, 0 the default


def _conditions(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


def test_too_large_is_stalled_not_ready_and_keeps_counts() -> None:
    ok = status_patch(outcome=SyncOutcome(generation=2, loaded_generation=2, decision_count=7, revision="r"),
                      previous=None, now="T1")
    msg = "flow allow-list too large: needs 23 policy map records, capacity 22; not published"
    st = status_patch(outcome=SyncOutcome(generation=2, loaded_generation=2, decision_count=7, revision="r",
                                          too_large=msg), previous=ok, now="T2")
    c = _conditions(st)
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "PolicyTooLarge"
    assert "needs 23" in c["Ready"]["message"] and c["Ready"]["lastTransitionTime"] == "T2"
    assert c["Stalled"]["status"] == "True" and c["Stalled"]["reason"] == "PolicyTooLarge"
    assert c["Degraded"]["status"] == "True" and c["Reconciling"]["status"] == "False"
    assert st["loadedInOPA"] is True  # OPA holds it; only publishing was held back
    back = status_patch(outcome=SyncOutcome(generation=2, loaded_generation=2, decision_count=3, revision="r"),
                        previous={**ok, **st}, now="T3")
    c = _conditions(back)
    assert c["Ready"]["status"] == "True" and c["Stalled"]["status"] == "False"


def test_opa_errors_take_precedence_over_too_large() -> None:
    st = status_patch(outcome=SyncOutcome(generation=1, loaded_generation=None, decision_count=None, revision=None,
                                          error="connection refused", too_large="too large"), previous=None, now="T")
    c = _conditions(st)
    assert c["Ready"]["reason"] == "OPAUnreachable" and c["Stalled"]["status"] == "False"


def test_more_rules_or_identities_than_the_agent_tells_apart_are_refused() -> None:
    idents = [{"identity": 256 + i, "ips": [f"10.5.{i // 250}.{i % 250 + 1}"]} for i in range(4)]
    rules = [{"srcIdentity": 256 + i % 4, "dstIdentity": 256, "dstPort": 1000 + i, "protocol": "tcp",
              "action": "allow", "rule": "m/p#0"} for i in range(5)]
    doc = flowpolicy.build_document(identities=idents, rules=rules)
    _, too_large = check(doc, Capacity(max_rules=4, max_identities=3))
    assert too_large is not None
    assert "needs 5 rules, capacity 4" in too_large.message and "needs 4 identities, capacity 3" in too_large.message
    assert check(doc, Capacity())[1] is None
