"""The node agent as the chart deploys it: the DaemonSet's pod, from the agent image, on this machine.

Given a veth pair this test creates — one end in the host network namespace (where the agent's
hostNetwork pod attaches XDP), the other in a network namespace of the test's own — and the chart
installed with ``agent.enabled=true`` on that one interface and one node (every kwok node is this
same host: several agents would fight over one interface), then the agent pod runs the agent image
(root with BPF/NET_ADMIN/PERFMON only, no seccomp profile: unconfined, as on a kubelet without
SeccompDefault) and is Ready, the kernel shows its XDP program on the veth, its metrics (node IP :
``agent.metricsPort``) say so, it follows the flow policy the operator published (at start: nothing
policed, so everything passes), then whatever the ConfigMap says (``agent.enforcement=enforce``: a
policed destination's denied packets are dropped, its allowed ones pass), real packets sent over the
veth are counted and dropped or passed as the policy says, and uninstalling the DaemonSet detaches
the program (the pod runner stops the container with its grace period; the agent detaches on SIGTERM).

Safety: XDP goes only on the veth end created here. Before the chart is installed its rendered
DaemonSet is checked to name exactly that interface (the chart default is eth0). The packets go to
an address inside the test's subnet through a neighbour entry with a made-up MAC address: the host
end has no IPv4 address, IPv6 and forwarding are off on it, and the kernel drops frames addressed
to another host's MAC (PACKET_OTHERHOST) after XDP has seen them, so nothing reaches the host's
stack or leaves the veth.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from devstack import CHART, RELEASE, RELEASE_NS, Stack, image_values
from host_veth import HostVeth
from localcluster import nodes, podman
from localcluster.health import wait_for
from localcluster.ports import free_port, pick_unused_pod_cidr
from prometheus_client.parser import text_string_to_metric_families
from sparsegate_contracts import flowpolicy

pytestmark = [pytest.mark.e2e, pytest.mark.bpf, pytest.mark.slow]

PY = sys.executable
AGENT_LABELS = "app.kubernetes.io/component=agent"
NODE, NODE_IP = nodes.node_name(0), nodes.node_ip(0)
XDP_MODES = {1: "native", 2: "generic"}  # `ip -j -d link` xdp.mode (XDP_ATTACHED_DRV / _SKB)
SENT_DENIED, SENT_ALLOWED = 200, 50


# -- metrics ------------------------------------------------------------------------------------

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Metrics:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def try_scrape(url: str) -> Metrics | None:
    try:
        return scrape(url)
    except OSError:
        return None


def sample(m: Metrics, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def labelled(m: Metrics, name: str) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels), v in m.items() if n == name and v]


def flow(m: Metrics, veth: HostVeth, port: int) -> tuple[float, float]:
    """(packets, dropped) of the veth's UDP flow to ``port``, summed over source ports."""
    want = {"src": veth.src_ip, "dst": veth.dst_ip, "dport": str(port), "proto": "udp"}
    packets = dropped = 0.0
    for (name, labels), v in m.items():
        d = dict(labels)
        if all(d.get(k) == w for k, w in want.items()):
            packets += v if name == "sparsegate_xdp_flow_packets_total" else 0
            dropped += v if name == "sparsegate_xdp_flow_dropped_packets_total" else 0
    return packets, dropped


def enforced_version(m: Metrics | None) -> str | None:
    versions = [d["version"] for d in labelled(m or {}, "sparsegate_xdp_policy_info")]
    return versions[0] if len(versions) == 1 else None


# -- the stack and the agent ---------------------------------------------------------------------

def log(msg: str) -> None:
    sys.stderr.write(f"\n[e2e] agent daemonset: {msg}\n")


@pytest.fixture(scope="module")
def veth() -> Iterator[HostVeth]:
    with HostVeth.create(prefix="sga", net=201, dst_mac="02:53:47:00:00:02") as v:
        yield v


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, veth: HostVeth) -> Iterator[Stack]:
    # Depends on `veth` so the pair outlives the stack: the agent detaches before the veth goes.
    s = Stack(state_dir=tmp_path_factory.mktemp("agent-install"), pod_cidr=pick_unused_pod_cidr(),
              node_shape=nodes.NodeShape(count=2, gpu_count=1))
    t0 = time.monotonic()
    s.build_images(["operator", "opa", "agent"])
    t_images = time.monotonic()
    try:
        s.up()
        log(f"images {t_images - t0:.1f}s, cluster+helm+operator Ready {time.monotonic() - t_images:.1f}s")
        yield s
    finally:
        sys.stderr.write(f"[e2e] agent daemonset stack diagnostics:\n{s.diagnose()[-6000:]}\n")
        s.down()


@dataclasses.dataclass
class Agent:
    pod: dict
    metrics_url: str
    daemonset: str  # its name, as the chart renders it


def agent_pods(stack: Stack) -> list[dict]:
    return [p for p in stack.pods(RELEASE_NS, AGENT_LABELS) if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or [])


def rendered_daemonset(stack: Stack, values: list[str]) -> dict:
    out = stack.helm("template", RELEASE, str(CHART), "-n", RELEASE_NS, *image_values(stack.images),
                     *stack.extra_values, *values).stdout
    (ds,) = [d for d in yaml.safe_load_all(out) if d and d.get("kind") == "DaemonSet"]
    return ds


@pytest.fixture(scope="module")
def agent(stack: Stack, veth: HostVeth) -> Agent:
    port = free_port(host=NODE_IP)
    values = ["--set", "agent.enabled=true", "--set", "agent.enforcement=enforce",
              "--set", f"agent.interfaces={{{veth.host_if}}}",
              "--set", f"agent.nodeSelector.kubernetes\\.io/hostname={NODE}", "--set", f"agent.metricsPort={port}"]
    # Safety first: what would run attaches to this test's veth end only, on one node only.
    ds = rendered_daemonset(stack, values)
    spec = ds["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert [a for a in container["command"] if a.startswith("--interfaces")] == [f"--interfaces={veth.host_if}"]
    assert "--enforcement=enforce" in container["command"]
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": NODE}
    labels = json.loads(stack.kubectl("get", "node", NODE, "-o", "json").stdout)["metadata"]["labels"]
    assert labels["kubernetes.io/hostname"] == NODE

    t0 = time.monotonic()
    stack.install(*values)
    try:
        pod = wait_for(lambda: next((p for p in agent_pods(stack) if ready(p)), None), what="agent pod Ready",
                       timeout_s=180, interval_s=0.5)
        t_ready = time.monotonic()
        url = f"http://{pod['status']['podIP']}:{port}/metrics"
        wait_for(lambda: any(d.get("interface") == veth.host_if
                             for d in labelled(try_scrape(url) or {}, "sparsegate_xdp_attached")),
                 what="the agent's XDP program attached to the veth", timeout_s=180, interval_s=0.5)
    except AssertionError as exc:
        pods = stack.pods(RELEASE_NS, AGENT_LABELS)
        tails = "\n".join(f"--- {p['metadata']['name']}:\n{stack.logs(p, 'agent')}" for p in pods)
        raise AssertionError(f"{exc}\n{tails}\n{stack.diagnose()}") from None
    log(f"helm upgrade with agent.enabled=true -> agent pod Ready {t_ready - t0:.1f}s, "
        f"XDP attached (BCC compiled in the container) {time.monotonic() - t0:.1f}s")
    return Agent(pod=pod, metrics_url=url, daemonset=ds["metadata"]["name"])


# -- the tests ----------------------------------------------------------------------------------

def test_agent_pod_runs_the_agent_image_with_bpf_capabilities_only(stack: Stack, agent: Agent,
                                                                   veth: HostVeth) -> None:
    ds = stack.get("daemonset", agent.daemonset, RELEASE_NS)
    assert ds["status"]["desiredNumberScheduled"] == 1, ds["status"]
    pod = agent.pod
    assert pod["spec"]["nodeName"] == NODE and pod["spec"]["hostNetwork"] is True
    assert pod["status"]["podIP"] == NODE_IP  # hostNetwork: the node's IP, where the metrics listen
    (status,) = pod["status"]["containerStatuses"]
    assert status["image"] == stack.images["agent"] and status["ready"] and status["restartCount"] == 0

    inspect = json.loads(podman.podman("inspect", stack.container_name(pod, "agent")).stdout)[0]
    assert inspect["ImageName"] == stack.images["agent"]
    host = inspect["HostConfig"]
    assert not host["Privileged"] and host["ReadonlyRootfs"] and host["NetworkMode"] == "host"
    assert inspect["Config"]["User"] in ("0", "0:0")
    assert "seccomp=unconfined" in host["SecurityOpt"] and "no-new-privileges" in host["SecurityOpt"], host
    # The process holds exactly BPF, NET_ADMIN and PERFMON.
    assert sorted(inspect["EffectiveCaps"]) == ["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"], inspect["EffectiveCaps"]

    m = scrape(agent.metrics_url)
    assert sample(m, "sparsegate_agent_bpf_available") == 1
    assert sample(m, "sparsegate_agent_pinned") == 1  # the chart's agent.bpffs is mounted and pinned on
    attached = labelled(m, "sparsegate_xdp_attached")
    prog = veth.xdp()
    assert prog and prog["prog"]["name"] == "xdp_flow", prog  # the kernel agrees with the metrics
    assert attached == [{"interface": veth.host_if, "mode": XDP_MODES[prog["mode"]]}], attached


def test_agent_enforces_the_published_policy_on_veth_packets(stack: Stack, agent: Agent, veth: HostVeth) -> None:
    cm = stack.get("configmap", flowpolicy.CONFIGMAP_NAME, RELEASE_NS)
    published = json.loads(cm["data"][flowpolicy.DOCUMENT_KEY])
    # What the operator writes at start with no RoutingPolicy: no destination is policed.
    assert published["defaultAction"] == "deny" and flowpolicy.ip_entries(published) == [], published
    assert published["policedDestinations"] == [], published
    t0 = time.monotonic()
    wait_for(lambda: enforced_version(try_scrape(agent.metrics_url)) == published["version"],
             what=f"the agent enforcing {published['version']}", timeout_s=60, interval_s=0.5)
    log(f"operator's policy live in the agent {time.monotonic() - t0:.1f}s after the first check")

    port = 7000 + secrets.randbelow(1000)
    before = scrape(agent.metrics_url)
    assert flow(before, veth, port) == (0, 0)
    assert veth.send_udp(port, SENT_ALLOWED) == SENT_ALLOWED
    m = scrape(agent.metrics_url)
    assert flow(m, veth, port) == (SENT_ALLOWED, 0)  # not policed: passed, only counted
    assert sample(m, "sparsegate_xdp_packets_total", type="unpoliced") - sample(
        before, "sparsegate_xdp_packets_total", type="unpoliced") == SENT_ALLOWED

    # The agent follows the ConfigMap, whoever writes it: an allow-list naming this flow, then the
    # operator's document again (its publisher only writes when its own document changes).
    # Its rule names no RoutingPolicy ("ns/name#..."), so the agent's own policy-liveness filter keeps
    # it; the second entry names a RoutingPolicy that does not exist, so the agent (reading
    # RoutingPolicies with the chart's RBAC) drops it and enforces the narrowed document.
    rule = "e2e-agent-daemonset#allow"
    published_by_hand = flowpolicy.build_document(entries=[
        flowpolicy.entry(src_ip=veth.src_ip, dst_ip=veth.dst_ip, dst_port=port, protocol="udp", action="allow",
                         rule=rule),
        flowpolicy.entry(src_ip=veth.src_ip, dst_ip=veth.dst_ip, dst_port=port + 1, protocol="udp", action="allow",
                         rule=f"{RELEASE_NS}/no-such-policy#0")], policed_destinations=[veth.dst_ip])
    allow = flowpolicy.without_policies(published_by_hand, live=())
    assert allow is not None and [e["rule"] for e in allow["entries"]] == [rule]
    annotation = "sparsegate.dev/flow-policy-version"

    def publish(document: dict) -> None:
        patch = {"metadata": {"annotations": {annotation: document["version"]}},
                 "data": {flowpolicy.DOCUMENT_KEY: flowpolicy.document_text(document)}}
        stack.kubectl("patch", "configmap", flowpolicy.CONFIGMAP_NAME, "-n", RELEASE_NS, "--type=merge",
                      "-p", json.dumps(patch))

    t0 = time.monotonic()
    publish(published_by_hand)
    try:
        wait_for(lambda: enforced_version(try_scrape(agent.metrics_url)) == allow["version"],
                 what="the agent enforcing the updated ConfigMap", timeout_s=60, interval_s=0.2)
        log(f"ConfigMap change live in the agent {time.monotonic() - t0:.1f}s after the patch")
        assert veth.send_udp(port, SENT_ALLOWED) == SENT_ALLOWED
        assert veth.send_udp(port + 1, SENT_DENIED) == SENT_DENIED  # its allow entry was dropped: denied
        m = scrape(agent.metrics_url)
        assert flow(m, veth, port) == (2 * SENT_ALLOWED, 0)
        assert flow(m, veth, port + 1) == (SENT_DENIED, SENT_DENIED)
        assert sample(m, "sparsegate_xdp_policy_verdicts_total", rule=rule, action="allow") == SENT_ALLOWED
        assert sample(m, "sparsegate_xdp_policy_verdicts_total", rule="default:deny", action="deny") == SENT_DENIED
        assert sample(m, "sparsegate_xdp_port_packets_total", port=str(port + 1), proto="udp") == SENT_DENIED
    finally:
        publish(published)
    wait_for(lambda: enforced_version(try_scrape(agent.metrics_url)) == published["version"],
             what="the agent back on the operator's policy", timeout_s=60, interval_s=0.2)


PINS = Path("/sys/fs/bpf/sparsegate")  # the chart's agent.bpffs + "/sparsegate", on this host


def test_a_deleted_agent_pod_is_followed_by_one_that_replaces_its_program_in_one_step(
        stack: Stack, agent: Agent, veth: HostVeth) -> None:
    """A restart as a rolling update or an evicted pod makes one: the old pod, told by SIGTERM while
    its DaemonSet stays, leaves its program attached (still enforcing); the new pod, without
    CAP_SYS_ADMIN, knows that program only by the pins under agent.bpffs and swaps it for its own."""
    old = veth.xdp()
    assert old and old["prog"]["name"] == "xdp_flow", old
    old_id = old["prog"]["id"]
    assert (PINS / str(old_id) / "prog").exists(), sorted(p.name for p in PINS.iterdir())
    old_pod = agent.pod["metadata"]["name"]
    t0 = time.monotonic()
    stack.kubectl("delete", "pod", old_pod, "-n", RELEASE_NS, "--wait=true", "--timeout=90s")
    assert veth.xdp()["prog"]["id"] == old_id  # kept through the restart: the policy never lapses
    try:
        pod = wait_for(lambda: next((p for p in agent_pods(stack) if ready(p) and p["metadata"]["name"] != old_pod),
                                    None), what="a new agent pod Ready", timeout_s=180, interval_s=0.5)
        wait_for(lambda: (veth.xdp() or {}).get("prog", {}).get("id") not in (None, old_id) and any(
            d.get("interface") == veth.host_if for d in labelled(try_scrape(agent.metrics_url) or {},
                                                                 "sparsegate_xdp_attached")),
            what="the new agent's program attached in place of the old one", timeout_s=180, interval_s=0.5)
    except AssertionError as exc:
        tails = "\n".join(f"--- {p['metadata']['name']}:\n{stack.logs(p, 'agent')}"
                          for p in stack.pods(RELEASE_NS, AGENT_LABELS))
        raise AssertionError(f"{exc}\n{tails}") from None
    new_id = veth.xdp()["prog"]["id"]
    agent_log = stack.logs(pod, "agent", lines=400)
    assert f"replaced xdp_flow (prog id {old_id}) on {veth.host_if} in one step" in agent_log, agent_log
    assert "XDP not attached to" not in agent_log, agent_log
    # The old program is attached nowhere now: its pins went with it; the new one's are there.
    wait_for(lambda: not (PINS / str(old_id)).exists(), what="the old program's pins removed", timeout_s=30,
             interval_s=0.5)
    assert (PINS / str(new_id) / "prog").exists()
    agent.pod = pod
    log(f"agent pod deleted -> new pod's program in place of the old one {time.monotonic() - t0:.1f}s")


def test_uninstalling_the_daemonset_detaches_xdp(stack: Stack, agent: Agent, veth: HostVeth) -> None:
    assert veth.xdp(), "the agent's program should be attached before the DaemonSet goes"
    prog_id = veth.xdp()["prog"]["id"]
    # The chart's RBAC lets the agent follow its own DaemonSet (list + watch by name): without it
    # the agent cannot tell an uninstall from a restart and keeps XDP attached.
    wait_for(lambda: sample(try_scrape(agent.metrics_url) or {}, "sparsegate_agent_daemonset_followed") == 1,
             what="the agent following its DaemonSet", timeout_s=30, interval_s=0.5)
    name = stack.container_name(agent.pod, "agent")
    # The container's log file (k8s-file), held open: still readable once the runner removed the
    # container, so the agent's own account of its stop can be read to the end. (`podman logs
    # --follow` does not always return after `podman rm -f` with podman 4.3.)
    inspect = json.loads(podman.podman("inspect", name).stdout)[0]
    with open(inspect["HostConfig"]["LogConfig"]["Path"], "rb") as log_file:
        t0 = time.monotonic()
        stack.install("--set", "agent.enabled=false")
        assert stack.kubectl("get", "daemonset", agent.daemonset, "-n", RELEASE_NS,
                             check=False).returncode != 0, "the DaemonSet should be gone"
        wait_for(lambda: not stack.pods(RELEASE_NS, AGENT_LABELS), what="agent pod deleted", timeout_s=60,
                 interval_s=0.5)
        wait_for(lambda: podman.podman("container", "exists", name, check=False).returncode == 1,
                 what="agent container removed by the pod runner", timeout_s=60, interval_s=0.5)
        t_gone = time.monotonic()
        agent_log = log_file.read().decode(errors="replace")
    # The runner stopped it with SIGTERM within the grace period and the agent detached: it saw its
    # DaemonSet go (--on-exit daemonset; on a mere restart it leaves XDP attached for its successor).
    link = json.loads(subprocess.run(["ip", "-j", "link", "show", "dev", veth.host_if], capture_output=True,
                                     text=True, timeout=10, check=True).stdout)[0]
    if "xdp" in link:
        # How the container ended: the pod runner logs the stop's duration and exit code (137: killed).
        runner = [line for line in stack.cluster.layout.log("podrunner").read_text(errors="replace").splitlines()
                  if name in line]
        sys.stderr.write(f"[e2e] agent log tail:\n{agent_log[-3000:]}\n[e2e] pod runner on {name}:\n"
                         + "\n".join(runner[-10:]) + "\n")
    assert "xdp" not in link, link
    assert f"XDP detached from {veth.host_if}" in agent_log and "bye" in agent_log, agent_log[-3000:]
    assert not (PINS / str(prog_id)).exists(), "a detaching agent removes its pins"
    log(f"helm upgrade with agent.enabled=false -> container gone, XDP detached {t_gone - t0:.1f}s")
