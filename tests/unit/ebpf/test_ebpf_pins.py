"""Knowing a predecessor's program without CAP_SYS_ADMIN, without BPF: which attached program is
ours (`xdp._ours`), which programs `ip -j -d link` shows attached, which pins a sweep removes, and
when the attachments call the sweep."""
from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

from sparsegate_ebpf import pins, xdp
from sparsegate_ebpf.attachments import Attachments
from sparsegate_ebpf.metrics import AgentState

LO = socket.if_nameindex()[0][1]


def test_a_program_is_ours_by_its_pin_or_by_a_visible_name_never_by_a_missing_one() -> None:
    no_name = {"mode": 1, "prog": {"id": 7}}  # what iproute2 shows without CAP_SYS_ADMIN
    assert xdp._ours(no_name, prog_name="xdp_flow", known={7: 5})
    assert not xdp._ours(no_name, prog_name="xdp_flow", known={8: 5})
    assert xdp._ours({"mode": 1, "prog": {"id": 9, "name": "xdp_flow"}}, prog_name="xdp_flow", known={})
    assert not xdp._ours({"mode": 2, "prog": {"id": 9, "name": "cilium_xdp"}}, prog_name="xdp_flow", known={})
    assert not xdp._ours(None, prog_name="xdp_flow", known={7: 5})


def test_attached_ids_reads_every_interface_and_every_attachment(monkeypatch) -> None:
    links = [{"ifname": "lo"},
             {"ifname": "eth0", "xdp": {"mode": 1, "prog": {"id": 11}, "attached": [{"mode": 1, "prog": {"id": 11}}]}},
             {"ifname": "eth1", "xdp": {"mode": 3, "attached": [{"mode": 2, "prog": {"id": 12}},
                                                                {"mode": 1, "prog": {"id": 13}}]}}]

    def fake_run(argv: list[str], **kw: object) -> SimpleNamespace:
        assert argv == ["ip", "-j", "-d", "link", "show"]
        return SimpleNamespace(stdout=json.dumps(links))

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert pins.attached_ids() == {11, 12, 13}


def test_a_sweep_removes_the_pins_of_programs_attached_nowhere_and_keeps_the_others(tmp_path: Path) -> None:
    found = {}
    for pid in (21, 22):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / pins.PROG).write_text("")
        found[pid] = pins.Pinned(prog_id=pid, path=tmp_path / str(pid), prog_fd=os.open(os.devnull, os.O_RDONLY))
    closed_fd = found[21].prog_fd
    assert pins.sweep(found, attached={22, 99}) == [21]
    assert list(found) == [22] and sorted(p.name for p in tmp_path.iterdir()) == ["22"]
    try:
        os.fstat(closed_fd)
        raise AssertionError("the swept program's descriptor is still open")
    except OSError:
        pass
    found[22].close()


def test_the_attachments_call_the_sweep_after_every_apply_even_one_with_errors() -> None:
    """The sweep forgets only predecessors' programs attached nowhere (a predecessor still attached
    where ours failed keeps its pins). Called only after an apply without errors, one interface
    that could not be attached (a probe naming an interface missing on this node, for good) kept
    every predecessor's pinned program, with all its maps (~43 MiB here, more with more CPUs: the
    flow tables are per-CPU), loaded for ever: one more at each agent restart."""
    swept: list[int] = []
    fail: dict[str, str] = {LO: "busy"}

    def attach(*, bpf: object, fn: object, ifname: str, mode: xdp.XdpMode) -> xdp.XdpMode:
        if ifname in fail:
            raise xdp.AttachError(fail[ifname])
        return xdp.XdpMode.NATIVE

    att = Attachments(state=AgentState(enforcement="off"), bpf=None, fn=SimpleNamespace(fd=3), attach=attach,
                      detach=lambda **kw: None, after_apply=lambda: swept.append(1))
    assert att.apply({LO: xdp.XdpMode.AUTO}) == {LO: "busy"} and swept == [1]
    fail.clear()
    assert att.apply({LO: xdp.XdpMode.AUTO}) == {} and swept == [1, 1]
