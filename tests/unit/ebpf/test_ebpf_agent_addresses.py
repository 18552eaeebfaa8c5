"""The node's own always-allowed sources (--node-addresses auto, --allow-sources): both families."""
from __future__ import annotations

import pytest

from sparsegate_ebpf import agent


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
