"""IPv6 through the XDP program on a real veth pair: two fresh network namespaces with ULA addresses
(fd00::/8, `nodad`) besides the lab's IPv4 ones, the enforcing program attached natively to the
server end, a dual-stack identity policy. Allowed IPv6 flows pass and are counted with their
addresses (maps and /metrics labels), denied ones are dropped, IPv4 on the same pair is judged as
before. Counts are checked against what the sender sent and the receiver got."""
from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from sparsegate_ebpf import xdp
from sparsegate_ebpf.maps import ACTION_ALLOW, ACTION_DENY, Counter, addr_bytes, port_to_be16
from sparsegate_ebpf.metrics import AgentState, XdpCollector
from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testing import counters, flows, reset_maps, verdicts
from sparsegate_ebpf.vethlab import VethLab

pytestmark = [pytest.mark.bpf, pytest.mark.slow]
PY = sys.executable
APP = [PY, "-m", "sparsegate_ebpf.netapps"]
UDP, TCP = socket.IPPROTO_UDP, socket.IPPROTO_TCP
HEADERS6 = 14 + 40 + 8  # Ethernet + IPv6 fixed header + UDP


@contextmanager
def attached(lab: VethLab, prog: LoadedProgram) -> Iterator[None]:
    with lab.inside(lab.server_ns):
        mode = xdp.attach(bpf=prog.bpf, fn=prog.fn, ifname=lab.server_if, mode=xdp.XdpMode.NATIVE)
    assert mode == xdp.XdpMode.NATIVE
    try:
        yield
    finally:
        with lab.inside(lab.server_ns):
            xdp.detach(bpf=prog.bpf, ifname=lab.server_if, mode=mode)


@pytest.fixture
def lab6(lab: VethLab) -> tuple[VethLab, str, str]:
    """The lab with a ULA address on each veth end (no duplicate address detection: usable at once)."""
    subnet = lab.client_ip.split(".")[2]
    # Canonical text (subnet 0 would otherwise read "fd00:201:0::1"): /metrics labels print
    # addresses the way ipaddress does, and the test compares them as text.
    client6, server6 = (str(ipaddress.IPv6Address(f"fd00:201:{subnet}::{host}")) for host in (1, 2))
    for ns, ifname, addr in ((lab.client_ns, lab.client_if, client6), (lab.server_ns, lab.server_if, server6)):
        lab.run(ns, ["ip", "-6", "addr", "add", f"{addr}/64", "dev", ifname, "nodad"])
    return lab, client6, server6


def install(lab: VethLab, prog: LoadedProgram, client6: str, server6: str) -> PolicySwapper:
    """Client and server each one identity with both addresses; udp/9000 and tcp/8080 allowed."""
    rules = [{"srcIdentity": 256, "dstIdentity": 257, "dstPort": port, "protocol": proto, "action": "allow",
              "rule": f"t#{proto}{port}"} for port, proto in ((9000, "udp"), (8080, "tcp"))]
    swapper = PolicySwapper(bpf=prog.bpf)
    swapper.apply(parse_policy({"version": "dual", "defaultAction": "deny", "rules": rules, "identities": [
        {"identity": 256, "ips": [lab.client_ip, client6]}, {"identity": 257, "ips": [lab.server_ip, server6]}]}))
    return swapper


def flow_of(prog: LoadedProgram, src: str, dst: str, dport: int, proto: int) -> tuple[int, int, int]:
    """(packets, bytes, dropped) of all flows src->dst:dport (any source port)."""
    match = [t for (s, d, _sp, dp, p), t in flows(prog).items()
             if (s, d, dp, p) == (addr_bytes(src), addr_bytes(dst), port_to_be16(dport), proto)]
    return (sum(t.packets for t in match), sum(t.bytes for t in match), sum(t.dropped for t in match))


def udp_round(lab: VethLab, dst: str, sends: dict[int, int], *, ipv6: bool) -> dict[int, int]:
    """Send `count` datagrams of 100 bytes to each port; what the server's sockets received."""
    argv = [*APP, "udp-count", "--ports", *map(str, sends), "--idle", "2"] + (["--ipv6"] if ipv6 else [])
    rx = lab.popen(lab.server_ns, argv, stdout=subprocess.PIPE)
    assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
    for port, count in sends.items():
        sent = int(lab.run(lab.client_ns, [*APP, "udp-send", "--dst", dst, "--port", str(port), "--count",
                                           str(count), "--size", "100"]).stdout)
        assert sent == count
    out, _ = rx.communicate(timeout=60)
    return {int(k): v for k, v in json.loads(out).items()}


def tcp_try(lab: VethLab, dst: str, port: int) -> str:
    return lab.run(lab.client_ns, [*APP, "tcp-try", "--dst", dst, "--port", str(port), "--timeout", "1"]).stdout.strip()


def test_ipv6_allowed_flows_pass_and_are_counted_with_their_addresses_denied_ones_dropped(
        lab6: tuple[VethLab, str, str], enforce_prog: LoadedProgram) -> None:
    lab, client6, server6 = lab6
    swapper = install(lab, enforce_prog, client6, server6)
    server = lab.popen(lab.server_ns, [PY, "-m", "http.server", "8080", "--bind", server6],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with attached(lab, enforce_prog):
            # Neighbour discovery (ICMPv6) must pass under default deny, or nothing below would.
            for _ in range(50):
                if tcp_try(lab, server6, 8080) == "ok":
                    break
                time.sleep(0.1)
            reset_maps(enforce_prog)
            got = udp_round(lab, server6, {9000: 300, 9001: 200}, ipv6=True)
            tcp_ok, tcp_denied = tcp_try(lab, server6, 8080), tcp_try(lab, server6, 8081)
            state = AgentState(bpf_available=True, program=enforce_prog, swapper=swapper, enforcement="enforce")
            samples = {m.name: m.samples for m in XdpCollector(state=state).collect()}
    finally:
        server.terminate()
        server.wait(10)
    assert got == {9000: 300, 9001: 0}
    assert (tcp_ok, tcp_denied) == ("ok", "timeout")
    assert flow_of(enforce_prog, client6, server6, 9000, UDP) == (300, 300 * (HEADERS6 + 100), 0)
    assert flow_of(enforce_prog, client6, server6, 9001, UDP) == (200, 200 * (HEADERS6 + 100), 200)
    assert flow_of(enforce_prog, client6, server6, 8080, TCP)[0] >= 3  # SYN, ACK, FIN at least
    syns = flow_of(enforce_prog, client6, server6, 8081, TCP)
    assert syns[0] == syns[2] >= 1  # every SYN (and its retransmissions) dropped
    c = counters(enforce_prog)
    assert c[Counter.IPV4] == 0 and c[Counter.IPV6] >= 500
    assert c[Counter.POLICY_DENY] == 200 + syns[2]
    v = verdicts(enforce_prog)
    assert v[(1, 1, ACTION_ALLOW)] == 300 and v[(1, 0, ACTION_DENY)] == 200 + syns[2]
    # /metrics: the flow series carry the IPv6 addresses (canonical text, RFC 5952).
    packets = {(s.labels["src"], s.labels["dst"], s.labels["dport"], s.labels["proto"]): s.value
               for s in samples["sparsegate_xdp_flow_packets"]}
    dropped = {(s.labels["src"], s.labels["dport"]): s.value for s in samples["sparsegate_xdp_flow_dropped_packets"]}
    assert packets[(client6, server6, "9000", "udp")] == 300 and packets[(client6, server6, "9001", "udp")] == 200
    assert dropped[(client6, "9001")] == 200
    rules = {(s.labels["rule"], s.labels["action"]): s.value for s in samples["sparsegate_xdp_policy_verdicts"]}
    assert rules[("t#udp9000", "allow")] == 300


def test_ipv4_on_the_same_pair_is_judged_as_before(lab6: tuple[VethLab, str, str],
                                                   enforce_prog: LoadedProgram) -> None:
    lab, client6, server6 = lab6
    install(lab, enforce_prog, client6, server6)
    with attached(lab, enforce_prog):
        lab.run(lab.client_ns, [*APP, "tcp-try", "--dst", lab.server_ip, "--port", "1", "--timeout", "1"])  # ARP
        reset_maps(enforce_prog)
        got = udp_round(lab, lab.server_ip, {9000: 300, 9001: 200}, ipv6=False)
    assert got == {9000: 300, 9001: 0}
    headers4 = 14 + 20 + 8
    assert flow_of(enforce_prog, lab.client_ip, lab.server_ip, 9000, UDP) == (300, 300 * (headers4 + 100), 0)
    assert flow_of(enforce_prog, lab.client_ip, lab.server_ip, 9001, UDP) == (200, 200 * (headers4 + 100), 200)
    c = counters(enforce_prog)
    assert (c[Counter.IPV4], c[Counter.UDP], c[Counter.POLICY_ALLOW], c[Counter.POLICY_DENY]) == (500, 500, 300, 200)
