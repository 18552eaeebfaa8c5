"""The agent without BPF: clear log line, `sparsegate_agent_bpf_available 0`, exit 1 on stop.
Mocked at our own wrapper (programs.load), not at BCC."""
from __future__ import annotations

import logging
import threading
import time
import urllib.request

import pytest

from sparsegate_ebpf import agent, programs
from localcluster.ports import free_port



def test_agent_reports_bpf_unavailable(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                       tmp_path) -> None:
    def no_bpf(**_: object) -> None:
        raise programs.BpfUnavailable("cannot import bcc (test)")

    monkeypatch.setattr(programs, "load", no_bpf)
    port = free_port()
    args = agent.parse_args(["--interfaces", "eth0", "--metrics-port", str(port), "--metrics-addr", "127.0.0.1",
                             "--policy-file", str(tmp_path / "p.json")])
    stop = threading.Event()
    result: list[int] = []
    caplog.set_level(logging.ERROR)
    t = threading.Thread(target=lambda: result.append(agent.run(args, stop=stop)))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert "sparsegate_agent_bpf_available 0.0" in body
        assert "sparsegate_xdp_packets_total" not in body
    finally:
        stop.set()
        t.join(10)
    assert result == [1]
    assert any("BPF unavailable" in r.getMessage() and "cannot import bcc" in r.getMessage() for r in caplog.records)


def test_cli_requires_exactly_one_policy_source() -> None:
    with pytest.raises(SystemExit):
        agent.parse_args(["--interfaces", "eth0"])
    with pytest.raises(SystemExit):
        agent.parse_args(["--interfaces", "eth0", "--policy-file", "f", "--policy-configmap", "ns/n"])
    with pytest.raises(SystemExit):
        agent.parse_args(["--interfaces", "eth0", "--policy-configmap", "no-slash"])
    a = agent.parse_args(["--interfaces", "eth0,eth1", "--policy-configmap", "ns/n", "--xdp-mode", "generic"])
    assert (a.interfaces, a.xdp_mode) == (["eth0", "eth1"], "generic")
