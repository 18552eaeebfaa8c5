"""TelemetryProbe end to end: the operator from its image, the chart's agent DaemonSet, two host veths.

Given the chart installed with the agent on one node and ``agent.interfaces`` empty (so the agent
attaches nowhere until a probe says so; every kwok node is this same host, and no test may touch
its real interfaces), when a TelemetryProbe selects that node by label with the first veth, then
the agent attaches there and the probe's status shows the node, interface, mode and the kernel's
program id (Ready, attachedNodes 1); when the probe's interface changes to the second veth, the
first is detached and the second attached; a younger probe asking the same interface in another
xdpMode is Stalled (XdpModeConflict) without disturbing it; an interface the node lacks makes the
probe Stalled (AttachFailed) naming node and interface; deleting the probe detaches the program.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from devstack import CHART, RELEASE, RELEASE_NS, Stack, image_values
from host_veth import HostVeth
from localcluster import nodes
from localcluster.health import wait_for
from localcluster.ports import free_port, pick_unused_pod_cidr
from sparsegate_contracts import probes as contract

pytestmark = [pytest.mark.e2e, pytest.mark.bpf, pytest.mark.slow]

AGENT_LABELS = "app.kubernetes.io/component=agent"
NODE = nodes.node_name(0)
XDP_MODES = {1: "native", 2: "generic"}


def log(msg: str) -> None:
    sys.stderr.write(f"\n[e2e] telemetry probe: {msg}\n")


@pytest.fixture(scope="module")
def veths() -> Iterator[tuple[HostVeth, HostVeth]]:
    with HostVeth.create(prefix="sgt", net=202, dst_mac="02:53:47:00:00:03") as first, \
            HostVeth.create(prefix="sgu", net=203, dst_mac="02:53:47:00:00:04") as second:
        yield first, second


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, veths: tuple[HostVeth, HostVeth]) -> Iterator[Stack]:
    # Depends on `veths` so the pairs outlive the stack: the agent detaches before they go.
    s = Stack(state_dir=tmp_path_factory.mktemp("probe-install"), pod_cidr=pick_unused_pod_cidr(),
              node_shape=nodes.NodeShape(count=2, gpu_count=1))
    s.build_images(["operator", "opa", "agent"])
    try:
        s.up()
        yield s
    finally:
        sys.stderr.write(f"[e2e] telemetry probe stack diagnostics:\n{s.diagnose()[-6000:]}\n")
        s.down()


@pytest.fixture(scope="module")
def agent(stack: Stack) -> Iterator[dict]:
    values = ["--set", "agent.enabled=true", "--set-json", "agent.interfaces=[]",
              "--set", f"agent.nodeSelector.kubernetes\\.io/hostname={NODE}",
              "--set", f"agent.metricsPort={free_port(host=nodes.node_ip(0))}"]
    # Safety first: the agent's own interface list is empty (it attaches only where probes say).
    out = stack.helm("template", RELEASE, str(CHART), "-n", RELEASE_NS, *image_values(stack.images),
                     *stack.extra_values, *values).stdout
    (ds,) = [d for d in yaml.safe_load_all(out) if d and d.get("kind") == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert "--interfaces=" in container["command"], container["command"]
    assert f"--probe-configmap={RELEASE_NS}/{contract.CONFIG_CONFIGMAP_NAME}" in container["command"]
    stack.install(*values)
    pod = wait_for(lambda: next((p for p in stack.pods(RELEASE_NS, AGENT_LABELS) if _ready(p)), None),
                   what="agent pod Ready", timeout_s=180, interval_s=0.5)
    try:
        yield pod
    finally:
        stack.install("--set", "agent.enabled=false")  # SIGTERM with its DaemonSet gone: detaches


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or [])


def apply_probe(stack: Stack, name: str, interfaces: list[str], mode: str = "auto") -> None:
    body = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "TelemetryProbe",
            "metadata": {"name": name, "namespace": RELEASE_NS},
            "spec": {"interfaces": interfaces, "xdpMode": mode, "nodeSelector": {"kubernetes.io/hostname": NODE}}}
    stack.kubectl("apply", "-f", "-", input=json.dumps(body))


def probe_status(stack: Stack, name: str) -> dict[str, Any]:
    return stack.get("telemetryprobe", name, RELEASE_NS).get("status") or {}


def argo_health(stack: Stack, name: str) -> tuple[str, str]:
    """The chart's Argo CD health check (Lua, as Argo CD runs it) on the live probe."""
    import lupa

    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(stack.get("telemetryprobe", name, RELEASE_NS), recursive=True)
    hs = lua.execute((CHART / "health" / "sparsegate.dev" / "TelemetryProbe" / "health.lua").read_text())
    return hs["status"], hs["message"]


def condition(status: dict, type_: str) -> tuple[str | None, str | None, str]:
    c = next((c for c in status.get("conditions") or [] if c["type"] == type_), {})
    return c.get("status"), c.get("reason"), c.get("message", "")


def wait_status(stack: Stack, name: str, what: str, pred: Callable[[dict], bool], agent_pod: dict,
                timeout_s: float = 120) -> dict:
    try:
        return wait_for(lambda: (st := probe_status(stack, name)) and pred(st) and st, what=what,
                        timeout_s=timeout_s, interval_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nstatus: {probe_status(stack, name)}\nagent:\n"
                             f"{stack.logs(agent_pod, 'agent', lines=60)}\n"
                             f"operator:\n{stack.logs(stack.operator_pods()[0], 'operator', lines=60)}") from None


def test_probe_attaches_moves_reports_conflicts_and_detaches(stack: Stack, agent: dict,
                                                             veths: tuple[HostVeth, HostVeth]) -> None:
    first, second = veths
    assert first.xdp() is None and second.xdp() is None  # nothing until a probe selects the node

    # Given a probe on the first veth: attached there, and the status says so with the program id.
    t0 = time.monotonic()
    apply_probe(stack, "veths", [first.host_if])
    status = wait_status(stack, "veths", "probe Ready on the first veth", lambda st: condition(st, "Ready")[0] == "True"
                         and st.get("attachedNodes") == 1, agent)
    log(f"probe applied -> agent attached and probe Ready {time.monotonic() - t0:.1f}s")
    prog = first.xdp()
    assert prog and prog["prog"]["name"] == "xdp_flow", prog
    assert status["attachments"] == [{"node": NODE, "interface": first.host_if, "mode": XDP_MODES[prog["mode"]],
                                      "programId": prog["prog"]["id"]}]
    assert status["observedGeneration"] == 1
    assert condition(status, "Reconciling")[0] == "False" and condition(status, "Stalled")[0] == "False"
    assert argo_health(stack, "veths") == ("Healthy", condition(status, "Ready")[2])  # "attached on 1 node(s)"
    config = json.loads(stack.get("configmap", contract.CONFIG_CONFIGMAP_NAME, RELEASE_NS)["data"][NODE])
    assert contract.parse_node_config(json.dumps(config)).modes() == {first.host_if: "auto"}

    # When its interface changes: the first veth is detached, the second attached.
    t0 = time.monotonic()
    apply_probe(stack, "veths", [second.host_if])
    status = wait_status(stack, "veths", "probe Ready on the second veth",
                         lambda st: st.get("observedGeneration") == 2 and condition(st, "Ready")[0] == "True"
                         and [a["interface"] for a in st.get("attachments") or []] == [second.host_if], agent)
    log(f"interface changed -> moved and Ready {time.monotonic() - t0:.1f}s")
    assert first.xdp() is None
    assert second.xdp()["prog"]["id"] == prog["prog"]["id"]  # the same loaded program, moved

    # A younger probe asking the same interface in another mode: Stalled, the older one holds it.
    mode = "generic" if status["attachments"][0]["mode"] == "native" else "native"
    apply_probe(stack, "conflicting", [second.host_if], mode=mode)
    conflict = wait_status(stack, "conflicting", "the younger probe Stalled",
                           lambda st: condition(st, "Stalled")[0] == "True", agent)
    st, reason, message = condition(conflict, "Stalled")
    assert reason == "XdpModeConflict" and NODE in message and second.host_if in message
    assert argo_health(stack, "conflicting") == ("Degraded", message)
    assert f"{RELEASE_NS}/veths" in message
    assert condition(probe_status(stack, "veths"), "Ready")[0] == "True" and second.xdp()
    stack.kubectl("delete", "telemetryprobe", "conflicting", "-n", RELEASE_NS)

    # An interface this node lacks: Stalled AttachFailed naming node and interface; the other stays.
    apply_probe(stack, "veths", [second.host_if, "sgnosuch0"])
    status = wait_status(stack, "veths", "AttachFailed for the missing interface",
                         lambda st: st.get("observedGeneration") == 3 and condition(st, "Stalled")[1] == "AttachFailed",
                         agent)
    assert condition(status, "Stalled")[2] == f"node {NODE}: sgnosuch0: interface sgnosuch0 does not exist on this node"
    assert status["attachedNodes"] == 0 and second.xdp()

    # Deleting the probe: the node has no configuration any more, and the agent detaches.
    t0 = time.monotonic()
    stack.kubectl("delete", "telemetryprobe", "veths", "-n", RELEASE_NS)
    wait_for(lambda: second.xdp() is None, what="the second veth detached", timeout_s=60, interval_s=0.5)
    log(f"probe deleted -> detached {time.monotonic() - t0:.1f}s")
    data = stack.get("configmap", contract.CONFIG_CONFIGMAP_NAME, RELEASE_NS).get("data") or {}
    assert NODE not in data
    reports = stack.get("configmap", contract.REPORT_CONFIGMAP_NAME, RELEASE_NS)["data"]
    wait_for(lambda: contract.parse_report(stack.get("configmap", contract.REPORT_CONFIGMAP_NAME, RELEASE_NS)
                                           ["data"][NODE]).config_version is None,
             what="the agent reporting no probe configuration", timeout_s=30, interval_s=0.5)
    assert NODE in reports
