"""TelemetryProbe domain: node matching, merging, xdpMode conflicts, status from agent reports."""
from __future__ import annotations

import json
import re

import pytest
from sparsegate_contracts import probes as contract

from sparsegate.domain.telemetry_probe import (
    NodeInfo,
    ProbeSource,
    node_info,
    observe,
    plan,
    probe_source,
    selects,
    stale_report_keys,
    status_patch,
)

NOW = "2026-12-03T18:00:00Z"


def probe(name: str, interfaces: list[str], *, mode: str = "auto", selector: dict | None = None,
          created: str = "2026-12-03T10:00:00Z", generation: int = 1) -> ProbeSource:
    return probe_source({"metadata": {"namespace": "ns", "name": name, "generation": generation,
                                      "creationTimestamp": created},
                         "spec": {"interfaces": interfaces, "xdpMode": mode, "nodeSelector": selector or {}}})


GPU = node_info({"metadata": {"name": "gpu-0", "labels": {"gpu": "true", "zone": "a"}}})
CPU = node_info({"metadata": {"name": "cpu-0", "labels": {"zone": "a"}}})


def report(node: str, version: str | None, interfaces: dict[str, str | None], *, error: str | None = None,
           prog: int = 7) -> contract.NodeReport:
    return contract.NodeReport(node=node, config_version=version, program_id=prog, interfaces=tuple(
        contract.InterfaceReport(name=i, mode=m, error=None if m else error) for i, m in interfaces.items()))


def conditions(status: dict) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}


def test_node_selector_matches_every_label_and_empty_matches_all() -> None:
    assert selects(probe("p", ["eth0"]), CPU) and selects(probe("p", ["eth0"]), GPU)
    assert selects(probe("p", ["eth0"], selector={"gpu": "true"}), GPU)
    assert not selects(probe("p", ["eth0"], selector={"gpu": "true"}), CPU)
    assert not selects(probe("p", ["eth0"], selector={"gpu": "true", "zone": "b"}), GPU)


def test_plan_gives_each_node_the_interfaces_of_the_probes_selecting_it() -> None:
    p = plan(probes=[probe("all", ["eth0"]), probe("gpu", ["ib0", "eth0"], selector={"gpu": "true"})],
             nodes=[GPU, CPU, NodeInfo(name="other", labels=(("zone", "b"),))])
    assert set(p.configs) == {"gpu-0", "cpu-0", "other"}
    gpu = contract.parse_node_config(contract.document_text(p.configs["gpu-0"]))
    assert gpu.modes() == {"eth0": "auto", "ib0": "auto"}
    # Same mode on eth0: shared, both probes listed (oldest first).
    assert {i.name: i.probes for i in gpu.interfaces}["eth0"] == ("ns/all", "ns/gpu")
    assert contract.parse_node_config(json.dumps(p.configs["cpu-0"])).modes() == {"eth0": "auto"}
    assert p.selected["ns/gpu"] == {"gpu-0": ("ib0", "eth0")}
    assert p.conflicts == {"ns/all": [], "ns/gpu": []}


def test_no_probe_selecting_a_node_leaves_it_without_a_key() -> None:
    p = plan(probes=[probe("gpu", ["ib0"], selector={"gpu": "true"})], nodes=[GPU, CPU])
    assert set(p.configs) == {"gpu-0"}  # cpu-0 keeps its agent's --interfaces
    assert plan(probes=[], nodes=[GPU]).configs == {}


def test_versions_are_stable_and_follow_content() -> None:
    a = plan(probes=[probe("p", ["eth0", "eth1"])], nodes=[CPU]).configs["cpu-0"]
    b = plan(probes=[probe("p", ["eth1", "eth0"])], nodes=[CPU]).configs["cpu-0"]
    c = plan(probes=[probe("p", ["eth0"], mode="generic")], nodes=[CPU]).configs["cpu-0"]
    assert a == b and a["version"] != c["version"]
    assert contract.parse_node_config(contract.document_text(a)).version == a["version"]


def test_different_xdp_modes_on_one_interface_the_older_probe_holds_it() -> None:
    old = probe("old", ["eth0"], mode="native", created="2026-12-03T09:00:00Z")
    young = probe("young", ["eth0", "eth1"], mode="generic", created="2026-12-03T11:00:00Z")
    for order in ([old, young], [young, old]):  # listing order does not matter, age does
        p = plan(probes=order, nodes=[CPU])
        assert contract.parse_node_config(json.dumps(p.configs["cpu-0"])).modes() == {"eth0": "native",
                                                                                      "eth1": "generic"}
        assert p.conflicts["ns/old"] == []
        (conflict,) = p.conflicts["ns/young"]
        assert (conflict.node, conflict.interface, conflict.held_by) == ("cpu-0", "eth0", "ns/old")
        assert p.selected["ns/young"] == {"cpu-0": ("eth1",)}
    status = status_patch(probe=young, observation=observe(probe=young, plan=p, reports={}), previous=None, now=NOW)
    st, reason, msg = conditions(status)["Stalled"]
    assert (st, reason) == ("True", "XdpModeConflict")
    assert "cpu-0" in msg and "eth0" in msg and "ns/old" in msg
    assert conditions(status)["Ready"][0] == "False" and conditions(status)["Reconciling"][0] == "False"


def test_status_waits_for_reports_of_the_current_configuration() -> None:
    pr = probe("p", ["eth0"], generation=3)
    p = plan(probes=[pr], nodes=[GPU, CPU])
    version = p.configs["gpu-0"]["version"]
    reports = {"gpu-0": report("gpu-0", version, {"eth0": "native"}),
               "cpu-0": report("cpu-0", "sha256:older", {"eth0": "generic"})}
    status = status_patch(probe=pr, observation=observe(probe=pr, plan=p, reports=reports), previous=None, now=NOW)
    assert status["observedGeneration"] == 3 and status["attachedNodes"] == 1
    assert status["attachments"] == [{"node": "gpu-0", "interface": "eth0", "mode": "native", "programId": 7}]
    c = conditions(status)
    assert c["Ready"][:2] == ("False", "AwaitingAgents") and "cpu-0" in c["Ready"][2]
    assert c["Reconciling"][0] == "True" and c["Stalled"][0] == "False"

    reports["cpu-0"] = report("cpu-0", version, {"eth0": "generic"}, prog=9)
    later = status_patch(probe=pr, observation=observe(probe=pr, plan=p, reports=reports), previous=status,
                         now="2026-12-03T18:01:00Z")
    assert later["attachedNodes"] == 2
    c = conditions(later)
    assert c["Ready"] == ("True", "Attached", "attached on 2 node(s)")
    assert c["Reconciling"][0] == "False" and c["Stalled"][0] == "False"
    times = {x["type"]: x["lastTransitionTime"] for x in later["conditions"]}
    assert times["Stalled"] == NOW and times["Ready"] == "2026-12-03T18:01:00Z"  # moved only on change


def test_an_agent_attach_error_is_stalled_with_node_and_error() -> None:
    pr = probe("p", ["eth9"])
    p = plan(probes=[pr], nodes=[CPU])
    reports = {"cpu-0": report("cpu-0", p.configs["cpu-0"]["version"], {"eth9": None},
                               error="cannot attach XDP to eth9: no such device")}
    status = status_patch(probe=pr, observation=observe(probe=pr, plan=p, reports=reports), previous=None, now=NOW)
    st, reason, msg = conditions(status)["Stalled"]
    assert (st, reason) == ("True", "AttachFailed")
    assert msg == "node cpu-0: eth9: cannot attach XDP to eth9: no such device"
    assert status["attachedNodes"] == 0 and conditions(status)["Ready"][0] == "False"


def test_an_interface_attached_in_another_mode_than_asked_is_stalled_not_ready() -> None:
    """The driver refused native: the agent kept the program in the mode it ran in (generic) and
    reports the error beside the mode. The probe was Ready as if attached as asked."""
    pr = probe("p", ["eth0"], mode="native")
    p = plan(probes=[pr], nodes=[CPU])
    reports = {"cpu-0": contract.NodeReport(node="cpu-0", config_version=p.configs["cpu-0"]["version"], program_id=7,
                                            interfaces=(contract.InterfaceReport(
                                                name="eth0", mode="generic",
                                                error="native: Operation not supported"),))}
    status = status_patch(probe=pr, observation=observe(probe=pr, plan=p, reports=reports), previous=None, now=NOW)
    st, reason, msg = conditions(status)["Stalled"]
    assert (st, reason) == ("True", "AttachFailed")
    assert msg == "node cpu-0: eth0: attached generic, not as asked: native: Operation not supported"
    assert status["attachedNodes"] == 0 and conditions(status)["Ready"][0] == "False"
    assert status["attachments"] == [{"node": "cpu-0", "interface": "eth0", "mode": "generic", "programId": 7}]


def test_a_probe_selecting_no_node_is_ready_with_zero_nodes() -> None:
    pr = probe("p", ["eth0"], selector={"gpu": "true"})
    status = status_patch(probe=pr, observation=observe(probe=pr, plan=plan(probes=[pr], nodes=[CPU]), reports={}),
                          previous=None, now=NOW)
    assert status["attachedNodes"] == 0
    assert conditions(status)["Ready"][:2] == ("True", "NoNodesSelected")


@pytest.mark.parametrize("text, field", [
    ('{"interfaces": "eth0"}', "interfaces"),
    ('{"interfaces": [{"name": "eth0/1"}]}', "interfaces[0].name"),
    ('{"interfaces": [{"name": "an-interface-name-too-long"}]}', "interfaces[0].name"),
    ('{"interfaces": [{"name": "eth0", "xdpMode": "fast"}]}', "interfaces[0].xdpMode"),
    ('{"interfaces": [{"name": "eth0"}, {"name": "eth0"}]}', "interfaces[1].name"),
    ("[1]", "document"),
])
def test_invalid_node_configuration_names_the_field(text: str, field: str) -> None:
    with pytest.raises(contract.ProbeDocumentError, match="^" + re.escape(field) + ":"):
        contract.parse_node_config(text)


@pytest.mark.parametrize("doc, field", [
    ({"configVersion": None, "programId": 1, "interfaces": []}, "node"),
    ({"node": "n", "programId": -1, "interfaces": []}, "programId"),
    ({"node": "n", "interfaces": [{"name": "eth0", "mode": "auto"}]}, "interfaces[0].mode"),
    ({"node": "n", "interfaces": [{"name": "eth0", "mode": None, "error": 3}]}, "interfaces[0].error"),
])
def test_invalid_report_names_the_field(doc: dict, field: str) -> None:
    with pytest.raises(contract.ProbeDocumentError, match="^" + re.escape(field) + ":"):
        contract.parse_report(json.dumps(doc))


def test_report_round_trips() -> None:
    r = report("n", "sha256:x", {"eth1": "generic", "eth0": None}, error="boom")
    assert contract.parse_report(contract.report_text(r)) == contract.NodeReport(
        node="n", config_version="sha256:x", program_id=7,
        interfaces=(contract.InterfaceReport("eth0", None, "boom"), contract.InterfaceReport("eth1", "generic")))


def test_stale_report_keys_are_those_of_nodes_not_in_the_list_just_read() -> None:
    """Agents only add their own key: the operator drops the keys of nodes that left (else the
    ConfigMap grows with every node name ever seen, up to the 1 MiB object limit)."""
    keys = ["gone-1", "cpu-0", "gone-0", "new-0"]
    assert stale_report_keys(report_keys=keys, nodes=["cpu-0", "new-0", "no-report"]) == ["gone-0", "gone-1"]
    assert stale_report_keys(report_keys=keys, nodes=keys) == []
    assert stale_report_keys(report_keys=[], nodes=[]) == []
