"""A veth pair with one end in the host network namespace, where a node agent attaches XDP.

Shared by the install e2e tests that run a node agent (the chart's DaemonSet, the dashboard test's
agent process): each makes its own pair with its own name prefix and subnet.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sparsegate_ebpf.xdp import attached_program

PY = sys.executable


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@dataclass(frozen=True)
class HostVeth:
    """``host_if`` in the host network namespace (XDP goes here), ``peer_if`` in namespace ``ns``.

    Packets go from the peer to ``dst_ip``, an address of the peer's subnet that nobody has,
    through a neighbour entry with a made-up MAC: the host end has no IPv4 address, IPv6 and
    forwarding are off on it, and the kernel drops frames addressed to another MAC after XDP has
    seen them, so nothing reaches the host's stack or leaves the veth.
    """

    ns: str
    host_if: str
    peer_if: str
    src_ip: str  # the peer's address
    dst_ip: str  # an address of the peer's subnet that nobody has: reached through a fake MAC
    dst_mac: str

    @classmethod
    @contextlib.contextmanager
    def create(cls, *, prefix: str, net: int, dst_mac: str) -> Iterator[HostVeth]:
        """A new pair named ``<prefix>-<tag>`` / ``<prefix>h<tag>`` / ``<prefix>p<tag>`` in 10.<net>.x.0/24."""
        tag = secrets.token_hex(3)
        subnet = int(tag[:2], 16)
        veth = cls(ns=f"{prefix}-{tag}", host_if=f"{prefix}h{tag}", peer_if=f"{prefix}p{tag}",
                   src_ip=f"10.{net}.{subnet}.1", dst_ip=f"10.{net}.{subnet}.2", dst_mac=dst_mac)
        try:
            _ip("netns", "add", veth.ns)
            _ip("link", "add", veth.host_if, "type", "veth", "peer", "name", veth.peer_if, "netns", veth.ns)
            # The host end is a sink: no IPv4 address, no IPv6, never forwards what arrives on it.
            Path(f"/proc/sys/net/ipv6/conf/{veth.host_if}/disable_ipv6").write_text("1")
            Path(f"/proc/sys/net/ipv4/conf/{veth.host_if}/forwarding").write_text("0")
            _ip("link", "set", veth.host_if, "up")
            _ip("-n", veth.ns, "addr", "add", f"{veth.src_ip}/24", "dev", veth.peer_if)
            _ip("-n", veth.ns, "link", "set", veth.peer_if, "up")
            _ip("-n", veth.ns, "link", "set", "lo", "up")
            _ip("-n", veth.ns, "neigh", "replace", veth.dst_ip, "lladdr", veth.dst_mac, "dev", veth.peer_if,
                "nud", "permanent")
            yield veth
        finally:
            # Deleting the namespace deletes the pair (and any XDP program on either end) with it.
            subprocess.run(["ip", "netns", "del", veth.ns], capture_output=True, timeout=20, check=False)
            subprocess.run(["ip", "link", "del", veth.host_if], capture_output=True, timeout=20, check=False)

    def send_udp(self, port: int, count: int) -> int:
        """``count`` datagrams from the peer namespace over the veth; returns how many were sent."""
        out = subprocess.run(["ip", "netns", "exec", self.ns, PY, "-m", "sparsegate_ebpf.netapps", "udp-send",
                              "--dst", self.dst_ip, "--port", str(port), "--count", str(count)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return int(out)

    def xdp(self) -> dict | None:
        """What the kernel has attached to the host end, as iproute2 reports it."""
        return attached_program(self.host_if)
