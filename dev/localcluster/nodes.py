"""Fake nodes kwok manages: pure manifests.

Node i gets InternalIP 127.10.<i // 254>.<i % 254 + 1> and the i-th /24 of the cluster's pod CIDR
as its podCIDR (127.20.<i>.0/24 with the default 127.20.0.0/16; benches and tests pass other loopback
ranges), so pod IPs are loopback addresses a real process can bind.
"""

from __future__ import annotations

import dataclasses
import ipaddress

GPU_LABEL = "nvidia.com/gpu.present"
GPU_RESOURCE = "nvidia.com/gpu"
FAKE_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
NODE_NAME_PREFIX = "kwok-node-"


@dataclasses.dataclass(frozen=True)
class NodeShape:
    """How many fake nodes to register and what they offer."""

    count: int = 4
    gpu_count: int = 2  # the first ``gpu_count`` nodes carry GPUs
    gpus_per_node: int = 8
    cpu: str = "32"
    memory: str = "256Gi"
    max_pods: int = 110

    def __post_init__(self) -> None:
        if self.count < 0 or not 0 <= self.gpu_count <= self.count:
            raise ValueError(f"need 0 <= gpu_count ({self.gpu_count}) <= count ({self.count})")


def node_name(index: int) -> str:
    return f"{NODE_NAME_PREFIX}{index}"


def node_ip(index: int) -> str:
    if not 0 <= index < 254 * 256:
        raise ValueError(f"node index {index} out of range")
    return f"127.10.{index // 254}.{index % 254 + 1}"


def node_pod_cidr(index: int, *, pod_cidr: str) -> str:
    """The index-th /24 inside ``pod_cidr`` (a /16 gives room for 256 nodes)."""
    network = ipaddress.ip_network(pod_cidr)
    subnets = list(network.subnets(new_prefix=24)) if network.prefixlen <= 24 else []
    if index >= len(subnets):
        raise ValueError(f"pod CIDR {pod_cidr} has no /24 for node {index}")
    return str(subnets[index])


def node_manifest(index: int, *, shape: NodeShape, pod_cidr: str) -> dict:
    """A Node with its status filled in: kwok keeps given addresses and capacity as they are."""
    name = node_name(index)
    gpu = index < shape.gpu_count
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
    }
    capacity = {"cpu": shape.cpu, "memory": shape.memory, "pods": str(shape.max_pods)}
    if gpu:
        labels[GPU_LABEL] = "true"
        capacity[GPU_RESOURCE] = str(shape.gpus_per_node)
    cidr = node_pod_cidr(index, pod_cidr=pod_cidr)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {FAKE_NODE_ANNOTATION[0]: FAKE_NODE_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {
            "addresses": [{"type": "InternalIP", "address": node_ip(index)}, {"type": "Hostname", "address": name}],
            "capacity": capacity,
            "allocatable": dict(capacity),
        },
    }


def node_list(*, shape: NodeShape, pod_cidr: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "List",
        "items": [node_manifest(i, shape=shape, pod_cidr=pod_cidr) for i in range(shape.count)],
    }
