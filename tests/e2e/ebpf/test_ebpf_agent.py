"""The node agent as a process: attach, /metrics, policy file updates, clean SIGTERM detach."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from localcluster.health import wait_for
from sparsegate_ebpf.vethlab import VethLab

pytestmark = [pytest.mark.bpf, pytest.mark.slow]
PY = sys.executable
APP = [PY, "-m", "sparsegate_ebpf.netapps"]
PORT = 9102


def scrape(lab: VethLab) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    code = f"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{PORT}/metrics',timeout=5).read().decode())"
    text = lab.run(lab.server_ns, [PY, "-c", code]).stdout
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def flow_labels(lab: VethLab, dport: int) -> dict[str, str]:
    return {"src": lab.client_ip, "dst": lab.server_ip, "dport": str(dport), "proto": "udp"}


def flow_packets(metrics: dict, lab: VethLab, dport: int) -> tuple[float, float]:
    """(packets, dropped) summed over source ports."""
    want = flow_labels(lab, dport)
    pk = dr = 0.0
    for (name, labels), v in metrics.items():
        d = dict(labels)
        if all(d.get(k) == w for k, w in want.items()):
            pk += v if name == "sparsegate_xdp_flow_packets_total" else 0
            dr += v if name == "sparsegate_xdp_flow_dropped_packets_total" else 0
    return pk, dr


def scrape_when_serving(lab: VethLab) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``scrape``, or nothing while the agent does not answer yet (BCC still compiling, not listening)."""
    try:
        return scrape(lab)
    except subprocess.CalledProcessError:
        return {}


def write_policy(path: Path, lab: VethLab, *, allow_port: int, version: str) -> None:
    path.write_text(json.dumps({"version": version, "defaultAction": "deny", "entries": [
        {"srcIP": lab.client_ip, "dstIP": lab.server_ip, "dstPort": allow_port, "protocol": "udp",
         "action": "allow", "rule": f"test/p#{allow_port}"}]}))


def send(lab: VethLab, port: int, count: int) -> int:
    return int(lab.run(lab.client_ns, [*APP, "udp-send", "--dst", lab.server_ip, "--port", str(port),
                                       "--count", str(count)]).stdout)


def test_agent_attaches_exports_follows_policy_file_and_detaches_on_sigterm(lab: VethLab, tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    write_policy(policy, lab, allow_port=9000, version="v1")
    log = tmp_path / "agent.log"
    with log.open("w") as log_f:
        agent = lab.popen(lab.server_ns, [PY, "-m", "sparsegate_ebpf.agent", "--interfaces", lab.server_if,
                                          "--metrics-port", str(PORT), "--metrics-addr", "127.0.0.1",
                                          "--policy-file", str(policy), "--poll-interval", "0.2",
                                          "--on-exit", "detach", "--policy-map-records", "4096"],
                          stdout=log_f, stderr=subprocess.STDOUT)
    try:
        # The policy goes into the maps before the program is attached (never live without it), so
        # "ready" is both: the policy metric alone shows up first and raced the attach on a slow machine.
        m = wait_for(lambda: (x := scrape_when_serving(lab)) and sample(x, "sparsegate_xdp_policy_info", version="v1")
                     and sample(x, "sparsegate_xdp_attached", interface=lab.server_if, mode="native") and x,
                     what="agent ready: policy v1 and attached natively",
                     timeout_s=120.0, interval_s=0.2)  # BCC compiles first: slow on a loaded machine
        assert sample(m, "sparsegate_agent_bpf_available") == 1
        assert sample(m, "sparsegate_xdp_attached", interface=lab.server_if, mode="native") == 1
        # The maps are the size asked for; the live one holds meta, rule, policed destination, source.
        assert sample(m, "sparsegate_xdp_policy_map_capacity_records") == 4096
        assert 4 <= sample(m, "sparsegate_xdp_policy_map_records") < 4096

        assert (send(lab, 9000, 100), send(lab, 9001, 40)) == (100, 40)
        m = scrape(lab)
        assert flow_packets(m, lab, 9000) == (100, 0)
        assert flow_packets(m, lab, 9001) == (40, 40)
        assert sample(m, "sparsegate_xdp_policy_verdicts_total", rule="test/p#9000", action="allow") == 100
        assert sample(m, "sparsegate_xdp_policy_verdicts_total", rule="default:deny", action="deny") == 40
        assert sample(m, "sparsegate_xdp_port_packets_total", port="9000", proto="udp") == 100

        # Swap to a policy allowing 9001 instead; an invalid document in between is rejected.
        policy.write_text("{broken")
        wait_for(lambda: sample(scrape(lab), "sparsegate_agent_policy_errors_total") == 1, what="rejection counted",
                 timeout_s=30.0, interval_s=0.2)
        write_policy(policy, lab, allow_port=9001, version="v2")
        m = wait_for(lambda: (x := scrape(lab)) and sample(x, "sparsegate_xdp_policy_info", version="v2") and x,
                     what="policy v2 live", timeout_s=30.0, interval_s=0.2)
        assert sample(m, "sparsegate_xdp_policy_generation") == 2
        assert (send(lab, 9000, 10), send(lab, 9001, 10)) == (10, 10)
        m = scrape(lab)
        assert flow_packets(m, lab, 9000) == (110, 10)
        assert flow_packets(m, lab, 9001) == (50, 40)
    finally:
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(20)
    text = log.read_text()
    assert rc == 0, text
    assert "in native mode" in text and f"XDP detached from {lab.server_if}" in text
    link = json.loads(lab.run(lab.server_ns, ["ip", "-j", "link", "show", lab.server_if]).stdout)[0]
    assert "xdp" not in link, link
    # Detached: traffic to the formerly denied port now reaches the stack unfiltered.
    assert send(lab, 9000, 5) == 5


def test_without_a_probe_source_a_re_created_interface_is_attached_again(lab: VethLab, tmp_path: Path) -> None:
    """A pod's veth deleted and re-created under its name takes the program along. With a probe
    source the agent re-applies every --probe-interval; with --interfaces alone it attached once
    and never again: the new interface ran with no program (nothing dropped, nothing counted)
    until the agent restarted."""
    policy = tmp_path / "policy.json"
    write_policy(policy, lab, allow_port=9000, version="v1")
    log = tmp_path / "agent.log"
    with log.open("w") as log_f:
        agent = lab.popen(lab.server_ns, [PY, "-m", "sparsegate_ebpf.agent", "--interfaces", lab.server_if,
                                          "--metrics-port", str(PORT), "--metrics-addr", "127.0.0.1",
                                          "--policy-file", str(policy), "--poll-interval", "0.2",
                                          "--probe-interval", "0.3", "--on-exit", "detach",
                                          "--policy-map-records", "4096"],
                          stdout=log_f, stderr=subprocess.STDOUT)

    def xdp_prog() -> dict:
        out = lab.run(lab.server_ns, ["ip", "-j", "-d", "link", "show", lab.server_if], check=False).stdout
        return ((json.loads(out or "[{}]")[0].get("xdp") or {}).get("prog") or {}) if out else {}

    try:
        wait_for(lambda: (x := scrape_when_serving(lab)) and sample(x, "sparsegate_xdp_attached",
                                                                    interface=lab.server_if, mode="native"),
                 what="agent attached", timeout_s=120.0, interval_s=0.2)
        first = xdp_prog()
        assert first.get("id"), first
        lab.run(lab.server_ns, ["ip", "link", "del", lab.server_if])
        subprocess.run(["ip", "link", "add", lab.client_if, "netns", lab.client_ns, "type", "veth", "peer", "name",
                        lab.server_if, "netns", lab.server_ns], check=True, capture_output=True, timeout=20)
        for ns, ifname, addr in ((lab.client_ns, lab.client_if, lab.client_ip),
                                 (lab.server_ns, lab.server_if, lab.server_ip)):
            lab.run(ns, ["ip", "addr", "add", f"{addr}/24", "dev", ifname])
            lab.run(ns, ["ip", "link", "set", ifname, "up"])
        again = wait_for(lambda: xdp_prog() or None, what="the program on the re-created interface",
                         timeout_s=15.0, interval_s=0.2)
        assert again["id"] == first["id"]
        # Enforced again: the denied port drops.
        assert send(lab, 9001, 20) == 20
        wait_for(lambda: flow_packets(scrape(lab), lab, 9001) == (20, 20), what="denied packets dropped",
                 timeout_s=10.0, interval_s=0.2)
    finally:
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(20)
    assert rc == 0, log.read_text()
