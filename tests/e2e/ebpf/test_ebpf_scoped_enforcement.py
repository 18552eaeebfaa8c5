"""Scoped, stateful enforcement on real traffic through a veth pair between two network namespaces.

The server namespace plays a model pod (its first address is policed, a second one is not); the
client namespace plays the rest of the node and the cluster: its first address is a caller the
policy allows, a second one is the node's own address (always allowed, like a kubelet probe), a
third one is any other pod (allowed nothing). XDP on the server end sees what enters the model pod;
XDP on the client end as well (same program, same maps) sees what the model pod sends, as the
host-side veth of a pod would.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparsegate_ebpf import xdp
from sparsegate_ebpf.maps import Counter
from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testing import counters, flows, reset_maps
from sparsegate_ebpf.vethlab import VethLab

pytestmark = [pytest.mark.bpf, pytest.mark.slow]
PY = sys.executable
APP = [PY, "-m", "sparsegate_ebpf.netapps"]


class Net:
    """Addresses added to a VethLab: see the module docstring."""

    def __init__(self, lab: VethLab) -> None:
        base = lab.server_ip.rsplit(".", 1)[0]
        self.lab = lab
        self.model, self.side = lab.server_ip, f"{base}.5"           # policed / not policed (same pod)
        self.caller, self.node, self.other = lab.client_ip, f"{base}.254", f"{base}.3"
        for addr in (self.node, self.other):
            lab.run(lab.client_ns, ["ip", "addr", "add", f"{addr}/24", "dev", lab.client_if])
        lab.run(lab.server_ns, ["ip", "addr", "add", f"{self.side}/24", "dev", lab.server_if])

    def policy(self, *, entries: bool = True) -> object:
        rows = [{"srcIP": self.caller, "dstIP": self.model, "dstPort": port, "protocol": proto, "action": "allow",
                 "rule": f"models/caller#{proto}{port}"} for port, proto in ((8080, "tcp"), (9000, "udp"))]
        return parse_policy({"defaultAction": "deny", "entries": rows if entries else [],
                             "policedDestinations": [self.model]})

    def tcp_try(self, ns: str, dst: str, port: int, *, src: str = "", timeout: float = 1.5) -> str:
        argv = [*APP, "tcp-try", "--dst", dst, "--port", str(port), "--timeout", str(timeout)]
        return self.lab.run(ns, argv + (["--src", src] if src else [])).stdout.strip()

    def udp_round(self, *, src: str, dst: str, port: int, count: int = 100) -> int:
        """`count` datagrams src -> dst:port (client to server side); how many arrived."""
        rx = self.lab.popen(self.lab.server_ns, [*APP, "udp-count", "--ports", str(port), "--idle", "1.0"],
                            stdout=subprocess.PIPE)
        assert rx.stdout.readline().strip() == "ready"
        sent = int(self.lab.run(self.lab.client_ns, [*APP, "udp-send", "--dst", dst, "--port", str(port),
                                                      "--count", str(count), "--src", src]).stdout)
        out, _ = rx.communicate(timeout=60)
        assert sent == count
        return json.loads(out)[str(port)]

    def udp_answers(self, *, server: str, port: int, count: int = 20) -> int:
        """The model pod asks `server` (client side) `count` times over UDP; answers it got."""
        echo = self.lab.popen(self.lab.client_ns, [*APP, "udp-echo", "--port", str(port), "--bind", server,
                                                   "--idle", "2"], stdout=subprocess.PIPE)
        assert echo.stdout.readline().strip() == "ready"
        got = int(self.lab.run(self.lab.server_ns, [*APP, "udp-ask", "--dst", server, "--port", str(port),
                                                     "--count", str(count), "--timeout", "0.3"]).stdout)
        echo.communicate(timeout=30)
        return got


@pytest.fixture
def net(lab: VethLab) -> Net:
    return Net(lab)


@contextmanager
def attached(lab: VethLab, prog: LoadedProgram, *ends: str) -> Iterator[None]:
    """Attach `prog` natively to the given ends ("server", "client")."""
    where = {"server": (lab.server_ns, lab.server_if), "client": (lab.client_ns, lab.client_if)}
    with ExitStack() as stack:
        for end in ends:
            ns, ifname = where[end]
            with lab.inside(ns):
                xdp.attach(bpf=prog.bpf, fn=prog.fn, ifname=ifname, mode=xdp.XdpMode.NATIVE)

            def detach(ns: str = ns, ifname: str = ifname) -> None:
                with lab.inside(ns):
                    xdp.detach(bpf=prog.bpf, ifname=ifname, mode=xdp.XdpMode.NATIVE)

            stack.callback(detach)
        yield


@contextmanager
def http_server(lab: VethLab, ns: str, bind: str, port: int) -> Iterator[None]:
    server = lab.popen(ns, [PY, "-m", "http.server", str(port), "--bind", bind],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while f":{port:04X} " not in lab.run(ns, ["cat", "/proc/net/tcp"]).stdout:
            assert time.monotonic() < deadline, f"server on {port} not listening"
            time.sleep(0.1)
        yield
    finally:
        server.terminate()
        server.wait(10)


def test_node_probes_and_dns_keep_flowing_with_enforcement_on(net: Net, enforce_prog: LoadedProgram) -> None:
    lab = net.lab
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    with http_server(lab, lab.server_ns, "0.0.0.0", 8080), attached(lab, enforce_prog, "server"):
        # What the operator publishes with no RoutingPolicy: nothing policed, everything passes.
        swapper.apply(parse_policy({"defaultAction": "deny", "entries": [], "policedDestinations": []}),
                      extra_sources=(net.node,))
        assert net.tcp_try(lab.client_ns, net.model, 8080, src=net.other) == "ok"
        # The model pod policed, nothing allowed by any rule: the node's probe and DNS still pass.
        swapper.apply(net.policy(entries=False))
        reset_maps(enforce_prog)
        assert net.tcp_try(lab.client_ns, net.model, 8080, src=net.node) == "ok"          # kubelet probe
        assert net.tcp_try(lab.client_ns, net.model, 8080, src=net.other) == "timeout"
        assert net.udp_answers(server=net.other, port=53) == 20                           # DNS answers
        assert net.udp_answers(server=net.other, port=5353) == 0                          # any other UDP
    c = counters(enforce_prog)
    assert c[Counter.ALLOWED_SOURCE] >= 3 and c[Counter.DNS] == 20  # SYN + ACKs of the probe
    assert c[Counter.POLICY_DENY] >= 1 + 20  # the other pod's SYN(s), the non-DNS answers


def test_policed_destination_drops_unallowed_sources_and_unpoliced_destinations_pass(
        net: Net, enforce_prog: LoadedProgram) -> None:
    lab = net.lab
    PolicySwapper(bpf=enforce_prog.bpf).apply(net.policy(), extra_sources=(net.node,))
    with attached(lab, enforce_prog, "server"):
        reset_maps(enforce_prog)
        assert net.udp_round(src=net.other, dst=net.model, port=9000) == 0
        assert net.udp_round(src=net.other, dst=net.side, port=9000) == 100
        assert net.udp_round(src=net.caller, dst=net.model, port=9000) == 100
    c = counters(enforce_prog)
    assert (c[Counter.POLICY_DENY], c[Counter.UNPOLICED], c[Counter.POLICY_ALLOW]) == (100, 100, 100)
    dropped = {(t.packets, t.dropped) for t in flows(enforce_prog).values()}
    assert dropped == {(100, 100), (100, 0)}


def test_replies_of_allowed_flows_pass(net: Net, enforce_prog: LoadedProgram) -> None:
    lab = net.lab
    PolicySwapper(bpf=enforce_prog.bpf).apply(net.policy(), extra_sources=(net.node,))
    with http_server(lab, lab.server_ns, net.model, 8080), http_server(lab, lab.client_ns, net.other, 8090):
        # Only the model pod's ingress seen: an allowed caller's connection completes and serves;
        # the model pod's own connection out gets its TCP replies (no SYN among them); its UDP
        # replies are unsolicited datagrams as far as this end knows, and are judged (dropped).
        with attached(lab, enforce_prog, "server"):
            reset_maps(enforce_prog)
            assert lab.run(lab.client_ns, [*APP, "http-get", "--url", f"http://{net.model}:8080/",
                                           "--count", "5"]).stdout.strip() == "5"
            assert lab.run(lab.server_ns, [*APP, "http-get", "--url", f"http://{net.other}:8090/",
                                           "--count", "3"]).stdout.strip() == "3"
            assert net.udp_answers(server=net.other, port=7000) == 0
            ingress_only = counters(enforce_prog)
        # Both directions seen (the client end plays the pod's host-side veth): the outbound packets
        # are tracked, and the replies pass as replies of tracked flows, UDP included.
        with attached(lab, enforce_prog, "server", "client"):
            reset_maps(enforce_prog)
            assert lab.run(lab.server_ns, [*APP, "http-get", "--url", f"http://{net.other}:8090/",
                                           "--count", "3"]).stdout.strip() == "3"
            assert net.udp_answers(server=net.other, port=7000) == 20
            both = counters(enforce_prog)
    assert ingress_only[Counter.POLICY_ALLOW] >= 5 * 3 and ingress_only[Counter.TCP_UNTRACKED] >= 3 * 2
    assert ingress_only[Counter.POLICY_DENY] == 20
    assert both[Counter.CT_REPLY] >= 3 * 2 + 20 and both[Counter.POLICY_DENY] == 0
    assert both[Counter.TCP_UNTRACKED] == 0


def test_audit_mode_drops_nothing_and_counts_what_it_would_drop(net: Net, audit_prog: LoadedProgram) -> None:
    lab = net.lab
    PolicySwapper(bpf=audit_prog.bpf).apply(net.policy(), extra_sources=(net.node,))
    with http_server(lab, lab.server_ns, net.model, 8080), attached(lab, audit_prog, "server"):
        reset_maps(audit_prog)
        assert net.udp_round(src=net.other, dst=net.model, port=9000, count=200) == 200
        assert net.tcp_try(lab.client_ns, net.model, 8080, src=net.other) == "ok"
        assert net.udp_round(src=net.caller, dst=net.model, port=9000, count=50) == 50
    c = counters(audit_prog)
    # The datagrams, and every packet of the denied connection (enforce would have dropped its SYN).
    assert c[Counter.AUDIT_DENY] == c[Counter.POLICY_DENY] >= 200 + 2
    assert c[Counter.POLICY_ALLOW] == 50
    assert {(t.packets, t.dropped) for t in flows(audit_prog).values() if t.packets in (200, 50)} == {(200, 0), (50, 0)}
    assert all(t.dropped == 0 for t in flows(audit_prog).values())


def test_overlay_udp_passes_uninspected_where_nothing_is_policed(net: Net, enforce_prog: LoadedProgram) -> None:
    lab = net.lab
    PolicySwapper(bpf=enforce_prog.bpf).apply(net.policy(entries=False), extra_sources=(net.node,))
    with attached(lab, enforce_prog, "server"):
        reset_maps(enforce_prog)
        got = {port: net.udp_round(src=net.other, dst=net.side, port=port, count=50) for port in (4789, 8472, 6081)}
        to_model = net.udp_round(src=net.other, dst=net.model, port=4789, count=50)  # the pod's own port
        control = net.udp_round(src=net.other, dst=net.model, port=9000, count=50)
    assert got == {4789: 50, 8472: 50, 6081: 50} and to_model == 0 and control == 0
    c = counters(enforce_prog)
    assert (c[Counter.OVERLAY], c[Counter.POLICY_DENY]) == (150, 100)


def scrape(lab: VethLab, port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    code = ("import urllib.request;"
            f"print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics',timeout=5).read().decode())")
    text = lab.run(lab.server_ns, [PY, "-c", code]).stdout
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_agent_audit_flag_exports_would_be_drops(net: Net, tmp_path: Path) -> None:
    lab, port = net.lab, 9113
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"defaultAction": "deny", "policedDestinations": [net.model], "entries": []}))
    log = tmp_path / "agent.log"
    with log.open("w") as log_f:
        agent = lab.popen(lab.server_ns, [PY, "-m", "sparsegate_ebpf.agent", "--interfaces", lab.server_if,
                                          "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
                                          "--policy-file", str(policy), "--enforcement", "audit",
                                          "--allow-sources", net.node, "--on-exit", "detach"],
                          stdout=log_f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                m = scrape(lab, port)
                if m.get(("sparsegate_xdp_attached", (("interface", lab.server_if), ("mode", "native")))):
                    break
            except subprocess.CalledProcessError:
                pass
            assert time.monotonic() < deadline and agent.poll() is None, log.read_text()
            time.sleep(0.3)
        assert m[("sparsegate_xdp_enforcement", (("mode", "audit"),))] == 1
        assert net.udp_round(src=net.other, dst=net.model, port=9000, count=80) == 80
        assert net.tcp_try(lab.client_ns, net.model, 1, src=net.node) != "timeout"  # node: not even judged
        m = scrape(lab, port)
    finally:
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(30)
    assert rc == 0, log.read_text()
    assert m[("sparsegate_xdp_policy_audit_drops_total", ())] == 80
    assert m[("sparsegate_xdp_packets_total", (("type", "allowed_source"),))] >= 1
    assert m[("sparsegate_xdp_port_packets_total", (("port", "9000"), ("proto", "udp")))] == 80
    assert "enforcement audit" in log.read_text()
