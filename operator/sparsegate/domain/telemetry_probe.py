"""TelemetryProbes → per-node agent configuration, and each probe's status from the agents' reports (pure).

Matching: a probe selects a node when every ``spec.nodeSelector`` label is on the node with that
value (empty: every node). Merging, per node: the interfaces of every selecting probe, each with
its probe's ``xdpMode``. Probes are taken oldest first (creationTimestamp, then namespace/name), so
an interface asked by two probes with the same mode is shared (both are listed on it); asked with
different modes, the older probe's mode holds and the younger probe gets a conflict (its Stalled
condition names the node, the interface and the probe that holds it). Nothing else is refused.

Status of a probe (kstatus conditions, as RoutingPolicy and SparseModel write them):
- Ready: every node it selects has an agent report for the node's current configuration, with
  each of the probe's interfaces attached (``attachedNodes`` counts those nodes).
- Reconciling: not Ready, not Stalled: some selected node's agent has not reported the current
  configuration yet (no agent there yet, or it is attaching).
- Stalled: an xdpMode conflict, or an agent reported an error attaching one of the probe's
  interfaces (the message names node, interface and error; the agent retries on its own).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any

from sparsegate_contracts.probes import CONFIG_MAX_BYTES, InterfaceConfig, NodeReport, build_node_config, document_text

from sparsegate.domain.conditions import merge_conditions

MAX_LISTED = 256  # status.attachments entries kept (attachedNodes always counts every node)
MAX_MESSAGE_ITEMS = 5  # nodes/errors named in one condition message


@dataclasses.dataclass(frozen=True)
class ProbeSource:
    namespace: str
    name: str
    generation: int
    created: str  # metadata.creationTimestamp (RFC 3339: sorts as text)
    interfaces: tuple[str, ...]
    xdp_mode: str = "auto"
    node_selector: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def probe_source(body: Mapping[str, Any]) -> ProbeSource:
    """From a TelemetryProbe object (the API server validated its spec)."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    return ProbeSource(
        namespace=meta.get("namespace", ""), name=meta.get("name", ""), generation=int(meta.get("generation") or 1),
        created=str(meta.get("creationTimestamp") or ""),
        interfaces=tuple(dict.fromkeys(spec.get("interfaces") or ())),
        xdp_mode=spec.get("xdpMode") or "auto",
        node_selector=tuple(sorted((spec.get("nodeSelector") or {}).items())),
    )


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    name: str
    labels: tuple[tuple[str, str], ...] = ()


def node_info(body: Mapping[str, Any]) -> NodeInfo:
    meta = body.get("metadata") or {}
    return NodeInfo(name=meta.get("name", ""), labels=tuple(sorted((meta.get("labels") or {}).items())))


def selects(probe: ProbeSource, node: NodeInfo) -> bool:
    labels = dict(node.labels)
    return all(labels.get(k) == v for k, v in probe.node_selector)


@dataclasses.dataclass(frozen=True)
class Conflict:
    node: str
    interface: str
    asked: str  # this probe's xdpMode
    held_by: str  # the older probe whose mode holds
    held_mode: str

    def message(self) -> str:
        return (f"node {self.node}: interface {self.interface} xdpMode {self.asked} conflicts with "
                f"{self.held_by} ({self.held_mode}, older, holds it)")


@dataclasses.dataclass
class Plan:
    configs: dict[str, dict[str, Any]]  # node -> configuration document (contracts.probes)
    selected: dict[str, dict[str, tuple[str, ...]]]  # probe key -> node -> its interfaces attached there
    conflicts: dict[str, list[Conflict]]  # probe key -> conflicts (it lost)
    config_bytes: int = 0  # the configuration ConfigMap's data: node names and documents

    @property
    def too_large(self) -> str | None:
        """Why the configuration cannot be published (None: it fits one ConfigMap)."""
        if self.config_bytes <= CONFIG_MAX_BYTES:
            return None
        return (f"the per-node configuration of every probe is {self.config_bytes} bytes for {len(self.configs)} "
                f"node(s), over the {CONFIG_MAX_BYTES} a ConfigMap holds: not published (agents keep the last "
                f"one); select fewer nodes or interfaces")


def _order(probes: Iterable[ProbeSource]) -> list[ProbeSource]:
    return sorted(probes, key=lambda p: (p.created, p.namespace, p.name))


def plan(*, probes: Iterable[ProbeSource], nodes: Iterable[NodeInfo]) -> Plan:
    ordered = _order(probes)
    configs: dict[str, dict[str, Any]] = {}
    selected: dict[str, dict[str, tuple[str, ...]]] = {p.key: {} for p in ordered}
    conflicts: dict[str, list[Conflict]] = {p.key: [] for p in ordered}
    for node in sorted(nodes, key=lambda n: n.name):
        held: dict[str, tuple[str, list[str]]] = {}  # interface -> (mode, probes)
        for probe in ordered:
            if not selects(probe, node):
                continue
            mine = []
            for ifname in probe.interfaces:
                if ifname not in held:
                    held[ifname] = (probe.xdp_mode, [probe.key])
                elif held[ifname][0] == probe.xdp_mode:
                    held[ifname][1].append(probe.key)
                else:
                    conflicts[probe.key].append(Conflict(node=node.name, interface=ifname, asked=probe.xdp_mode,
                                                         held_by=held[ifname][1][0], held_mode=held[ifname][0]))
                    continue
                mine.append(ifname)
            selected[probe.key][node.name] = tuple(mine)
        if held:
            configs[node.name] = build_node_config(
                InterfaceConfig(name=i, xdp_mode=m, probes=tuple(ps)) for i, (m, ps) in held.items())
    size = sum(len(node.encode()) + len(document_text(doc).encode()) for node, doc in configs.items())
    return Plan(configs=configs, selected=selected, conflicts=conflicts, config_bytes=size)


def stale_report_keys(*, report_keys: Iterable[str], nodes: Iterable[str]) -> list[str]:
    """Report keys (node names) of nodes not in ``nodes``, sorted: the ones to drop.

    Agents only ever add their own key, so without this the report ConfigMap keeps every node name a
    cluster has had and, with autoscaler churn, reaches the 1 MiB object limit, after which no new
    node's agent can report. ``nodes`` must be the node list read just now: a node it holds keeps its
    key (even with no probe on it), so a new node is never dropped once the operator has seen it.
    """
    known = set(nodes)
    return sorted({key for key in report_keys if key not in known})


class ConditionType(str, enum.Enum):
    READY = "Ready"
    """Every selected node's agent reports this probe's interfaces attached for its current configuration."""
    RECONCILING = "Reconciling"
    """kstatus: not Ready, not Stalled; waiting for agents to apply and report the configuration."""
    STALLED = "Stalled"
    """kstatus: an xdpMode conflict with an older probe, or an agent's attach error on one of its interfaces."""


class Reason(str, enum.Enum):
    ATTACHED = "Attached"
    """Ready=True: attached on every selected node."""
    NO_NODES = "NoNodesSelected"
    """Ready=True: no node matches the nodeSelector (nothing to attach)."""
    AWAITING_AGENTS = "AwaitingAgents"
    """Ready=False / Reconciling=True: some selected node's agent has not reported the current configuration."""
    XDP_MODE_CONFLICT = "XdpModeConflict"
    """Stalled=True: an older probe holds one of its interfaces on a node with another xdpMode."""
    ATTACH_FAILED = "AttachFailed"
    """Stalled=True: an agent reported an error attaching one of its interfaces."""
    CONFIGURATION_TOO_LARGE = "ConfigurationTooLarge"
    """Stalled=True: the configuration of every probe on every node would not fit its ConfigMap, so
    nothing is published until it shrinks."""
    AS_EXPECTED = "AsExpected"
    """Stalled=False / Reconciling=False."""


@dataclasses.dataclass(frozen=True)
class ProbeObservation:
    attachments: tuple[dict[str, Any], ...]  # {node, interface, mode, programId}
    attached_nodes: int
    pending: tuple[str, ...]  # selected nodes without a report of the current configuration
    errors: tuple[str, ...]  # "node n: eth7: <error>"
    conflicts: tuple[Conflict, ...]
    selected_nodes: int = 0  # nodes its nodeSelector matches
    too_large: str | None = None  # Plan.too_large: nothing is published


def observe(*, probe: ProbeSource, plan: Plan, reports: Mapping[str, NodeReport]) -> ProbeObservation:
    attachments: list[dict[str, Any]] = []
    pending, errors = [], []
    attached_nodes = 0
    for node, interfaces in sorted(plan.selected.get(probe.key, {}).items()):
        config = plan.configs.get(node)
        report = reports.get(node)
        if not interfaces:
            continue  # everything it asked for here is held by an older probe (a conflict)
        if config is None or report is None or report.config_version != config["version"]:
            pending.append(node)
            continue
        ok = True
        for ifname in interfaces:
            item = report.interface(ifname)
            if item is None or item.mode is None:
                ok = False
                errors.append(f"node {node}: {ifname}: {(item.error if item else None) or 'not attached'}")
                continue
            attachments.append({"node": node, "interface": ifname, "mode": item.mode,
                                "programId": report.program_id})
            if item.error:
                # Attached, but not as asked: the agent put the program back in the mode it ran in
                # after the driver refused the probe's (native on a NIC without it).
                ok = False
                errors.append(f"node {node}: {ifname}: attached {item.mode}, not as asked: {item.error}")
        attached_nodes += ok
    return ProbeObservation(attachments=tuple(attachments), attached_nodes=attached_nodes, pending=tuple(pending),
                            errors=tuple(errors), conflicts=tuple(plan.conflicts.get(probe.key, ())),
                            selected_nodes=len(plan.selected.get(probe.key, {})), too_large=plan.too_large)


def _listed(items: list[str], what: str) -> str:
    more = len(items) - MAX_MESSAGE_ITEMS
    return "; ".join(items[:MAX_MESSAGE_ITEMS]) + (f" (and {more} more {what})" if more > 0 else "")


def _condition(type_: ConditionType, status: bool, reason: Reason, message: str) -> dict[str, Any]:
    return {"type": type_.value, "status": "True" if status else "False", "reason": reason.value, "message": message}


def status_patch(*, probe: ProbeSource, observation: ProbeObservation, previous: Mapping[str, Any] | None,
                 now: str) -> dict[str, Any]:
    """The `status` to write; lastTransitionTime moves only when a condition's status changes."""
    previous = previous or {}
    o = observation
    stalled_msgs = [*([o.too_large] if o.too_large else []), *(c.message() for c in o.conflicts), *o.errors]
    if stalled_msgs:
        reason = (Reason.CONFIGURATION_TOO_LARGE if o.too_large else
                  Reason.XDP_MODE_CONFLICT if o.conflicts else Reason.ATTACH_FAILED)
        stalled = _condition(ConditionType.STALLED, True, reason, _listed(stalled_msgs, "problems"))
    else:
        stalled = _condition(ConditionType.STALLED, False, Reason.AS_EXPECTED, "no conflict or attach error")
    if o.too_large:
        ready = _condition(ConditionType.READY, False, Reason.CONFIGURATION_TOO_LARGE, stalled["message"])
    elif o.pending:
        msg = f"waiting for the agents of {len(o.pending)} node(s) to report: {_listed(list(o.pending), 'nodes')}"
        ready = _condition(ConditionType.READY, False, Reason.AWAITING_AGENTS, msg)
    elif stalled_msgs:
        ready = _condition(ConditionType.READY, False, Reason(stalled["reason"]), stalled["message"])
    elif o.selected_nodes == 0:
        ready = _condition(ConditionType.READY, True, Reason.NO_NODES, "no node matches spec.nodeSelector")
    else:
        ready = _condition(ConditionType.READY, True, Reason.ATTACHED, f"attached on {o.attached_nodes} node(s)")
    reconciling = bool(o.pending) and not stalled_msgs
    conditions = [
        ready,
        _condition(ConditionType.RECONCILING, reconciling, Reason.AWAITING_AGENTS if reconciling else Reason.AS_EXPECTED,
                   ready["message"] if reconciling else "nothing to wait for"),
        stalled,
    ]
    return {
        "observedGeneration": probe.generation,
        "attachedNodes": o.attached_nodes,
        "attachments": list(o.attachments[:MAX_LISTED]),
        "conditions": merge_conditions(previous.get("conditions") or (), conditions, now=now,
                                       observed_generation=probe.generation,
                                       order=[t.value for t in ConditionType]),
    }


def status_changed(*, previous: Mapping[str, Any] | None, patch: Mapping[str, Any]) -> bool:
    previous = previous or {}
    return any(previous.get(k) != v for k, v in patch.items())
