"""Real traffic through a veth pair between two fresh network namespaces, XDP attached natively.

Counts are checked against what the sender sent and what the receiver (or the kernel's own
SNMP counters) saw, so nothing here is a hard-coded expectation.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from sparsegate_ebpf import xdp
from sparsegate_ebpf.maps import ACTION_ALLOW, Counter, addr_bytes, port_to_be16
from sparsegate_ebpf.policy import parse_policy
from sparsegate_ebpf.policyswap import PolicySwapper
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testing import counters, flows, reset_maps, verdicts
from sparsegate_ebpf.vethlab import VethLab

pytestmark = [pytest.mark.bpf, pytest.mark.slow]
PY = sys.executable
APP = [PY, "-m", "sparsegate_ebpf.netapps"]
UDP, TCP = socket.IPPROTO_UDP, socket.IPPROTO_TCP
HEADERS = 14 + 20 + 8


@contextmanager
def attached(lab: VethLab, prog: LoadedProgram, ns: str, ifname: str) -> Iterator[xdp.XdpMode]:
    with lab.inside(ns):
        mode = xdp.attach(bpf=prog.bpf, fn=prog.fn, ifname=ifname, mode=xdp.XdpMode.NATIVE)
    try:
        yield mode
    finally:
        with lab.inside(ns):
            xdp.detach(bpf=prog.bpf, ifname=ifname, mode=mode)


def flow_of(prog: LoadedProgram, src: str, dst: str, dport: int, proto: int):
    """All flows src->dst:dport (any source port), summed."""
    match = [t for (s, d, _sp, dp, p), t in flows(prog).items()
             if (s, d, dp, p) == (addr_bytes(src), addr_bytes(dst), port_to_be16(dport), proto)]
    return (sum(t.packets for t in match), sum(t.bytes for t in match), sum(t.dropped for t in match))


def udp_receiver(lab: VethLab, ports: list[int], *, idle: float = 2.0, ipv6: bool = False) -> subprocess.Popen[str]:
    argv = [*APP, "udp-count", "--ports", *map(str, ports), "--idle", str(idle)] + (["--ipv6"] if ipv6 else [])
    proc = lab.popen(lab.server_ns, argv, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def received(proc: subprocess.Popen[str]) -> dict[int, int]:
    out, _ = proc.communicate(timeout=60)
    return {int(k): v for k, v in json.loads(out).items()}


def udp_send(lab: VethLab, dst: str, port: int, count: int, size: int = 100) -> int:
    return int(lab.run(lab.client_ns, [*APP, "udp-send", "--dst", dst, "--port", str(port),
                                       "--count", str(count), "--size", str(size)]).stdout)


def warm_up(lab: VethLab, prog: LoadedProgram) -> None:
    """Resolve ARP (and let IPv6 autoconf chatter pass) so counts below are only our traffic."""
    lab.run(lab.client_ns, [*APP, "tcp-try", "--dst", lab.server_ip, "--port", "1", "--timeout", "1"])
    time.sleep(0.2)
    reset_maps(prog)


def test_udp_counts_and_policy_drops_match_what_was_sent(lab: VethLab, enforce_prog: LoadedProgram) -> None:
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    swapper.apply(parse_policy({"defaultAction": "deny", "entries": [
        {"srcIP": lab.client_ip, "dstIP": lab.server_ip, "dstPort": 9000, "protocol": "udp", "action": "allow",
         "rule": "t#udp"},
        {"srcIP": lab.client_ip, "dstIP": lab.server_ip, "dstPort": 1, "protocol": "tcp", "action": "allow",
         "rule": "t#warm"}]}))
    with attached(lab, enforce_prog, lab.server_ns, lab.server_if) as mode:
        assert mode == xdp.XdpMode.NATIVE
        warm_up(lab, enforce_prog)
        rx = udp_receiver(lab, [9000, 9001])
        allowed = udp_send(lab, lab.server_ip, 9000, 500)
        denied = udp_send(lab, lab.server_ip, 9001, 300)
        got = received(rx)
    assert (allowed, denied) == (500, 300)
    assert got == {9000: 500, 9001: 0}
    assert flow_of(enforce_prog, lab.client_ip, lab.server_ip, 9000, UDP) == (500, 500 * (HEADERS + 100), 0)
    assert flow_of(enforce_prog, lab.client_ip, lab.server_ip, 9001, UDP) == (300, 300 * (HEADERS + 100), 300)
    c = counters(enforce_prog)
    assert c[Counter.UDP] == 800
    assert c[Counter.POLICY_DENY] == 300
    assert c[Counter.POLICY_ALLOW] == 500


def test_ipv6_to_an_unpoliced_destination_passes_under_default_deny(lab: VethLab, enforce_prog: LoadedProgram) -> None:
    # No rule names fd00:200::2, so it is not policed: counted (test_ebpf_netns_ipv6.py polices IPv6).
    for ns, ifname, addr in ((lab.client_ns, lab.client_if, "fd00:200::1"), (lab.server_ns, lab.server_if, "fd00:200::2")):
        lab.run(ns, ["ip", "-6", "addr", "add", f"{addr}/64", "dev", ifname, "nodad"])
    PolicySwapper(bpf=enforce_prog.bpf).apply(parse_policy({"defaultAction": "deny", "entries": []}))
    with attached(lab, enforce_prog, lab.server_ns, lab.server_if):
        reset_maps(enforce_prog)
        rx = udp_receiver(lab, [9000], ipv6=True)
        sent = udp_send(lab, "fd00:200::2", 9000, 200)
        got = received(rx)
    assert got == {9000: sent} == {9000: 200}
    c = counters(enforce_prog)
    assert c[Counter.IPV6] >= 200  # plus neighbour discovery
    assert c[Counter.POLICY_DENY] == 0 and c[Counter.IPV4] == 0 and c[Counter.UNPOLICED] == 200


def test_tcp_http_both_directions_match_kernel_segment_counts_and_handshake_rtt(
        lab: VethLab, telemetry_prog: LoadedProgram) -> None:
    server = lab.popen(lab.server_ns, [PY, "-m", "http.server", "8080", "--bind", lab.server_ip],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(lab, 8080)
        with attached(lab, telemetry_prog, lab.server_ns, lab.server_if), \
                attached(lab, telemetry_prog, lab.client_ns, lab.client_if):
            reset_maps(telemetry_prog)
            before = (lab.snmp(lab.client_ns)["Tcp"], lab.snmp(lab.server_ns)["Tcp"])
            ok = int(lab.run(lab.client_ns, [*APP, "http-get", "--url", f"http://{lab.server_ip}:8080/",
                                             "--count", "20"]).stdout)
            time.sleep(0.3)  # last FIN/ACKs
            after = (lab.snmp(lab.client_ns)["Tcp"], lab.snmp(lab.server_ns)["Tcp"])
    finally:
        server.terminate()
        server.wait(10)
    assert ok == 20
    sent_by = [a["OutSegs"] - b["OutSegs"] + a["RetransSegs"] - b["RetransSegs"] for b, a in zip(*[before, after])]
    to_server = flow_of(telemetry_prog, lab.client_ip, lab.server_ip, 8080, TCP)
    to_client = sum(t.packets for (s, *_), t in flows(telemetry_prog).items() if s == addr_bytes(lab.server_ip))
    assert to_server[0] == sent_by[0] > 20 * 3
    assert to_client == sent_by[1]
    hs = [h for k, h in telemetry_prog.bpf[b"handshakes"].items() if bytes(k.daddr) == addr_bytes(lab.server_ip)]
    assert len(hs) == 20 and all(h.samples == 1 and 0 < h.last_rtt_ns < 10**9 for h in hs)


def test_tcp_policy_allows_listed_port_and_drops_syns_to_others(lab: VethLab, enforce_prog: LoadedProgram) -> None:
    servers = [lab.popen(lab.server_ns, [PY, "-m", "http.server", str(p), "--bind", lab.server_ip],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in (8080, 8081)]
    try:
        for p in (8080, 8081):
            _wait_listening(lab, p)
        PolicySwapper(bpf=enforce_prog.bpf).apply(parse_policy({"defaultAction": "deny", "entries": [
            {"srcIP": lab.client_ip, "dstIP": lab.server_ip, "dstPort": 8080, "protocol": "tcp",
             "action": "allow", "rule": "t#http"}]}))
        with attached(lab, enforce_prog, lab.server_ns, lab.server_if):
            reset_maps(enforce_prog)
            ok = lab.run(lab.client_ns, [*APP, "tcp-try", "--dst", lab.server_ip, "--port", "8080"]).stdout.strip()
            blocked = lab.run(lab.client_ns, [*APP, "tcp-try", "--dst", lab.server_ip, "--port", "8081",
                                              "--timeout", "1.5"]).stdout.strip()
    finally:
        for s in servers:
            s.terminate()
            s.wait(10)
    assert (ok, blocked) == ("ok", "timeout")
    packets, _, dropped = flow_of(enforce_prog, lab.client_ip, lab.server_ip, 8081, TCP)
    assert packets == dropped >= 1  # the SYN and its retransmissions, all dropped
    packets, _, dropped = flow_of(enforce_prog, lab.client_ip, lab.server_ip, 8080, TCP)
    assert packets >= 3 and dropped == 0


def test_policy_swaps_during_live_traffic_drop_nothing_and_judge_each_packet_by_one_policy(
        lab: VethLab, enforce_prog: LoadedProgram) -> None:
    def pol(tag: str, extra_port: int, extra_action: str, first: bool) -> object:
        flow = {"srcIP": lab.client_ip, "dstIP": lab.server_ip, "dstPort": 9000, "protocol": "udp",
                "action": "allow", "rule": f"{tag}#flow"}
        other = {"srcIP": lab.client_ip, "dstIP": lab.server_ip, "dstPort": extra_port, "protocol": "udp",
                 "action": extra_action, "rule": f"{tag}#other"}
        return parse_policy({"version": tag, "defaultAction": "deny", "entries": [flow, other] if first else [other, flow]})

    # Both allow the test flow (rule id 1 in A, 2 in B) and differ elsewhere.
    pa, pb = pol("A", 9100, "deny", True), pol("B", 9200, "allow", False)
    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    swapper.apply(pa)
    swaps: list[float] = []
    with attached(lab, enforce_prog, lab.server_ns, lab.server_if):
        warm_up(lab, enforce_prog)
        rx = udp_receiver(lab, [9000])
        sender = lab.popen(lab.client_ns, [*APP, "udp-send", "--dst", lab.server_ip, "--port", "9000",
                                           "--duration", "3", "--size", "64"], stdout=subprocess.PIPE)
        stop = threading.Event()

        def flip() -> None:
            i = 0
            while not stop.is_set():
                swaps.append(swapper.apply(pb if i % 2 == 0 else pa).swap_seconds)
                i += 1

        t = threading.Thread(target=flip)
        t.start()
        try:
            sent = int(sender.communicate(timeout=30)[0])
        finally:
            stop.set()
            t.join(30)
        got = received(rx)
    packets, _, dropped = flow_of(enforce_prog, lab.client_ip, lab.server_ip, 9000, UDP)
    # The generations still in the maps, by generation (the last retired one and the two in the
    # pool slots); the older ones were folded into totals by rule name at each swap.
    v = verdicts(enforce_prog)
    folded = {name: packets for (name, action), (packets, _) in swapper.retired_by_rule.items()
              if action == ACTION_ALLOW}
    assert len(swaps) >= 20, f"only {len(swaps)} swaps"
    assert dropped == 0 and counters(enforce_prog)[Counter.POLICY_DENY] == 0
    assert sent == packets == got[9000] == sum(v.values()) + sum(folded.values())
    # Generation g was A (odd) or B (even); each packet's rule id must be that policy's.
    assert all(action == ACTION_ALLOW and rule == (1 if g % 2 else 2) for g, rule, action in v), v
    # Only the test flow's rule of either policy counted (folded under its name), both of them:
    # the traffic spanned many generations.
    assert set(swapper.retired_by_rule) == {("A#flow", ACTION_ALLOW), ("B#flow", ACTION_ALLOW)}, swapper.retired_by_rule


def _wait_listening(lab: VethLab, port: int) -> None:
    deadline = time.monotonic() + 10
    while f":{port:04X} " not in lab.run(lab.server_ns, ["cat", "/proc/net/tcp"]).stdout:
        assert time.monotonic() < deadline, f"server on {port} not listening"
        time.sleep(0.1)


def test_auto_mode_falls_back_to_generic_where_the_driver_has_no_native_xdp(
        lab: VethLab, telemetry_prog: LoadedProgram) -> None:
    # Loopback (of our own namespace) has no driver XDP hook.
    with lab.inside(lab.server_ns):
        with pytest.raises(xdp.AttachError):
            xdp.attach(bpf=telemetry_prog.bpf, fn=telemetry_prog.fn, ifname="lo", mode=xdp.XdpMode.NATIVE)
        mode = xdp.attach(bpf=telemetry_prog.bpf, fn=telemetry_prog.fn, ifname="lo", mode=xdp.XdpMode.AUTO)
        xdp.detach(bpf=telemetry_prog.bpf, ifname="lo", mode=mode)
    assert mode == xdp.XdpMode.GENERIC


def test_generic_mode_counts_the_same_traffic(lab: VethLab, telemetry_prog: LoadedProgram) -> None:
    with lab.inside(lab.server_ns):
        mode = xdp.attach(bpf=telemetry_prog.bpf, fn=telemetry_prog.fn, ifname=lab.server_if,
                          mode=xdp.XdpMode.GENERIC)
    try:
        assert mode == xdp.XdpMode.GENERIC
        warm_up(lab, telemetry_prog)
        rx = udp_receiver(lab, [9000])
        sent = udp_send(lab, lab.server_ip, 9000, 300, size=10)
        got = received(rx)
    finally:
        with lab.inside(lab.server_ns):
            xdp.detach(bpf=telemetry_prog.bpf, ifname=lab.server_if, mode=mode)
    assert got == {9000: sent} == {9000: 300}
    assert flow_of(telemetry_prog, lab.client_ip, lab.server_ip, 9000, UDP) == (300, 300 * (HEADERS + 10), 0)


def test_stale_program_of_a_crashed_agent_is_replaced_but_foreign_ones_are_not(
        lab: VethLab, telemetry_prog: LoadedProgram) -> None:
    from bcc import BPF

    # A foreign program: attach must refuse rather than clobber it.
    other = BPF(text=b"int not_ours(struct xdp_md *ctx) { return XDP_PASS; }")
    other_fn = other.load_func(b"not_ours", BPF.XDP)
    with lab.inside(lab.server_ns):
        other.attach_xdp(lab.server_if.encode(), other_fn, xdp.XDP_FLAGS_SKB_MODE)
        with pytest.raises(xdp.AttachError):
            xdp.attach(bpf=telemetry_prog.bpf, fn=telemetry_prog.fn, ifname=lab.server_if, mode=xdp.XdpMode.AUTO)
        assert xdp.attached_program(lab.server_if)["prog"]["name"] == "not_ours"
        other.remove_xdp(lab.server_if.encode(), xdp.XDP_FLAGS_SKB_MODE)
    other.cleanup()
    # Our own program left behind in generic mode (a SIGKILLed agent): replaced by a native attach.
    crashed = subprocess.run(
        ["ip", "netns", "exec", lab.server_ns, PY, "-c",
         "from sparsegate_ebpf import programs, xdp;p=programs.load(enforce=False);"
         f"xdp.attach(bpf=p.bpf, fn=p.fn, ifname='{lab.server_if}', mode=xdp.XdpMode.GENERIC)"],
        capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 0, crashed.stderr
    with lab.inside(lab.server_ns):
        assert xdp.attached_program(lab.server_if)["mode"] == 2  # still there after its process exited
        mode = xdp.attach(bpf=telemetry_prog.bpf, fn=telemetry_prog.fn, ifname=lab.server_if,
                          mode=xdp.XdpMode.NATIVE)
        now = xdp.attached_program(lab.server_if)
        xdp.detach(bpf=telemetry_prog.bpf, ifname=lab.server_if, mode=mode)
    assert mode == xdp.XdpMode.NATIVE and now["mode"] == 1 and now["prog"]["name"] == "xdp_flow"


def test_an_interface_renamed_while_attached_loses_the_program_at_the_next_apply(
        lab: VethLab, telemetry_prog: LoadedProgram) -> None:
    """A renamed interface keeps its XDP program (a deleted one takes it along). The agent follows
    names: the next apply detaches it from the renamed interface (by the index it had), and so
    does the agent's exit for one renamed after the last apply; before, the program stayed there,
    enforcing the policy of the moment for ever, even after the agent's detach on exit."""
    from sparsegate_ebpf import agent
    from sparsegate_ebpf.attachments import Attachments
    from sparsegate_ebpf.metrics import AgentState

    def rename(old: str, new: str) -> None:
        for cmd in (["link", "set", old, "down"], ["link", "set", old, "name", new], ["link", "set", new, "up"]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True, timeout=20)

    tag = lab.server_if[3:]
    state = AgentState(enforcement="off", program=telemetry_prog)
    with lab.inside(lab.server_ns):
        att = Attachments(state=state, bpf=telemetry_prog.bpf, fn=telemetry_prog.fn)
        want = {lab.server_if: xdp.XdpMode.NATIVE}
        try:
            assert att.apply(want) == {} and state.attached == {lab.server_if: "native"}
            rename(lab.server_if, f"sgr1{tag}")
            assert set(att.apply(want)) == {lab.server_if} and state.attached == {}
            on_renamed = xdp.attached_program(f"sgr1{tag}")
            assert not (on_renamed or {}).get("prog"), on_renamed
            rename(f"sgr1{tag}", lab.server_if)
            assert att.apply(want) == {} and state.attached == {lab.server_if: "native"}
            rename(lab.server_if, f"sgr2{tag}")  # renamed after the last apply: found at exit
            agent._detach_all(state, ifindex=att.ifindex)
            at_exit = xdp.attached_program(f"sgr2{tag}")
            assert not (at_exit or {}).get("prog"), at_exit
        finally:
            for name in (lab.server_if, f"sgr1{tag}", f"sgr2{tag}"):
                try:
                    xdp.detach_own(prog_fd=telemetry_prog.prog_fd, ifname=name, mode=xdp.XdpMode.NATIVE)
                except Exception:
                    pass


def test_a_mode_change_the_driver_refuses_leaves_the_program_in_the_mode_it_ran_in(
        lab: VethLab, telemetry_prog: LoadedProgram) -> None:
    """native asked (a TelemetryProbe's xdpMode) on an interface whose driver has no native XDP
    (loopback here), where the program runs generic: before, the program was detached for the
    change and the interface left with none (no policy enforced, no telemetry)."""
    from sparsegate_ebpf.attachments import Attachments
    from sparsegate_ebpf.metrics import AgentState

    state = AgentState(enforcement="off", program=telemetry_prog)
    with lab.inside(lab.server_ns):
        att = Attachments(state=state, bpf=telemetry_prog.bpf, fn=telemetry_prog.fn)
        try:
            assert att.apply({"lo": xdp.XdpMode.GENERIC}) == {}
            errors = att.apply({"lo": xdp.XdpMode.NATIVE})
            now = xdp.attached_program("lo")
            assert set(errors) == {"lo"} and "kept in generic mode" in errors["lo"]
            assert state.attached == {"lo": "generic"}
            assert (now or {}).get("mode") == 2 and now["prog"]["name"] == "xdp_flow", now
        finally:
            try:
                xdp.detach_own(prog_fd=telemetry_prog.prog_fd, ifname="lo", mode=xdp.XdpMode.GENERIC)
            except Exception:
                pass


def test_a_predecessor_in_another_mode_is_not_removed_for_a_mode_the_driver_refuses(
        lab: VethLab, telemetry_prog: LoadedProgram) -> None:
    """Our predecessor's program runs generic on an interface without native XDP (loopback) and
    native is asked: it must be removed to change mode, and when native then fails the new program
    goes on in generic mode. Before, the attach failed with the interface left without a program."""
    from bcc import BPF

    pred = BPF(text=b"int pred(struct xdp_md *ctx) { return XDP_PASS; }")
    pred_fn = pred.load_func(b"pred", BPF.XDP)
    try:
        with lab.inside(lab.server_ns):
            pred.attach_xdp(b"lo", pred_fn, xdp.XDP_FLAGS_SKB_MODE)
            pred_id = xdp.attached_program("lo")["prog"]["id"]
            try:
                used = xdp.attach(bpf=telemetry_prog.bpf, fn=telemetry_prog.fn, ifname="lo",
                                  mode=xdp.XdpMode.NATIVE, known={pred_id: pred_fn.fd})
            except xdp.AttachError as exc:
                used = exc
            now = xdp.attached_program("lo")
            if isinstance(used, xdp.XdpMode):
                xdp.detach(bpf=telemetry_prog.bpf, ifname="lo", mode=used)
    finally:
        pred.cleanup()
    assert used == xdp.XdpMode.GENERIC, used
    assert (now or {}).get("prog", {}).get("name") == "xdp_flow" and now["mode"] == 2, now


def test_an_interface_re_created_with_the_same_index_or_stripped_of_the_program_is_attached_again(
        lab: VethLab, telemetry_prog: LoadedProgram) -> None:
    """The agent tells a re-created interface by its index; one re-created with the same index (or
    moved in from a namespace where it had it), or whose program someone removed, passed that
    check: reported and exported as attached while no program ran there."""
    from sparsegate_ebpf.attachments import Attachments
    from sparsegate_ebpf.metrics import AgentState

    state = AgentState(enforcement="off", program=telemetry_prog)
    peer = f"sgq{lab.server_if[3:]}"
    with lab.inside(lab.server_ns):
        att = Attachments(state=state, bpf=telemetry_prog.bpf, fn=telemetry_prog.fn, check_bare=True)
        want = {lab.server_if: xdp.XdpMode.NATIVE}
        try:
            assert att.apply(want) == {}
            index = socket.if_nametoindex(lab.server_if)
            subprocess.run(["ip", "link", "del", lab.server_if], check=True, capture_output=True, timeout=20)
            subprocess.run(["ip", "link", "add", "name", lab.server_if, "index", str(index), "type", "veth", "peer",
                            "name", peer], check=True, capture_output=True, timeout=20)
            assert socket.if_nametoindex(lab.server_if) == index
            assert att.apply(want) == {} and state.attached == {lab.server_if: "native"}
            assert (xdp.attached_program(lab.server_if) or {}).get("prog", {}).get("name") == "xdp_flow"
            subprocess.run(["ip", "link", "set", "dev", lab.server_if, "xdp", "off"], check=True, timeout=20)
            assert att.apply(want) == {}
            assert (xdp.attached_program(lab.server_if) or {}).get("prog", {}).get("name") == "xdp_flow"
        finally:
            try:
                xdp.detach_own(prog_fd=telemetry_prog.prog_fd, ifname=lab.server_if, mode=xdp.XdpMode.NATIVE)
            except Exception:
                pass
