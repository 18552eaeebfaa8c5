"""Agent side of TelemetryProbes without BPF: flags, desired interfaces, the attach/detach plan
(against our own xdp wrapper's signature), the report, and the probe source's parsing."""
from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparsegate_contracts import probes
from sparsegate_ebpf import agent, probesource, xdp
from sparsegate_ebpf.attachments import Attachments
from sparsegate_ebpf.metrics import AgentState

LO = socket.if_nameindex()[0][1]  # an interface every network namespace has ("lo")


def test_probe_flags_need_a_node_name_and_allow_empty_interfaces_only_with_a_source() -> None:
    base = ["--policy-file", "p"]
    a = agent.parse_args(["--interfaces", "", "--probe-configmap", "ns/cfg", "--node-name", "n1",
                          "--probe-report-configmap", "ns/rep", *base])
    assert (a.interfaces, a.probes, a.node_name) == ([], True, "n1")
    for bad in (["--interfaces", "", *base],
                ["--interfaces", "eth0", "--probe-configmap", "ns/cfg", "--node-name", "", *base],
                ["--interfaces", "eth0", "--probe-configmap", "no-slash", "--node-name", "n", *base],
                ["--interfaces", "eth0", "--probe-report-file", "r", "--node-name", "n", *base],
                ["--interfaces", "eth0", "--probe-file", "f", "--probe-configmap", "ns/c", "--node-name", "n", *base]):
        with pytest.raises(SystemExit):
            agent.parse_args(bad)
    assert agent.parse_args(["--interfaces", "eth0", *base]).probes is False


def test_desired_interfaces_prefer_the_node_configuration() -> None:
    config = probes.parse_node_config(json.dumps(probes.build_node_config(
        [probes.InterfaceConfig("ib0", "native"), probes.InterfaceConfig("eth1", "auto")])))
    assert agent.desired_interfaces(config, default=["eth0"], default_mode=xdp.XdpMode.GENERIC) == {
        "ib0": xdp.XdpMode.NATIVE, "eth1": xdp.XdpMode.AUTO}
    assert agent.desired_interfaces(None, default=["eth0"], default_mode=xdp.XdpMode.GENERIC) == {
        "eth0": xdp.XdpMode.GENERIC}


def test_with_enforcement_a_probe_configuration_adds_interfaces_but_never_takes_the_flags_away() -> None:
    """A TelemetryProbe (namespaced: any tenant allowed to create one) asking for `lo` only made the
    agent detach from `eth0` on every node it selected: enforcement off there. Enforcing, the
    configuration adds to --interfaces; the mode a probe asks for an interface of both holds."""
    config = probes.parse_node_config(json.dumps(probes.build_node_config(
        [probes.InterfaceConfig("lo", "generic"), probes.InterfaceConfig("eth1", "native")])))
    assert agent.desired_interfaces(config, default=["eth0", "eth1"], default_mode=xdp.XdpMode.AUTO,
                                     keep_default=True) == {
        "lo": xdp.XdpMode.GENERIC, "eth1": xdp.XdpMode.NATIVE, "eth0": xdp.XdpMode.AUTO}
    # Telemetry only: the probes' interfaces instead of the flags', as documented.
    assert agent.desired_interfaces(config, default=["eth0"], default_mode=xdp.XdpMode.AUTO) == {
        "lo": xdp.XdpMode.GENERIC, "eth1": xdp.XdpMode.NATIVE}


class FakeXdp:
    """Records calls with xdp.attach / xdp.detach_own's keyword signature."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.fail: dict[str, str] = {}
        self.detached_index: list[int | None] = []  # the ifindex each detach was given

    def attach(self, *, bpf: object, fn: object, ifname: str, mode: xdp.XdpMode) -> xdp.XdpMode:
        self.calls.append(("attach", ifname, mode.value))
        if ifname in self.fail:
            raise xdp.AttachError(self.fail[ifname])
        return xdp.XdpMode.NATIVE if mode == xdp.XdpMode.AUTO else mode

    def detach(self, *, prog_fd: int, ifname: str, mode: xdp.XdpMode, ifindex: int | None = None) -> None:
        self.calls.append(("detach", ifname, mode.value))
        self.detached_index.append(ifindex)


def test_apply_detaches_the_unwanted_reattaches_on_mode_change_and_keeps_the_rest() -> None:
    fake, state = FakeXdp(), AgentState(enforcement="off")
    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=fake.attach, detach=fake.detach)
    N, G, A = xdp.XdpMode.NATIVE, xdp.XdpMode.GENERIC, xdp.XdpMode.AUTO
    assert att.apply({LO: A}) == {}
    assert state.attached == {LO: "native"} and fake.calls == [("attach", LO, "auto")]
    fake.calls.clear()
    assert att.apply({LO: N}) == {} and fake.calls == []  # native runs: nothing to do
    assert att.apply({LO: A}) == {} and fake.calls == []  # auto keeps whatever runs
    att.apply({LO: G})
    assert fake.calls == [("detach", LO, "native"), ("attach", LO, "generic")] and state.attached == {LO: "generic"}
    fake.calls.clear()
    att.apply({})
    assert fake.calls == [("detach", LO, "generic")] and state.attached == {}


def test_attach_errors_are_kept_per_interface_reported_and_retried() -> None:
    fake, state = FakeXdp(), AgentState(enforcement="off")
    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=fake.attach, detach=fake.detach)
    fake.fail[LO] = "a foreign XDP program is attached"
    desired = {LO: xdp.XdpMode.AUTO, "nosuch0": xdp.XdpMode.AUTO}
    errors = att.apply(desired)
    assert errors == {LO: "a foreign XDP program is attached",
                      "nosuch0": "interface nosuch0 does not exist on this node"}
    report = att.report(node="n1", config_version="sha256:v", program_id=42, desired=desired)
    assert report == probes.NodeReport(node="n1", config_version="sha256:v", program_id=42, interfaces=(
        probes.InterfaceReport(LO, None, "a foreign XDP program is attached"),
        probes.InterfaceReport("nosuch0", None, "interface nosuch0 does not exist on this node")))
    del fake.fail[LO]
    assert att.apply(desired) == {"nosuch0": "interface nosuch0 does not exist on this node"}  # retried
    assert state.attached == {LO: "native"}
    assert probes.parse_report(probes.report_text(att.report(node="n1", config_version=None, program_id=None,
                                                             desired=desired))).interface(LO).mode == "native"


def test_names_linux_refuses_are_attach_errors_not_the_device_glibc_resolves_them_to() -> None:
    """if_nametoindex("lo:1") answers lo's index (glibc's ioctl drops the ':' alias suffix): the
    program was attached to lo under the name lo:1. '.' and '..' are no interface names either."""
    fake, state = FakeXdp(), AgentState(enforcement="off")
    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=fake.attach, detach=fake.detach)
    desired = {f"{LO}:1": xdp.XdpMode.AUTO, ".": xdp.XdpMode.AUTO, "..": xdp.XdpMode.AUTO}
    errors = att.apply(desired)
    assert fake.calls == [] and state.attached == {}
    assert set(errors) == set(desired) and all("is not a Linux interface name" in e for e in errors.values())
    # The node's document still parses: one stored name the CRD now refuses fails that interface alone.
    config = probes.parse_node_config(json.dumps(probes.build_node_config(
        [probes.InterfaceConfig(f"{LO}:1", "auto"), probes.InterfaceConfig(LO, "auto")])))
    assert set(agent.desired_interfaces(config, default=[], default_mode=xdp.XdpMode.AUTO)) == {LO, f"{LO}:1"}


def test_probe_source_forwards_changes_none_when_absent_and_drops_invalid(tmp_path: Path) -> None:
    seen: list[probes.NodeConfig | None] = []
    stop = threading.Event()
    path = tmp_path / "probes.json"
    doc = probes.build_node_config([probes.InterfaceConfig("eth0", "native")])

    def step(content: str | None) -> None:
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(content)
        stop.clear()
        timer = threading.Timer(0.05, stop.set)
        timer.start()
        probesource.watch_file(path=path, node="n1", on_config=seen.append, stop=stop, interval=0.01)
        timer.join()

    # The change-detection itself, step by step (watch_file below wraps the same follower).
    follow = probesource._Follow(seen.append)
    follow(probesource.node_text({"n1": doc}, "n1"))
    follow(probesource.node_text({"n1": json.dumps(doc)}, "n1"))  # same content as text: no repeat
    follow('{"interfaces": [{"name": "eth0", "xdpMode": "turbo"}]}')  # invalid: dropped, counted
    follow(probesource.node_text({"other": doc}, "n1"))
    assert [c.modes() if c else None for c in seen] == [{"eth0": "native"}, None] and follow.errors == 1

    seen.clear()
    step(None)  # no file: no configuration for this node
    step(json.dumps({"n1": doc}))
    assert [c.modes() if c else None for c in seen] == [None, {"eth0": "native"}]


def test_an_interface_re_created_under_its_name_is_attached_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A veth deleted (its program goes with it) and re-created under the same name (a pod restart
    under a CNI with stable names): the next apply attaches again instead of reporting the old
    attachment; while it is gone, it is reported with the error and retried."""
    index = {"veth-a": 7}

    def nametoindex(name: str) -> int:
        if name not in index:
            raise OSError(19, "No such device")
        return index[name]

    monkeypatch.setattr(socket, "if_nametoindex", nametoindex)
    fake, state = FakeXdp(), AgentState(enforcement="off")
    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=fake.attach, detach=fake.detach)
    want = {"veth-a": xdp.XdpMode.NATIVE}
    assert att.apply(want) == {} and fake.calls == [("attach", "veth-a", "native")]
    assert att.apply(want) == {} and len(fake.calls) == 1  # unchanged: nothing to do
    del index["veth-a"]
    errors = att.apply(want)
    assert errors == {"veth-a": "interface veth-a does not exist on this node"} and state.attached == {}
    index["veth-a"] = 9  # back, as a new interface
    assert att.apply(want) == {} and fake.calls[-1] == ("attach", "veth-a", "native")
    assert state.attached == {"veth-a": "native"}
    index["veth-a"] = 11  # re-created between two applies: attached again, not reported as it was
    assert att.apply(want) == {} and fake.calls[-1] == ("attach", "veth-a", "native")
    assert [c[0] for c in fake.calls] == ["attach", "detach", "attach", "detach", "attach"]
    assert fake.detached_index == [7, 9]  # each by the index it had: only a renamed one still has the program


def test_an_interface_renamed_is_detached_by_the_index_it_had(monkeypatch: pytest.MonkeyPatch) -> None:
    """A renamed interface keeps its XDP program (a deleted one takes it along): the agent, which
    follows names, must detach it there by its old index (also at exit, via agent._detach_all),
    else it enforces the policy of the moment for ever, unexported, and survives the agent's
    detach on exit. Real kernel: tests/e2e/ebpf/test_ebpf_netns_traffic.py."""
    index = {"veth-a": 7}

    def nametoindex(name: str) -> int:
        if name not in index:
            raise OSError(19, "No such device")
        return index[name]

    monkeypatch.setattr(socket, "if_nametoindex", nametoindex)
    fake, state = FakeXdp(), AgentState(enforcement="off")
    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=fake.attach, detach=fake.detach)
    want = {"veth-a": xdp.XdpMode.NATIVE}
    assert att.apply(want) == {}
    index["renamed"] = index.pop("veth-a")
    assert att.apply(want) == {"veth-a": "interface veth-a does not exist on this node"}
    assert fake.calls[1] == ("detach", "veth-a", "native") and fake.detached_index == [7]
    assert state.attached == {}
    # Renamed between the last apply and the agent's exit: found by its index there too.
    index["veth-a"] = 12
    assert att.apply(want) == {} and att.ifindex == {"veth-a": 12}
    index["renamed2"] = index.pop("veth-a")
    seen: list[int | None] = []
    monkeypatch.setattr(xdp, "detach_own", lambda *, prog_fd, ifname, mode, ifindex=None: seen.append(ifindex))
    state.program = SimpleNamespace(prog_fd=3)
    agent._detach_all(state, ifindex=att.ifindex)
    assert seen == [12] and state.attached == {}


def _capture_reports(monkeypatch: pytest.MonkeyPatch, *, until: int
                     ) -> tuple[list[probes.NodeReport], threading.Event]:
    """The reports the agent sends (its sink replaced), and an event set once ``until`` were sent."""
    sent: list[probes.NodeReport] = []
    stop = threading.Event()

    def sink(report: probes.NodeReport) -> None:
        sent.append(report)
        if len(sent) == until:
            stop.set()

    monkeypatch.setattr(agent, "_report_sink", lambda args: sink)
    monkeypatch.setattr(agent.inherit, "program_id", lambda fd: 42)
    return sent, stop


def test_a_report_names_the_configuration_applied_not_one_that_arrived_during_the_apply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe source's thread may deliver a new configuration while the agent applies the last:
    the report sent next must still name the applied version, else the operator counts the old
    attachment (here native) as done for the new configuration (generic)."""
    def config(mode: str) -> probes.NodeConfig:
        return probes.parse_node_config(json.dumps(probes.build_node_config([probes.InterfaceConfig(LO, mode)])))

    v1, v2 = config("native"), config("generic")
    follower = agent.ProbeFollower()
    follower.on_config(v1)
    fake, state = FakeXdp(), AgentState(enforcement="off")

    def attach(**kw: object) -> xdp.XdpMode:
        used = fake.attach(**kw)  # type: ignore[arg-type]
        if follower.config is v1:
            follower.on_config(v2)  # arrives mid-apply
        return used

    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=attach, detach=fake.detach)
    sent, stop = _capture_reports(monkeypatch, until=2)

    def desired(c: probes.NodeConfig | None) -> dict[str, xdp.XdpMode]:
        return agent.desired_interfaces(c, default=[], default_mode=xdp.XdpMode.AUTO)

    applied = follower.config
    att.apply(desired(applied))
    assert state.attached == {LO: "native"} and follower.config is v2
    agent._follow_probes(SimpleNamespace(node_name="n1", probe_interval=5.0, probe_report_heartbeat=600.0),
                         follower=follower, attachments=att, desired=desired, applied=applied, prog_fd=3, stop=stop)
    assert [(r.config_version, r.interface(LO).mode) for r in sent] == [(v1.version, "native"),
                                                                        (v2.version, "generic")]


def test_an_unchanged_report_is_sent_again_after_the_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator may drop this node's report key (a node re-registered under the same name, a
    prune racing a new node): an agent sending only changed reports would leave the probe waiting
    for it for ever. Unchanged, it is sent again every heartbeat (jittered: at most that long)."""
    fake, state = FakeXdp(), AgentState(enforcement="off")
    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=fake.attach, detach=fake.detach)
    sent, stop = _capture_reports(monkeypatch, until=3)
    guard = threading.Timer(3.0, stop.set)  # the old agent never sends again: end the test
    guard.start()
    try:
        agent._follow_probes(SimpleNamespace(node_name="n1", probe_interval=0.01, probe_report_heartbeat=0.05),
                             follower=agent.ProbeFollower(), attachments=att, desired=lambda c: {}, applied=None,
                             prog_fd=3, stop=stop)
    finally:
        guard.cancel()
    assert len(sent) == 3 and sent[0] == sent[1] == sent[2]


def test_a_mode_change_the_driver_refuses_puts_the_program_back_in_the_mode_it_ran_in() -> None:
    """native asked where only generic works (a TelemetryProbe's xdpMode changed): the program was
    detached for the change and the interface left without it (no policy, no telemetry) until the
    configuration changed again. Now it goes back to the mode it ran in, reported with the error,
    and the refused change is not retried (each try is a moment without a program) until the asked
    mode changes. Real kernel: tests/e2e/ebpf/test_ebpf_netns_traffic.py."""
    fake, state = FakeXdp(), AgentState(enforcement="off")

    def attach(*, bpf: object, fn: object, ifname: str, mode: xdp.XdpMode) -> xdp.XdpMode:
        if mode == xdp.XdpMode.NATIVE:
            fake.calls.append(("attach", ifname, mode.value))
            raise xdp.AttachError("native: Operation not supported")
        return fake.attach(bpf=bpf, fn=fn, ifname=ifname, mode=mode)

    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=attach, detach=fake.detach)
    assert att.apply({LO: xdp.XdpMode.GENERIC}) == {} and state.attached == {LO: "generic"}
    errors = att.apply({LO: xdp.XdpMode.NATIVE})
    assert state.attached == {LO: "generic"}
    assert fake.calls == [("attach", LO, "generic"), ("detach", LO, "generic"), ("attach", LO, "native"),
                          ("attach", LO, "generic")]
    assert "Operation not supported" in errors[LO] and "kept in generic mode" in errors[LO]
    report = att.report(node="n1", config_version=None, program_id=1, desired={LO: xdp.XdpMode.NATIVE})
    assert report.interface(LO) == probes.InterfaceReport(LO, "generic", errors[LO])
    fake.calls.clear()
    assert att.apply({LO: xdp.XdpMode.NATIVE}) == errors and fake.calls == []  # not retried
    assert att.apply({LO: xdp.XdpMode.AUTO}) == {} and fake.calls == []  # auto keeps what runs
    assert att.report(node="n1", config_version=None, program_id=1,
                      desired={LO: xdp.XdpMode.AUTO}).interface(LO) == probes.InterfaceReport(LO, "generic", None)
    att.apply({LO: xdp.XdpMode.NATIVE})  # asked again after another mode: tried again, once
    assert fake.calls == [("detach", LO, "generic"), ("attach", LO, "native"), ("attach", LO, "generic")]


def test_an_attach_that_lands_in_another_mode_than_asked_is_reported_and_not_retried() -> None:
    """xdp.attach puts the program back in the mode its predecessor's ran in when the mode asked
    fails after that program was removed: reported as an error (the asked mode is not what runs),
    and not retried by a detach while that mode is asked."""
    fake, state = FakeXdp(), AgentState(enforcement="off")

    def attach(*, bpf: object, fn: object, ifname: str, mode: xdp.XdpMode) -> xdp.XdpMode:
        fake.calls.append(("attach", ifname, mode.value))
        return xdp.XdpMode.GENERIC

    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=attach, detach=fake.detach)
    errors = att.apply({LO: xdp.XdpMode.NATIVE})
    assert errors == {LO: "native mode refused: kept in generic mode"} and state.attached == {LO: "generic"}
    assert att.apply({LO: xdp.XdpMode.NATIVE}) == errors and fake.calls == [("attach", LO, "native")]


def test_an_interface_left_without_a_program_under_the_same_index_is_attached_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A new interface that got the old one's name and index (created with that index, or moved in
    from a namespace where it had it), or our program removed by hand: the index check passes, and
    the agent went on reporting (and exporting) it attached while no program ran there. A program
    that is there (ours, a successor's) is left alone. Real kernel: test_ebpf_netns_traffic.py."""
    programs: dict[str, set[int]] = {LO: {42}}
    monkeypatch.setattr(xdp, "attached_programs", lambda: programs)
    fake, state = FakeXdp(), AgentState(enforcement="off")
    att = Attachments(state=state, bpf=None, fn=SimpleNamespace(fd=3), attach=fake.attach, detach=fake.detach,
                      check_bare=True)
    want = {LO: xdp.XdpMode.NATIVE}
    assert att.apply(want) == {} and fake.calls == [("attach", LO, "native")]
    assert att.apply(want) == {} and len(fake.calls) == 1  # still there
    programs[LO] = {77}  # a successor's: not ours to fight over
    assert att.apply(want) == {} and len(fake.calls) == 1
    programs[LO] = set()  # nothing there any more
    assert att.apply(want) == {} and fake.calls[1:] == [("attach", LO, "native")]
    assert state.attached == {LO: "native"}
