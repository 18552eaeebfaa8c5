"""Node agent: load the XDP program, attach it, export /metrics, follow the flow policy.

    python -m sparsegate_ebpf.agent --interfaces eth0[,..] --metrics-port 9102 \
        (--policy-file F | --policy-configmap NS/NAME) [--xdp-mode auto|native|generic] \
        [--enforcement off|audit|enforce] [--allow-sources IP,..] [--node-addresses auto|none] \
        [--initial-policy-timeout 30] [--on-exit detach|keep|daemonset --daemonset NS/NAME]
        [--probe-configmap NS/NAME | --probe-file F] [--probe-report-configmap NS/NAME | --probe-report-file F] \
        [--probe-report-heartbeat 600] [--node-name NODE] [--bpffs-dir /sys/fs/bpf/sparsegate]
    python -m sparsegate_ebpf.agent --version

Interfaces: --interfaces, unless a probe source is given and TelemetryProbes select this node
(--node-name, env NODE_NAME): then exactly the interfaces and XDP modes of the operator's
configuration for this node (sparsegate_contracts.probes; with --enforcement audit/enforce those as
well as --interfaces, which a namespaced probe must not take enforcement off), followed as it changes: interfaces no
longer asked for are detached, new ones attached, a changed mode re-attached. With a probe source an
interface that cannot be attached is reported (--probe-report-*) and retried every
--probe-interval seconds instead of ending the agent; without one, a failed attach at start exits 1 as
before, and --interfaces is applied again every --probe-interval (an interface re-created under its
name is attached again, one renamed detached).

Enforcement: `off` counts only (telemetry); `audit` judges every packet to a policed destination
and counts would-be drops (`sparsegate_xdp_policy_audit_drops_total`) without dropping; `enforce`
drops what the policy denies. Always allowed to policed destinations: --allow-sources, and with
--node-addresses auto the IPv4 and IPv6 addresses (IPv6 link-local ones and those of kube-proxy's
kube-ipvs0 excepted) of the agent's own network namespace (in a hostNetwork pod: the node's, so
kubelet probes pass), re-read whenever a policy document is applied.

A restart widens nothing (handover.py). With --enforcement enforce (in audit and off the program is
attached at once: it drops nothing): the first valid policy is written into the new program's
maps before it is attached, and the program replaces the one a previous agent left attached in one
step (known by its pins under --bpffs-dir, pins.py; by its name only with CAP_SYS_ADMIN). If no
valid policy arrives within --initial-policy-timeout, the policy that program still enforces is
carried over (inherit.py); with no such program (or one without a policy) the program is attached
anyway and passes everything until a policy arrives (counted as `no_policy`, logged,
and exported as `sparsegate_agent_attached_without_policy 1`): a node must not stay without
telemetry for ever.
On exit the program is detached (`--on-exit detach`, the default), left attached for a successor
(`keep`), or, in Kubernetes (`daemonset`), left attached unless the agent's DaemonSet is gone or
being deleted.
An invalid document is rejected and the live policy stays in force. With a ConfigMap source the
agent also watches RoutingPolicies (`--policy-liveness watch`, the default) and drops the allow
entries of deleted ones itself, so access ends with the policy even while the operator is down.
When BPF is unavailable (no bcc, not root, verifier refusal) the agent logs why, keeps
serving /metrics with `sparsegate_agent_bpf_available 0`, and exits 1 on SIGTERM.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from sparsegate_contracts import flowpolicy
from sparsegate_contracts.version import version_line

from sparsegate_contracts.probes import NodeConfig

from . import handover, inherit, pins, policysource, probesource, programs, xdp
from .attachments import Attachments
from .handover import ExitAction, OnExit, StartCollector, StartState
from .metrics import FLOW_IDLE_TIMEOUT, AgentState, XdpCollector
from .policy import PolicyError, parse_policy
from .policyswap import PolicySwapper
from .verdicts import POOL

log = logging.getLogger("sparsegate_ebpf.agent")
ENFORCEMENT_MODES = ("off", "audit", "enforce")
INHERITED = "inherited"  # sparsegate_xdp_policy_info{version} of a policy carried over from a predecessor


def _policy_records(text: str) -> int:
    try:
        return programs.check_policy_records(int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sparsegate_ebpf.agent", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=version_line("sparsegate_ebpf.agent"))
    ap.add_argument("--interfaces", required=True,
                    help="comma-separated interface names; with a probe source: those of nodes no TelemetryProbe "
                         "selects, and with enforcement on of every node (may then be empty: attach only "
                         "where probes say)")
    probe = ap.add_mutually_exclusive_group()
    probe.add_argument("--probe-configmap", metavar="NS/NAME",
                       help="follow this node's key of the operator's probe configuration ConfigMap")
    probe.add_argument("--probe-file", type=Path, help="follow this node's key of a JSON file {node: document}")
    report = ap.add_mutually_exclusive_group()
    report.add_argument("--probe-report-configmap", metavar="NS/NAME",
                        help="merge-patch this node's attach report into this ConfigMap (needs patch on it)")
    report.add_argument("--probe-report-file", type=Path, help="write this node's attach report to this file")
    ap.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""),
                    help="this node's name, the key of its probe configuration and report (env NODE_NAME)")
    ap.add_argument("--initial-probe-timeout", type=float, default=10.0, metavar="SECONDS",
                    help="with a probe source: wait this long for its first answer before attaching to "
                         "--interfaces (then follow it when it arrives)")
    ap.add_argument("--probe-interval", type=float, default=5.0, metavar="SECONDS",
                    help="retry failed attaches (and, with a probe source, re-send an unsent report) this often; "
                         "also how often --interfaces is checked for interfaces re-created or renamed")
    ap.add_argument("--probe-report-heartbeat", type=float, default=600.0, metavar="SECONDS",
                    help="re-send an unchanged report after this long (less up to 25%% jitter), so a report "
                         "key removed meanwhile comes back: one merge patch per node per interval; 0: never")
    ap.add_argument("--metrics-port", type=int, default=9102)
    ap.add_argument("--flow-idle-timeout", type=float, default=FLOW_IDLE_TIMEOUT, metavar="SECONDS",
                    help="stop exporting a flow's series once it has had no packet for this long (it stays in "
                         "the LRU table, and in its port's totals, until evicted; counted in "
                         "sparsegate_xdp_flows_idle_expired); 0: export every flow in the table")
    ap.add_argument("--metrics-addr", default="0.0.0.0")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--policy-file", type=Path)
    src.add_argument("--policy-configmap", metavar="NS/NAME",
                     help="watch this ConfigMap's policy.json; a sharded one (its shards NAME-0..NAME-15, "
                          "got by name) is applied only once every shard matches it")
    ap.add_argument("--xdp-mode", choices=[m.value for m in xdp.XdpMode], default="auto")
    ap.add_argument("--policy-map-records", type=_policy_records, default=flowpolicy.MAP_MAX_ENTRIES,
                    metavar="N", help="records per inner policy map (rules, policed destinations, source "
                    f"addresses; {flowpolicy.MAP_MIN_ENTRIES}..{flowpolicy.MAP_MAX_ENTRIES_LIMIT}, default "
                    f"%(default)s); not preallocated: memory follows the records written")
    ap.add_argument("--poll-interval", type=float, default=1.0, help="policy file poll period (s)")
    ap.add_argument("--telemetry-only", action="store_true", help="count, never drop (= --enforcement off)")
    ap.add_argument("--enforcement", choices=list(ENFORCEMENT_MODES), default=None,
                    help="off: telemetry only; audit: judge and count would-be drops, drop nothing; enforce: drop "
                         "what the policy denies (default: enforce, or off with --telemetry-only)")
    ap.add_argument("--allow-sources", default="",
                    help="comma-separated IPv4/IPv6 sources always allowed to policed destinations (e.g. the node IP)")
    ap.add_argument("--node-addresses", choices=["auto", "none"], default="auto",
                    help="auto: also always allow the IPv4 and IPv6 (not link-local) addresses of this network "
                         "namespace's interfaces but kube-ipvs0 "
                         "(the node's, in a hostNetwork pod), read when each policy document is applied")
    ap.add_argument("--policy-liveness", choices=["watch", "off"], default="watch",
                    help="with --policy-configmap: also watch RoutingPolicies and drop the allow entries of "
                         "deleted ones without waiting for the operator (needs list/watch on routingpolicies)")
    ap.add_argument("--policy-liveness-namespaces", default="",
                    help="comma-separated namespaces whose RoutingPolicies are watched (default: all)")
    ap.add_argument("--initial-policy-timeout", type=float, default=30.0, metavar="SECONDS",
                    help="with --enforcement enforce: wait this long for the first valid policy before "
                         "attaching XDP; then carry over the policy a predecessor's program still enforces, "
                         "or else attach anyway, passing everything until a policy arrives (logged, and "
                         "exported as sparsegate_agent_attached_without_policy). audit and off attach at "
                         "once")
    ap.add_argument("--on-exit", choices=[m.value for m in OnExit], default=OnExit.DETACH.value,
                    help="on SIGTERM: detach XDP; keep it attached (a restarted agent replaces it, and "
                         "the policy in force stays enforced meanwhile); or daemonset: keep it unless "
                         "the --daemonset is gone or being deleted, or the API server refuses (401/403) the "
                         "agent after it read it once (followed by a list+watch from start, no API call "
                         "at exit; never read -> keep)")
    ap.add_argument("--daemonset", metavar="NS/NAME", default=os.environ.get("SPARSEGATE_AGENT_DAEMONSET", ""),
                    help="the agent's DaemonSet, for --on-exit daemonset (env SPARSEGATE_AGENT_DAEMONSET); "
                         "needs RBAC list and watch on daemonsets")
    ap.add_argument("--bpffs-dir", type=Path, default=None, metavar="DIR",
                    help="pin the program and its policy maps under DIR/<prog id> on bpffs (e.g. "
                         "/sys/fs/bpf/sparsegate), and recognise a predecessor's program left attached by "
                         "its pins there: without CAP_SYS_ADMIN that is the only way a restarted agent can "
                         "replace it and carry over its policy")
    args = ap.parse_args(argv)
    args.interfaces = [i for i in args.interfaces.split(",") if i]
    args.probes = bool(args.probe_configmap or args.probe_file)
    if not args.interfaces and not args.probes:
        ap.error("--interfaces: at least one interface (or a probe source: --probe-configmap/--probe-file)")
    for flag in ("probe_configmap", "probe_report_configmap"):
        value = getattr(args, flag)
        if value and value.count("/") != 1:
            ap.error(f"--{flag.replace('_', '-')} must be NAMESPACE/NAME")
    if (args.probes or args.probe_report_configmap or args.probe_report_file) and not args.node_name:
        ap.error("--probe-*: needs --node-name (or env NODE_NAME)")
    if (args.probe_report_configmap or args.probe_report_file) and not args.probes:
        ap.error("--probe-report-*: needs a probe source (--probe-configmap or --probe-file)")
    if not args.flow_idle_timeout >= 0:
        ap.error("--flow-idle-timeout must be >= 0")
    if args.telemetry_only and args.enforcement not in (None, "off"):
        ap.error("--telemetry-only contradicts --enforcement " + args.enforcement)
    args.enforcement = args.enforcement or ("off" if args.telemetry_only else "enforce")
    args.telemetry_only = args.enforcement == "off"
    try:
        args.allow_sources = [flowpolicy.ip_text(a.strip(), where="--allow-sources")
                              for a in args.allow_sources.split(",") if a.strip()]
    except flowpolicy.FlowPolicyError as exc:
        ap.error(f"--allow-sources: {exc}")
    if args.policy_configmap and args.policy_configmap.count("/") != 1:
        ap.error("--policy-configmap must be NAMESPACE/NAME")
    if args.daemonset and args.daemonset.count("/") != 1:
        ap.error("--daemonset must be NAMESPACE/NAME")
    if args.on_exit == OnExit.DAEMONSET.value and not args.daemonset:
        ap.error("--on-exit daemonset needs --daemonset NAMESPACE/NAME (or SPARSEGATE_AGENT_DAEMONSET)")
    return args


IPVS_DUMMY_INTERFACE = "kube-ipvs0"
# The records the operator leaves to the agent (AGENT_RESERVED_RECORDS) hold the meta record and
# the agent's own always-allowed sources: more sources than this and a document near the operator's
# capacity no longer fits the map here (refused, the node keeps its older policy).
NODE_SOURCES_RESERVED = flowpolicy.AGENT_RESERVED_RECORDS - 1


def local_addresses() -> list[str]:
    """The addresses of every interface of this network namespace (`ip -j addr`): see node_addresses."""
    out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, text=True, timeout=10,
                         check=True).stdout
    return node_addresses(json.loads(out))


def node_addresses(links: list[dict]) -> list[str]:
    """IPv4 and IPv6 addresses of `ip -j addr` output, in canonical text. IPv6 link-local ones
    (fe80::/10) are left out: every veth of a node has one (they would crowd the records the
    operator leaves to the agent), and traffic to a pod's routable address comes from a routable one.
    So are those of kube-proxy's IPVS dummy interface: it holds every Service ClusterIP (hundreds
    or thousands of addresses), which is never a packet's source (IPVS masquerades with the node IP)."""
    out = set()
    for link in links:
        if link.get("ifname") == IPVS_DUMMY_INTERFACE:
            continue
        for a in link.get("addr_info", ()):
            try:
                ip = ipaddress.ip_address(str(a.get("local", "")).split("%")[0])
            except ValueError:
                continue
            if not (ip.version == 6 and ip.is_link_local):
                out.add(str(ip))
    return sorted(out)


class NodeSources:
    """The agent's own always-allowed sources: --allow-sources, and with --node-addresses auto the
    addresses of this network namespace (``read``), asked at each policy document. Warns once when
    they outnumber the records reserved for them; never truncated (kubelet probes need them all)."""

    def __init__(self, *, allow_sources: list[str], auto: bool,
                 read: Callable[[], list[str]] | None = None) -> None:
        self.allow_sources = list(allow_sources)
        self.read = (read or local_addresses) if auto else None
        self.warned = False

    def __call__(self) -> list[str]:
        out = sorted(set(self.allow_sources) | set(self.read() if self.read else ()))
        if len(out) > NODE_SOURCES_RESERVED and not self.warned:
            self.warned = True
            log.warning("%d always-allowed node sources (--allow-sources and --node-addresses) exceed the %d "
                        "records the operator reserves for them (AGENT_RESERVED_RECORDS %d, less the meta "
                        "record): a policy document near the map's capacity will be refused on this node",
                        len(out), NODE_SOURCES_RESERVED, flowpolicy.AGENT_RESERVED_RECORDS)
        return out


def desired_interfaces(config: NodeConfig | None, *, default: list[str],
                       default_mode: xdp.XdpMode, keep_default: bool = False) -> dict[str, xdp.XdpMode]:
    """Interface -> mode to attach: the probe configuration for this node, else the agent's own flags.
    ``keep_default`` (enforcement on): the configuration adds to the flags' interfaces and never
    takes one away. TelemetryProbes are namespaced: one asking for `lo` in any served namespace
    otherwise detached enforcement from every node it selects."""
    if config is None:
        return {i: default_mode for i in default}
    wanted = {i.name: xdp.XdpMode(i.xdp_mode) for i in config.interfaces}
    if keep_default:
        for i in default:
            wanted.setdefault(i, default_mode)
    return wanted


class ProbeFollower:
    """The latest probe configuration for this node, handed from the source thread to the agent's loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._config: NodeConfig | None = None
        self.read = threading.Event()  # the source answered once (a config, or "none for this node")
        self.changed = threading.Event()

    def on_config(self, config: NodeConfig | None) -> None:
        with self._lock:
            self._config = config
        log.info("probe configuration for this node: %s", "none (using --interfaces)" if config is None else
                 f"{config.version} {config.modes()}")
        self.read.set()
        self.changed.set()

    @property
    def config(self) -> NodeConfig | None:
        with self._lock:
            return self._config


def make_policy_handler(*, state: AgentState, on_applied: Callable[[], None] | None = None,
                        sources: Callable[[], list[str]] | None = None) -> policysource.OnDocument:
    """Validate and swap in each document; `on_applied` runs after every successful swap.
    `sources`: the node's own always-allowed sources, asked at each document."""

    def on_document(text: str) -> None:
        try:
            policy = parse_policy(text, max_records=state.swapper.max_records)
        except PolicyError as exc:
            state.policy_errors += 1
            log.error("rejected policy document (keeping version %s): %s", state.policy_version or "none", exc)
            return
        extra = None
        if sources is not None:
            try:
                extra = tuple(sources())
            except Exception as exc:  # keep the ones in force rather than lose the document
                log.warning("cannot read the node's addresses (keeping %s): %s", state.swapper.extra_sources, exc)
        try:
            result = state.swapper.apply(policy, extra_sources=extra)
        except PolicyError as exc:  # over the map capacity once the node's sources are added
            state.policy_errors += 1
            log.error("rejected policy document (keeping version %s): %s", state.policy_version or "none", exc)
            return
        except Exception as exc:  # a map write failed (ENOMEM, a full table): the source retries it
            state.policy_errors += 1
            log.error("applying policy %s failed (keeping version %s, retried at the next read): %s",
                      policy.version, state.policy_version or "none", exc)
            raise
        state.policy_version = policy.version
        state.policy_swaps += 1
        state.last_swap_seconds = result.swap_seconds
        log.info("policy %s live as generation %d in %s (%d records, fill %.1f ms, swap %.1f ms)",
                 policy.version, result.generation, result.slot, result.entries,
                 result.fill_seconds * 1e3, result.swap_seconds * 1e3)
        if on_applied is not None:
            on_applied()

    return on_document


def run(args: argparse.Namespace, *, stop: threading.Event) -> int:
    state, start = AgentState(enforcement=args.enforcement), StartState()
    registry = CollectorRegistry()
    registry.register(XdpCollector(state=state, flow_idle_timeout=args.flow_idle_timeout))
    registry.register(StartCollector(state=start))
    httpd, _ = start_http_server(args.metrics_port, addr=args.metrics_addr, registry=registry)
    log.info("serving /metrics on %s:%d", args.metrics_addr, args.metrics_port)
    try:
        return _run_bpf(args, state=state, start=start, stop=stop)
    finally:
        httpd.shutdown()
        httpd.server_close()


def _run_bpf(args: argparse.Namespace, *, state: AgentState, start: StartState, stop: threading.Event) -> int:
    # Followed from now on: at exit an uninstall may already have removed the pod's token and CA.
    exit_reader: handover.DaemonSetReader | None = None
    if args.on_exit == OnExit.DAEMONSET.value:
        ds_namespace, ds_name = args.daemonset.split("/")
        ds_watch = handover.DaemonSetWatch(ds_namespace, ds_name)
        start.daemonset_watch = ds_watch
        # Its own never-set stop: it must keep following through SIGTERM (the deletion event may
        # arrive just after it); a daemon thread, it ends with the process.
        threading.Thread(target=ds_watch.run, args=(threading.Event(),), name="own-daemonset", daemon=True).start()
        exit_reader = ds_watch.read
    try:
        prog = programs.load(enforce=args.enforcement != "off", audit=args.enforcement == "audit",
                             policy_records=args.policy_map_records)
    except programs.BpfUnavailable as exc:
        state.bpf_error = str(exc)
        log.error("BPF unavailable, no XDP telemetry or enforcement on this node: %s", exc)
        stop.wait()
        return 1
    state.program = prog
    state.swapper = PolicySwapper(bpf=prog.bpf)
    state.bpf_available = True
    agent_pins = _open_pins(args, prog)
    start.pinned = agent_pins is not None

    # The policy source starts before the program is attached: the first policy goes into the
    # maps of a program no packet reaches yet, so the program is never live without it.
    first_policy = threading.Event()

    def applied() -> None:
        first_policy.set()
        start.attached_without_policy = start.inherited_policy = False

    sources = NodeSources(allow_sources=args.allow_sources, auto=args.node_addresses == "auto")
    log.info("enforcement %s; always allowed to policed destinations: %s", args.enforcement, ", ".join(sources()))
    handler = make_policy_handler(state=state, on_applied=applied, sources=sources)
    _start_policy_source(args, on_document=handler, stop=stop)
    follower = _start_probe_source(args, stop=stop) if args.probes else None
    if not _wait_first_policy(args, first_policy=first_policy, start=start, stop=stop):
        if agent_pins:
            agent_pins.release()
        prog.close()  # stopped before attaching: whatever a predecessor left stays as it is
        return 0
    if follower is not None and not follower.read.wait(args.initial_probe_timeout):
        log.warning("no answer from the probe source within %.0fs: attaching to --interfaces %s until it answers",
                    args.initial_probe_timeout, ",".join(args.interfaces) or "(none)")

    mode = xdp.XdpMode(args.xdp_mode)

    def desired(config: NodeConfig | None) -> dict[str, xdp.XdpMode]:
        return desired_interfaces(config, default=args.interfaces, default_mode=mode,
                                  keep_default=args.enforcement != "off")

    # The configuration applied: each report names its version, never a newer one still unapplied.
    probe_config = follower.config if follower else None

    if args.enforcement == "enforce" and not first_policy.is_set():
        # Set, then re-check: a document applied meanwhile clears it (applied() sets the event first).
        start.inherited_policy = _inherit(list(desired(probe_config)), state=state,
                                          pinned=agent_pins.found if agent_pins else {})
        if first_policy.is_set():
            start.inherited_policy = False
        elif not start.inherited_policy:
            log.warning("no predecessor's policy to carry over: the program passes everything (counted no_policy) "
                        "until a policy arrives")

    def attach(**kw: object) -> xdp.XdpMode:
        return xdp.attach(**kw, known=agent_pins.known() if agent_pins else {})  # type: ignore[arg-type]

    attachments = Attachments(state=state, bpf=prog.bpf, fn=prog.fn, attach=attach,
                              after_apply=agent_pins.sweep if agent_pins else None, check_bare=True)
    errors = attachments.apply(desired(probe_config))
    if errors and follower is None:
        _exit(args, state=state, reader=exit_reader, agent_pins=agent_pins, ifindex=attachments.ifindex)
        prog.close()
        return 1
    if args.enforcement == "enforce" and not start.inherited_policy:
        start.attached_without_policy = True  # same set-then-re-check as above
        if first_policy.is_set():
            start.attached_without_policy = False
    log.info("agent ready")
    if follower is None:
        # --interfaces, followed too: a pod's veth deleted and re-created under its name (the
        # program went with the old one) is attached again, as with a probe source.
        while not stop.wait(args.probe_interval):
            attachments.apply(desired(None))
    else:
        _follow_probes(args, follower=follower, attachments=attachments, desired=desired, applied=probe_config,
                       prog_fd=prog.prog_fd, stop=stop)
    log.info("stopping (signal received)")  # logged here, not in the handler: logging takes locks
    _exit(args, state=state, reader=exit_reader, agent_pins=agent_pins, ifindex=attachments.ifindex)
    prog.close()
    log.info("bye")
    return 0


def _start_policy_source(args: argparse.Namespace, *, on_document: policysource.OnDocument,
                         stop: threading.Event) -> None:
    if args.policy_file:
        target, kwargs = policysource.watch_file, {"path": args.policy_file, "interval": args.poll_interval}
    else:
        ns, name = args.policy_configmap.split("/")
        if args.policy_liveness == "watch":
            live_filter = policysource.LivePolicyFilter(on_document)
            on_document = live_filter.document
            namespaces = [n for n in args.policy_liveness_namespaces.split(",") if n] or None
            threading.Thread(target=policysource.watch_routing_policies, name="policy-liveness", daemon=True,
                             kwargs={"on_policies": live_filter.policies, "stop": stop,
                                     "namespaces": namespaces}).start()
        target, kwargs = policysource.watch_configmap, {"namespace": ns, "name": name}
    threading.Thread(target=target, kwargs={**kwargs, "on_document": on_document, "stop": stop},
                     name="policy-source", daemon=True).start()


def _start_probe_source(args: argparse.Namespace, *, stop: threading.Event) -> ProbeFollower:
    follower = ProbeFollower()
    if args.probe_file:
        target, kwargs = probesource.watch_file, {"path": args.probe_file, "interval": args.poll_interval}
    else:
        ns, name = args.probe_configmap.split("/")
        target, kwargs = probesource.watch_configmap, {"namespace": ns, "name": name}
    threading.Thread(target=target, name="probe-source", daemon=True,
                     kwargs={**kwargs, "node": args.node_name, "on_config": follower.on_config, "stop": stop}).start()
    return follower


def _report_sink(args: argparse.Namespace) -> probesource.ReportSink | None:
    if args.probe_report_configmap:
        ns, name = args.probe_report_configmap.split("/")
        return probesource.configmap_sink(namespace=ns, name=name)
    if args.probe_report_file:
        return probesource.file_sink(args.probe_report_file)
    return None


def _follow_probes(args: argparse.Namespace, *, follower: ProbeFollower, attachments: Attachments,
                   desired: Callable[[NodeConfig | None], dict[str, xdp.XdpMode]], applied: NodeConfig | None,
                   prog_fd: int, stop: threading.Event) -> None:
    """Until stopped: re-attach on every configuration change (and retry failures every
    --probe-interval), and send the report whenever it differs from the last one sent, and again
    every --probe-report-heartbeat while unchanged. ``applied``: the configuration the attachments
    were last made for (the report names its version)."""
    try:
        program_id: int | None = inherit.program_id(prog_fd)
    except Exception as exc:  # reported as unknown rather than not reporting at all
        log.warning("cannot read the program's id: %s", exc)
        program_id = None
    sink = _report_sink(args)
    sent = None
    resend_at = math.inf
    while True:
        # Not follower.config: one that arrived during the last apply is not attached yet, and a
        # report naming its version would tell the operator it is (e.g. a mode change as done).
        report = attachments.report(node=args.node_name, config_version=applied.version if applied else None,
                                    program_id=program_id, desired=desired(applied))
        # Also re-sent when unchanged for a while: the operator drops the keys of nodes it thinks
        # left (a node re-registered under the same name, a prune racing a new node), and without
        # it the probe would wait for this node's report for ever.
        if sink is not None and (report != sent or time.monotonic() >= resend_at):
            try:
                sink(report)
                if report != sent:
                    log.info("reported: %s", probesource.report_text(report))
                sent = report
                # Jittered so that agents started together (a rollout) do not patch together.
                beat = args.probe_report_heartbeat
                resend_at = time.monotonic() + beat * random.uniform(0.75, 1.0) if beat > 0 else math.inf
            except Exception as exc:  # retried at the next round
                log.warning("cannot send the probe report: %s", exc)
        deadline = time.monotonic() + args.probe_interval
        while not stop.is_set() and not follower.changed.is_set() and time.monotonic() < deadline:
            follower.changed.wait(0.2)  # short slices: SIGTERM sets only `stop`
        if stop.is_set():
            return
        follower.changed.clear()
        applied = follower.config  # one read: what is applied is what the next report names
        attachments.apply(desired(applied))


def _wait_first_policy(args: argparse.Namespace, *, first_policy: threading.Event, start: StartState,
                       stop: threading.Event) -> bool:
    """Wait (bounded) for the first policy; False when stopped meanwhile."""
    if args.enforcement != "enforce":
        return not stop.is_set()  # a program that never drops has nothing to widen
    t0 = time.monotonic()
    deadline = t0 + args.initial_policy_timeout
    while not first_policy.is_set() and not stop.is_set() and time.monotonic() < deadline:
        first_policy.wait(min(0.05, max(0.0, deadline - time.monotonic())))
    start.initial_policy_wait_seconds = time.monotonic() - t0
    if stop.is_set():
        log.info("stopped before the first policy arrived; nothing attached by this agent")
        return False
    if first_policy.is_set():
        log.info("first policy in the maps after %.2fs; attaching", start.initial_policy_wait_seconds)
    else:
        log.warning("no valid policy within --initial-policy-timeout %.0fs: attaching XDP anyway, so telemetry "
                    "is not lost for ever", args.initial_policy_timeout)
    return True


def _open_pins(args: argparse.Namespace, prog: programs.LoadedProgram) -> pins.AgentPins | None:
    """Pin the program and its policy maps under --bpffs-dir, opening the predecessors' pins first;
    None (logged) without --bpffs-dir or when bpffs refuses: then a predecessor's program is
    recognised only by its name, which needs CAP_SYS_ADMIN."""
    if args.bpffs_dir is None:
        return None
    maps = {name: prog.table(name).map_fd for name in (inherit.OUTER.decode(), *POOL)}
    try:
        return pins.AgentPins.open(args.bpffs_dir, prog_id=inherit.program_id(prog.prog_fd), prog_fd=prog.prog_fd,
                                   maps=maps)
    except OSError as exc:
        log.error("cannot pin under --bpffs-dir %s (%s): a predecessor's program is recognised by name only, "
                  "which needs CAP_SYS_ADMIN", args.bpffs_dir, exc)
        return None


def _inherit(interfaces: list[str], *, state: AgentState, pinned: dict[int, pins.Pinned]) -> bool:
    """No document in time: carry over the policy our predecessor's program still enforces (if one
    is attached to one of `interfaces`), so replacing it widens nothing. True when that policy is now
    in our maps. The predecessor is known by its pins (`pinned`, by prog id) or by its name.
    Programs of ours on different interfaces (one kept where a later agent no longer attached) are
    tried newest first (the kernel's program ids only grow): the attach replaces every one of them,
    so one without a policy, or too large for our maps, must not hide another's policy."""
    found: dict[int, str] = {}  # prog id -> the first interface it is attached to
    for ifname in interfaces:
        try:
            prog = (xdp.attached_program(ifname) or {}).get("prog") or {}
        except Exception as exc:  # unreadable: attach without it, as if there were none
            log.warning("cannot read the program on %s: %s", ifname, exc)
            continue
        prog_id = prog.get("id")
        if prog_id is not None and (prog_id in pinned or prog.get("name") == programs.FUNCTION):
            found.setdefault(prog_id, ifname)
    for prog_id in sorted(found, reverse=True):
        ifname = found[prog_id]
        try:
            records = (inherit.live_policy_pinned(pinned[prog_id]) if prog_id in pinned
                       else inherit.live_policy(prog_id))
        except Exception as exc:  # unreadable: as if it had none
            log.warning("cannot read the policy of the program on %s (prog id %s): %s", ifname, prog_id, exc)
            continue
        if records is None:
            log.info("the program left on %s (prog id %s) has no policy", ifname, prog_id)
            continue
        try:
            result = state.swapper.apply_records_if_empty(records)
        except PolicyError as exc:  # more records than this agent's --policy-map-records
            log.error("cannot carry over the policy of the program on %s (prog id %s): %s", ifname, prog_id, exc)
            continue
        if result is None:
            return False  # a document arrived meanwhile
        state.policy_version = INHERITED
        state.policy_swaps += 1
        log.warning("carried over the policy still enforced on %s by the previous agent's program (prog id %s, "
                    "generation %d, %d records) until a document arrives", ifname, prog_id,
                    result.generation, result.entries)
        return True
    return False


def _exit(args: argparse.Namespace, *, state: AgentState, reader: handover.DaemonSetReader | None = None,
          agent_pins: pins.AgentPins | None = None, ifindex: dict[str, int] | None = None) -> None:
    """Detach or keep the program, as --on-exit decides; the pins go with a program detached."""
    if not state.attached:
        if agent_pins:
            agent_pins.release()
        return
    daemonset = tuple(args.daemonset.split("/")) if args.daemonset else None
    decision = handover.decide_on_exit(OnExit(args.on_exit), daemonset=daemonset,
                                       reader=reader or handover.read_daemonset)
    if decision.action == ExitAction.KEEP:
        log.info("leaving XDP attached on %s with policy %s: %s", ",".join(state.attached),
                 state.policy_version or "none", decision.reason)
        state.attached.clear()
        return
    log.info("detaching XDP: %s", decision.reason)
    _detach_all(state, ifindex=ifindex)
    if agent_pins:
        agent_pins.release()


def _detach_all(state: AgentState, *, ifindex: dict[str, int] | None = None) -> None:
    """``ifindex``: each interface's index when attached (Attachments.ifindex), so that one renamed
    since the last apply is still found."""
    for ifname, mode in list(state.attached.items()):
        try:
            xdp.detach_own(prog_fd=state.program.prog_fd, ifname=ifname, mode=xdp.XdpMode(mode),
                           ifindex=(ifindex or {}).get(ifname))
            log.info("XDP detached from %s", ifname)
        except xdp.NotOurs as exc:
            log.info("%s (a successor's): left in place", exc)
        except Exception as exc:
            log.error("detaching XDP from %s failed: %s", ifname, exc)
        del state.attached[ifname]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    stop = threading.Event()
    def on_signal(signum: int, _frame: object) -> None:
        # os.write takes no Python lock (logging does, and the main thread may hold it here).
        os.write(2, f"signal {signum} received: stopping\n".encode())
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return run(args, stop=stop)


if __name__ == "__main__":
    code = main()
    # Daemon threads (policy source, DaemonSet watch) may still be logging to stderr: interpreter
    # finalization then aborts the process (SIGABRT, "could not acquire lock for <stderr>"). The
    # program was detached or deliberately kept by now and the maps closed; flush and leave.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
