"""Per-node XDP attachment: the operator's configuration for each agent, and each agent's report.

Two ConfigMaps in the operator's (release) namespace, each keyed by node name:

``sparsegate-probe-config`` (written by the operator from TelemetryProbes, read by the agents)::

    data[<node>] = {"version": "sha256:...",
                    "interfaces": [{"name": "eth0", "xdpMode": "auto"|"native"|"generic",
                                    "probes": ["ns/name", ...]}]}

A node without a key is selected by no TelemetryProbe: its agent attaches to its own
``--interfaces`` (the chart's ``agent.interfaces``). A node with a key attaches to exactly the
interfaces listed there (a probe overrides the chart default on the nodes it selects).
``version`` = ``canonical.sha256_of`` of the document without ``version``.

``sparsegate-probe-reports`` (each agent merge-patches its own key, the operator reads)::

    data[<node>] = {"node": "<node>", "configVersion": "sha256:..." | null,
                    "programId": 42 | null,
                    "interfaces": [{"name": "eth0", "mode": "native"|"generic"|null,
                                    "error": "..."|null}]}

``configVersion``: the version of the configuration the agent last applied (null: it runs on its
``--interfaces``, no probe configuration for its node). ``mode`` is the mode actually attached
(null with an ``error``). ``programId``: the kernel's id of the agent's loaded XDP program.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sparsegate_contracts.canonical import canonical_json, sha256_of

CONFIG_CONFIGMAP_NAME = "sparsegate-probe-config"
REPORT_CONFIGMAP_NAME = "sparsegate-probe-reports"
# The configuration ConfigMap holds every node's document: its data must stay under the API
# server's 1 MiB object limit, less headroom for the object's metadata.
CONFIG_MAX_BYTES = 1024 * 1024 - 64 * 1024
XDP_MODES = ("auto", "native", "generic")
ATTACHED_MODES = ("native", "generic")
# The interface-name rule of the TelemetryProbe CRD (and of the kernel: IFNAMSIZ - 1 bytes).
MAX_IFNAME = 15
ERROR_MAX = 500  # bytes of one interface's error message kept in a report


class ProbeDocumentError(ValueError):
    """A configuration or report document that does not follow this contract (names the field)."""


@dataclass(frozen=True)
class InterfaceConfig:
    name: str
    xdp_mode: str
    probes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "xdpMode": self.xdp_mode, "probes": list(self.probes)}


@dataclass(frozen=True)
class NodeConfig:
    version: str
    interfaces: tuple[InterfaceConfig, ...]

    def modes(self) -> dict[str, str]:
        """Interface name -> requested XDP mode."""
        return {i.name: i.xdp_mode for i in self.interfaces}


def build_node_config(interfaces: Iterable[InterfaceConfig]) -> dict[str, Any]:
    """The configuration document for one node, interfaces sorted by name, with its version."""
    body = {"interfaces": [i.to_json() for i in sorted(interfaces, key=lambda i: i.name)]}
    return {"version": sha256_of(body), **body}


def document_text(document: Mapping[str, Any]) -> str:
    return canonical_json(dict(document))


def _require(cond: bool, field: str, problem: str) -> None:
    if not cond:
        raise ProbeDocumentError(f"{field}: {problem}")


def is_ifname(value: Any) -> bool:
    """Whether Linux takes ``value`` as a network interface name (the kernel's dev_valid_name):
    1-15 bytes, not '.' or '..', no '/', ':', whitespace or NUL."""
    return (isinstance(value, str) and 0 < len(value.encode()) <= MAX_IFNAME and value not in (".", "..")
            and not any(c in "/:\0" or c.isspace() for c in value))


def _ifname(value: Any, field: str) -> str:
    # Looser than is_ifname on purpose: a probe stored before the CRD refused '.', '..' and ':' is
    # still served (the API server keeps it), and one such name must not make the agent drop its
    # node's whole document; the agent refuses that interface alone (AttachFailed names it).
    _require(isinstance(value, str) and 0 < len(value) <= MAX_IFNAME and "/" not in value
             and not any(c.isspace() for c in value), field, f"must be an interface name (1-{MAX_IFNAME} "
             f"characters, no '/' or space), got {value!r}")
    return value


def parse_node_config(text: str) -> NodeConfig:
    """Validate one node's configuration document; raises ProbeDocumentError naming the field."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ProbeDocumentError(f"not JSON: {exc}") from exc
    _require(isinstance(doc, dict), "document", "must be a JSON object")
    items = doc.get("interfaces")
    _require(isinstance(items, list), "interfaces", "must be a list")
    seen: set[str] = set()
    out = []
    for n, item in enumerate(items):
        field = f"interfaces[{n}]"
        _require(isinstance(item, dict), field, "must be an object")
        name = _ifname(item.get("name"), f"{field}.name")
        _require(name not in seen, f"{field}.name", f"{name!r} listed twice")
        seen.add(name)
        mode = item.get("xdpMode", "auto")
        _require(mode in XDP_MODES, f"{field}.xdpMode", f"must be one of {', '.join(XDP_MODES)}, got {mode!r}")
        probes = item.get("probes", [])
        _require(isinstance(probes, list) and all(isinstance(p, str) for p in probes), f"{field}.probes",
                 "must be a list of strings")
        out.append(InterfaceConfig(name=name, xdp_mode=mode, probes=tuple(probes)))
    body = {"interfaces": [i.to_json() for i in sorted(out, key=lambda i: i.name)]}
    version = doc.get("version") or sha256_of(body)
    _require(isinstance(version, str), "version", "must be a string")
    return NodeConfig(version=version, interfaces=tuple(sorted(out, key=lambda i: i.name)))


@dataclass(frozen=True)
class InterfaceReport:
    name: str
    mode: str | None  # attached mode; None when not attached
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "mode": self.mode, "error": self.error}


@dataclass(frozen=True)
class NodeReport:
    node: str
    config_version: str | None
    program_id: int | None
    interfaces: tuple[InterfaceReport, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "configVersion": self.config_version, "programId": self.program_id,
                "interfaces": [i.to_json() for i in sorted(self.interfaces, key=lambda i: i.name)]}

    def interface(self, name: str) -> InterfaceReport | None:
        return next((i for i in self.interfaces if i.name == name), None)


def report_text(report: NodeReport) -> str:
    return canonical_json(report.to_json())


def parse_report(text: str) -> NodeReport:
    """Validate one agent's report; raises ProbeDocumentError naming the field."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ProbeDocumentError(f"not JSON: {exc}") from exc
    _require(isinstance(doc, dict), "report", "must be a JSON object")
    node = doc.get("node")
    _require(isinstance(node, str) and bool(node), "node", "must be a node name")
    version = doc.get("configVersion")
    _require(version is None or isinstance(version, str), "configVersion", "must be a string or null")
    prog = doc.get("programId")
    _require(prog is None or (isinstance(prog, int) and not isinstance(prog, bool) and prog >= 0), "programId",
             "must be a non-negative integer or null")
    items = doc.get("interfaces")
    _require(isinstance(items, list), "interfaces", "must be a list")
    out = []
    for n, item in enumerate(items):
        field = f"interfaces[{n}]"
        _require(isinstance(item, dict), field, "must be an object")
        name = _ifname(item.get("name"), f"{field}.name")
        mode, error = item.get("mode"), item.get("error")
        _require(mode is None or mode in ATTACHED_MODES, f"{field}.mode",
                 f"must be one of {', '.join(ATTACHED_MODES)} or null, got {mode!r}")
        _require(error is None or isinstance(error, str), f"{field}.error", "must be a string or null")
        out.append(InterfaceReport(name=name, mode=mode, error=error))
    return NodeReport(node=node, config_version=version, program_id=prog, interfaces=tuple(out))
