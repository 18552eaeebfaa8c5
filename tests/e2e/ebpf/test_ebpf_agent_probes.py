"""The agent following its node's probe configuration (TelemetryProbes), as a process in a netns.

Given the agent in the lab's server namespace with `--interfaces <fallback>` and a probe file for
its node, when the configuration changes the agent detaches from the interfaces no longer asked for
and attaches to the new ones in the mode asked; an interface that does not exist is reported with
its error while the others stay attached; with no configuration for its node it falls back to
`--interfaces`; every state is reported (file sink) with the kernel's program id.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sparsegate_contracts import probes
from sparsegate_ebpf.vethlab import VethLab

pytestmark = [pytest.mark.bpf, pytest.mark.slow]
PY = sys.executable
NODE = "node-under-test"
MODES = {1: "native", 2: "generic"}


def xdp_on(lab: VethLab, ifname: str) -> dict[str, Any] | None:
    link = json.loads(lab.run(lab.server_ns, ["ip", "-j", "-d", "link", "show", ifname]).stdout)[0]
    return link.get("xdp")


def write_config(path: Path, interfaces: dict[str, str] | None) -> str | None:
    """Publish {NODE: document} (None: no key for this node); returns the document's version."""
    if interfaces is None:
        path.write_text(json.dumps({"other-node": probes.build_node_config([probes.InterfaceConfig("eth0", "auto")])}))
        return None
    doc = probes.build_node_config(probes.InterfaceConfig(name=i, xdp_mode=m, probes=("ns/p",))
                                   for i, m in interfaces.items())
    path.write_text(json.dumps({NODE: doc}))
    return doc["version"]


def read_report(path: Path) -> probes.NodeReport | None:
    try:
        return probes.parse_report(json.dumps(json.loads(path.read_text())[NODE]))
    except (FileNotFoundError, ValueError, KeyError):
        return None


def wait_report(path: Path, what: str, cond, timeout: float = 30.0) -> probes.NodeReport:
    deadline = time.monotonic() + timeout
    while True:
        report = read_report(path)
        if report is not None and cond(report):
            return report
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last report {report}"
        time.sleep(0.1)


def test_agent_attaches_and_detaches_as_its_probe_configuration_changes(lab: VethLab, tmp_path: Path) -> None:
    # Two more interfaces in the server namespace: a veth pair of its own (a, b).
    tag = lab.server_if[3:]
    if_a, if_b = f"sgpa{tag}", f"sgpb{tag}"
    lab.run(lab.server_ns, ["ip", "link", "add", if_a, "type", "veth", "peer", "name", if_b])
    for i in (if_a, if_b):
        lab.run(lab.server_ns, ["ip", "link", "set", i, "up"])
    policy, config, report = tmp_path / "policy.json", tmp_path / "probes.json", tmp_path / "report.json"
    policy.write_text(json.dumps({"defaultAction": "deny", "entries": []}))
    version = write_config(config, {lab.server_if: "native"})
    log = tmp_path / "agent.log"
    with log.open("w") as log_f:
        agent = lab.popen(lab.server_ns, [
            PY, "-m", "sparsegate_ebpf.agent", "--interfaces", if_b, "--metrics-port", "9102",
            "--metrics-addr", "127.0.0.1", "--policy-file", str(policy), "--poll-interval", "0.2",
            "--enforcement", "off", "--on-exit", "detach", "--node-name", NODE, "--probe-file", str(config),
            "--probe-report-file", str(report), "--probe-interval", "0.5"], stdout=log_f, stderr=subprocess.STDOUT)
    try:
        # 1. The configuration names the lab's veth, native: attached there, not on the fallback.
        r = wait_report(report, "attached to the lab veth", lambda r: r.config_version == version
                        and (r.interface(lab.server_if) or probes.InterfaceReport("", None)).mode == "native",
                        timeout=120.0)  # BCC compiles first
        prog = xdp_on(lab, lab.server_if)
        assert prog and MODES[prog["mode"]] == "native" and prog["prog"]["name"] == "xdp_flow"
        assert r.program_id == prog["prog"]["id"]
        assert [i.name for i in r.interfaces] == [lab.server_if] and xdp_on(lab, if_b) is None

        # 2. Changed to interface a, generic: the veth is detached, a attached in skb mode.
        version = write_config(config, {if_a: "generic"})
        r = wait_report(report, "moved to interface a", lambda r: r.config_version == version
                        and [(i.name, i.mode) for i in r.interfaces] == [(if_a, "generic")])
        assert xdp_on(lab, lab.server_if) is None
        on_a = xdp_on(lab, if_a)
        assert on_a and MODES[on_a["mode"]] == "generic" and on_a["prog"]["id"] == prog["prog"]["id"]

        # 3. An interface this node lacks is reported with its error; a stays attached.
        version = write_config(config, {if_a: "generic", "nosuch0": "auto"})
        r = wait_report(report, "the missing interface reported", lambda r: r.config_version == version
                        and r.interface("nosuch0") is not None and r.interface("nosuch0").error != "not attached yet")
        missing = r.interface("nosuch0")
        assert missing == probes.InterfaceReport("nosuch0", None, "interface nosuch0 does not exist on this node")
        assert r.interface(if_a) == probes.InterfaceReport(if_a, "generic", None)
        assert xdp_on(lab, if_a)

        # 4. No configuration for this node any more (its probes were deleted): back on --interfaces.
        write_config(config, None)
        r = wait_report(report, "fallback to --interfaces", lambda r: r.config_version is None
                        and [(i.name, i.mode) for i in r.interfaces] == [(if_b, "native")])
        assert xdp_on(lab, if_a) is None and xdp_on(lab, if_b)
    finally:
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(20)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert f"XDP detached from {if_b}" in text, text[-3000:]
    for ifname in (lab.server_if, if_a, if_b):
        assert xdp_on(lab, ifname) is None, ifname
