"""Fake node manifests and loopback port picking."""

import ipaddress
import socket

import pytest

from localcluster import nodes
from localcluster.ports import candidate_ports, ephemeral_range, is_port_free, pick_free_ports


def test_default_shape_has_two_gpu_nodes_of_four() -> None:
    items = nodes.node_list(shape=nodes.NodeShape(), pod_cidr="127.20.0.0/16")["items"]
    assert [n["metadata"]["name"] for n in items] == ["kwok-node-0", "kwok-node-1", "kwok-node-2", "kwok-node-3"]
    gpu = [n for n in items if n["metadata"]["labels"].get(nodes.GPU_LABEL) == "true"]
    assert len(gpu) == 2
    assert all(n["status"]["capacity"][nodes.GPU_RESOURCE] == "8" for n in gpu)
    assert all(nodes.GPU_RESOURCE not in n["status"]["capacity"] for n in items if n not in gpu)
    assert all(n["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake" for n in items)


def test_node_addresses_and_pod_cidrs_stay_in_loopback_ranges() -> None:
    shape = nodes.NodeShape(count=256, gpu_count=0)
    items = nodes.node_list(shape=shape, pod_cidr="127.20.0.0/16")["items"]
    ips = [n["status"]["addresses"][0]["address"] for n in items]
    cidrs = [n["spec"]["podCIDR"] for n in items]
    assert ips[0] == "127.10.0.1" and len(set(ips)) == 256
    assert all(ipaddress.ip_address(ip) in ipaddress.ip_network("127.10.0.0/16") for ip in ips)
    assert cidrs[0] == "127.20.0.0/24" and cidrs[255] == "127.20.255.0/24" and len(set(cidrs)) == 256
    with pytest.raises(ValueError):
        nodes.node_pod_cidr(256, pod_cidr="127.20.0.0/16")


def test_shape_rejects_more_gpu_nodes_than_nodes() -> None:
    with pytest.raises(ValueError):
        nodes.NodeShape(count=1, gpu_count=2)


def test_picked_ports_are_distinct_bindable_and_never_ephemeral() -> None:
    ports = pick_free_ports(["a", "b", "c", "d", "e", "f"])
    assert len(set(ports.values())) == 6
    assert all(is_port_free(p) for p in ports.values())
    low, high = ephemeral_range()
    assert not any(low <= p <= high for p in ports.values())


def test_candidates_sit_below_the_ephemeral_range_or_above_a_low_one() -> None:
    assert candidate_ports(ephemeral=(32768, 60999)) == range(10000, 32768)
    assert candidate_ports(ephemeral=(1024, 50000)) == range(50001, 65536)
    with pytest.raises(RuntimeError):
        candidate_ports(ephemeral=(1024, 65000))


def test_a_taken_candidate_is_skipped() -> None:
    import random
    first = pick_free_ports(["x"], rng=random.Random(7))["x"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", first))
        s.listen()
        again = pick_free_ports(["x"], rng=random.Random(7))["x"]
    assert again != first


def test_is_port_free_sees_a_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not is_port_free(s.getsockname()[1])
