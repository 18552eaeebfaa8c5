"""Node agent: load the XDP program, attach it, export /metrics, follow the flow policy.

    python -m sparsegate_ebpf.agent --interfaces eth0[,..] --metrics-port 9102 \
        (--policy-file F | --policy-configmap NS/NAME) [--xdp-mode auto|native|generic]
    python -m sparsegate_ebpf.agent --version

Until the first valid policy arrives the program passes everything (counted as
`no_policy`): fail-open at start-up so a node is never black-holed by an agent restart.
An invalid document is rejected and the live policy stays in force. With a ConfigMap source the
agent also watches RoutingPolicies (`--policy-liveness watch`, the default) and drops the allow
entries of deleted ones itself, so access ends with the policy even while the operator is down.
When BPF is unavailable (no bcc, not root, verifier refusal) the agent logs why, keeps
serving /metrics with `sparsegate_agent_bpf_available 0`, and exits 1 on SIGTERM.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from sparsegate_contracts.version import version_line

from . import policysource, programs, xdp
from .metrics import AgentState, XdpCollector
from .policy import PolicyError, parse_policy
from .policyswap import PolicySwapper

log = logging.getLogger("sparsegate_ebpf.agent")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sparsegate_ebpf.agent", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=version_line("sparsegate_ebpf.agent"))
    ap.add_argument("--interfaces", required=True, help="comma-separated interface names")
    ap.add_argument("--metrics-port", type=int, default=9102)
    ap.add_argument("--metrics-addr", default="0.0.0.0")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--policy-file", type=Path)
    src.add_argument("--policy-configmap", metavar="NS/NAME")
    ap.add_argument("--xdp-mode", choices=[m.value for m in xdp.XdpMode], default="auto")
    ap.add_argument("--poll-interval", type=float, default=1.0, help="policy file poll period (s)")
    ap.add_argument("--telemetry-only", action="store_true", help="count, never drop")
    ap.add_argument("--policy-liveness", choices=["watch", "off"], default="watch",
                    help="with --policy-configmap: also watch RoutingPolicies and drop the allow entries of "
                         "deleted ones without waiting for the operator (needs list/watch on routingpolicies)")
    ap.add_argument("--policy-liveness-namespaces", default="",
                    help="comma-separated namespaces whose RoutingPolicies are watched (default: all)")
    args = ap.parse_args(argv)
    args.interfaces = [i for i in args.interfaces.split(",") if i]
    if args.policy_configmap and args.policy_configmap.count("/") != 1:
        ap.error("--policy-configmap must be NAMESPACE/NAME")
    return args


def make_policy_handler(*, state: AgentState) -> policysource.OnDocument:
    def on_document(text: str) -> None:
        try:
            policy = parse_policy(text)
        except PolicyError as exc:
            state.policy_errors += 1
            log.error("rejected policy document (keeping version %s): %s", state.policy_version or "none", exc)
            return
        result = state.swapper.apply(policy)
        state.policy_version = policy.version
        state.policy_swaps += 1
        state.last_swap_seconds = result.swap_seconds
        log.info("policy %s live as generation %d in %s (%d records, fill %.1f ms, swap %.1f ms)",
                 policy.version, result.generation, result.slot, result.entries,
                 result.fill_seconds * 1e3, result.swap_seconds * 1e3)

    return on_document


def run(args: argparse.Namespace, *, stop: threading.Event) -> int:
    state = AgentState()
    registry = CollectorRegistry()
    registry.register(XdpCollector(state=state))
    httpd, _ = start_http_server(args.metrics_port, addr=args.metrics_addr, registry=registry)
    log.info("serving /metrics on %s:%d", args.metrics_addr, args.metrics_port)
    try:
        return _run_bpf(args, state=state, stop=stop)
    finally:
        httpd.shutdown()
        httpd.server_close()


def _run_bpf(args: argparse.Namespace, *, state: AgentState, stop: threading.Event) -> int:
    try:
        prog = programs.load(enforce=not args.telemetry_only)
    except programs.BpfUnavailable as exc:
        state.bpf_error = str(exc)
        log.error("BPF unavailable, no XDP telemetry or enforcement on this node: %s", exc)
        stop.wait()
        return 1
    state.program = prog
    state.swapper = PolicySwapper(bpf=prog.bpf)
    state.bpf_available = True

    mode = xdp.XdpMode(args.xdp_mode)
    try:
        for ifname in args.interfaces:
            used = xdp.attach(bpf=prog.bpf, fn=prog.fn, ifname=ifname, mode=mode)
            state.attached[ifname] = used.value
            log.info("XDP attached to %s in %s mode", ifname, used.value)
    except xdp.AttachError as exc:
        log.error("%s", exc)
        _detach_all(state)
        prog.close()
        return 1

    on_document = make_policy_handler(state=state)
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
    watcher = threading.Thread(target=target, kwargs={**kwargs, "on_document": on_document, "stop": stop},
                               name="policy-source", daemon=True)
    watcher.start()
    log.info("agent ready")
    stop.wait()
    _detach_all(state)
    prog.close()
    log.info("detached from %s; bye", ",".join(args.interfaces))
    return 0


def _detach_all(state: AgentState) -> None:
    for ifname, mode in list(state.attached.items()):
        try:
            xdp.detach(bpf=state.program.bpf, ifname=ifname, mode=xdp.XdpMode(mode))
            log.info("XDP detached from %s", ifname)
        except Exception as exc:
            log.error("detaching XDP from %s failed: %s", ifname, exc)
        del state.attached[ifname]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    return run(args, stop=stop)


if __name__ == "__main__":
    sys.exit(main())
