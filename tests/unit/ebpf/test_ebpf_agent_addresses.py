"""The node's own always-allowed sources (--node-addresses auto, --allow-sources): both families."""
from __future__ import annotations

import ipaddress
import logging

import pytest
from sparsegate_contracts import flowpolicy

from sparsegate_ebpf import agent
from sparsegate_ebpf.policy import PolicyError, compile_policy, parse_policy


def test_node_addresses_take_both_families_but_not_ipv6_link_local() -> None:
    links = [{"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1"}, {"family": "inet6", "local": "::1"}]},
             {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "192.0.2.10"},
                                              {"family": "inet6", "local": "FD00:1::10"},
                                              {"family": "inet6", "local": "fe80::1"}]},
             {"ifname": "veth1", "addr_info": [{"family": "inet6", "local": "fe80::2%veth1"}]},
             {"ifname": "down"}]
    assert agent.node_addresses(links) == ["127.0.0.1", "192.0.2.10", "::1", "fd00:1::10"]


def test_allow_sources_take_ipv6_and_name_the_flag_for_bad_ones(capsys: pytest.CaptureFixture[str]) -> None:
    args = agent.parse_args(["--interfaces", "eth0", "--policy-file", "/dev/null",
                             "--allow-sources", "10.0.0.1, FD00::1"])
    assert args.allow_sources == ["10.0.0.1", "fd00::1"]
    with pytest.raises(SystemExit):
        agent.parse_args(["--interfaces", "eth0", "--policy-file", "/dev/null", "--allow-sources", "fd00::zz"])
    assert "--allow-sources: not an IPv4 or IPv6 address: 'fd00::zz'" in capsys.readouterr().err


def test_node_addresses_leave_out_the_service_cluster_ips_of_kube_ipvs0() -> None:
    """kube-proxy in IPVS mode puts every ClusterIP on kube-ipvs0 (thousands of addresses, none ever
    a packet's source): they would crowd out the records reserved for the node's own addresses."""
    cluster_ips = [{"family": "inet", "local": f"10.96.{i // 250}.{i % 250 + 1}"} for i in range(1000)]
    links = [{"ifname": "eth0", "addr_info": [{"family": "inet", "local": "192.0.2.10"}]},
             {"ifname": "kube-ipvs0", "addr_info": cluster_ips + [{"family": "inet6", "local": "fd00:96::1"}]}]
    assert agent.node_addresses(links) == ["192.0.2.10"]


def addresses(n: int) -> list[str]:
    return [str(ipaddress.ip_address("192.0.2.0") + i) for i in range(n)]


def test_the_node_sources_reserve_is_the_operators_less_the_meta_record() -> None:
    """A document at the operator's capacity (map records less AGENT_RESERVED_RECORDS) still fits
    the agent's map with NODE_SOURCES_RESERVED node sources, and not with one more."""
    records = flowpolicy.MAP_MIN_ENTRIES
    doc = {"version": "v", "defaultAction": "deny", "entries": [],
           "allowedSources": [str(ipaddress.ip_address("10.1.0.0") + i)
                              for i in range(records - flowpolicy.AGENT_RESERVED_RECORDS)]}
    assert flowpolicy.map_records(doc) == records - flowpolicy.AGENT_RESERVED_RECORDS
    policy = parse_policy(doc, max_records=records)
    node = addresses(agent.NODE_SOURCES_RESERVED + 1)
    assert len(compile_policy(policy, generation=1, extra_sources=tuple(node[:-1]), max_records=records)) == records
    with pytest.raises(PolicyError, match="exceed the map capacity"):
        compile_policy(policy, generation=1, extra_sources=tuple(node), max_records=records)


def test_node_sources_over_the_reserve_warn_once_naming_count_and_limit_and_are_all_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparsegate_ebpf.agent")
    read = addresses(agent.NODE_SOURCES_RESERVED)
    sources = agent.NodeSources(allow_sources=["10.0.0.7"], auto=True, read=lambda: list(read))
    assert sources() == sorted(["10.0.0.7", *read])  # 64 sources: over the 63 reserved, none dropped
    assert sources() == sorted(["10.0.0.7", *read])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"{agent.NODE_SOURCES_RESERVED + 1} always-allowed node sources" in warnings[0]
    assert f"exceed the {flowpolicy.AGENT_RESERVED_RECORDS - 1} records" in warnings[0]


def test_node_sources_within_the_reserve_do_not_warn_and_none_reads_no_address(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sparsegate_ebpf.agent")
    sources = agent.NodeSources(allow_sources=["10.0.0.7"], auto=True, read=lambda: addresses(62))
    assert len(sources()) == agent.NODE_SOURCES_RESERVED and not caplog.records

    def unread() -> list[str]:
        raise AssertionError("--node-addresses none reads no address")

    assert agent.NodeSources(allow_sources=["10.0.0.7"], auto=False, read=unread)() == ["10.0.0.7"]
