"""``sparsegate`` console script: ``sparsegate run`` starts the Kopf operator.

``sparsegate version`` (or ``--version``) prints ``sparsegate <version>`` of the installed build.

``sparsegate train ARGS...`` runs ``python -m sparsegate_workload.training ARGS...`` (the
``sparsegate-train`` command) in place of this process: the operator never imports the model
server's package, so it needs the ``workload`` extra installed beside it.

Wraps ``kopf.run`` so the chart, tests and users start the operator one way, with metrics,
liveness and optional Lease-based leader election flags in one place.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from sparsegate_contracts.version import version_line

from sparsegate.controllers.applied_objects import DEFAULT_INTERVAL_S as REAPPLY_INTERVAL_S
from sparsegate.domain.lease import LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S, Timing

# sparsegate.gc_freeze: freeze the long-lived heap every 30 s; unfreeze, collect and refreeze every 10 min.
GC_FREEZE_S = 30.0
GC_REFRESH_S = 600.0
GC_YOUNG_THRESHOLD = 700  # Python's own default


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _zero_or_more(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, not {value}")
    return value


def _liveness_url(text: str) -> str:
    """What Kopf's liveness endpoint accepts: an http:// URL (its host and port, when given, valid);
    checked here so a bad one is a usage error, not a traceback from the standby or Kopf's endpoint."""
    url = urlsplit(text)
    if url.scheme != "http":
        raise argparse.ArgumentTypeError(f"must be an http:// URL such as http://0.0.0.0:8081/healthz, not {text!r}")
    try:
        url.port
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsegate", description=__doc__)
    parser.add_argument("--version", action="version", version=version_line("sparsegate"))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("version", help="print the installed version")
    # Listed for --help only: main() hands `train` and everything after it to the trainer.
    sub.add_parser("train", add_help=False,
                   help="train a MoE LM into a checkpoint (sparsegate-train; needs the "
                        "workload extra); `sparsegate train --help` lists its flags")
    run = sub.add_parser("run", help="run the operator")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="namespace to serve (repeatable); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="serve every namespace (the default)")
    run.add_argument("--standalone", action="store_true",
                     help="ignore Kopf peering objects (one active operator is guaranteed "
                          "by the deployment or by --leader-elect)")
    run.add_argument("--metrics-port", type=_port, default=0,
                     help="serve Prometheus metrics on this port (0: off)")
    run.add_argument("--metrics-address", default="0.0.0.0",
                     help="address the metrics server binds (the chart passes the pod IP: pods "
                          "that share one network namespace then never collide on the port)")
    run.add_argument("--liveness", type=_liveness_url, default=None,
                     help="Kopf liveness endpoint URL, e.g. http://0.0.0.0:8081/healthz; its host "
                          "is the address bound (also by the standby endpoint of --leader-elect)")
    run.add_argument("--leader-elect", action="store_true",
                     help="run only while holding a coordination.k8s.io Lease")
    run.add_argument("--lease-name", default="sparsegate-operator")
    run.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    # client-go/controller-runtime semantics and defaults (sparsegate.domain.lease).
    run.add_argument("--lease-duration", type=int, default=LEASE_DURATION_S, metavar="SECONDS",
                     help="a standby takes the Lease after seeing it unchanged this long "
                          "(on its own monotonic clock) (default: %(default)s)")
    run.add_argument("--renew-deadline", type=float, default=RENEW_DEADLINE_S, metavar="SECONDS",
                     help="the leader exits when it has not renewed this long after its last "
                          "successful renewal began; must be below --lease-duration "
                          "(default: %(default)s)")
    run.add_argument("--retry-period", type=float, default=RETRY_PERIOD_S, metavar="SECONDS",
                     help="pause between renewals and between acquisition attempts "
                          "(default: %(default)s)")
    run.add_argument("--reapply-interval", type=_zero_or_more, default=REAPPLY_INTERVAL_S, metavar="SECONDS",
                     help="a reconcile skips a model's ConfigMap, Service and admin-Secret check while what "
                          "it would apply is what this process applied less than this long ago (a ConfigMap or "
                          "Service edited or deleted by someone else is put back at its watch event; a "
                          "deleted admin Secret by the first reconcile after this); 0: apply them "
                          "every time (default: %(default)s)")
    run.add_argument("--gc-freeze-interval", type=float, default=GC_FREEZE_S, metavar="SECONDS",
                     help="move the objects alive into Python's permanent generation this often, so full "
                          "garbage collections skip the long-lived heap (sparsegate.gc_freeze); 0: off "
                          "(default: %(default)s)")
    run.add_argument("--gc-refresh-interval", type=float, default=GC_REFRESH_S, metavar="SECONDS",
                     help="unfreeze, collect everything once and freeze again this often, reclaiming cycles "
                          "that died while frozen (default: %(default)s)")
    run.add_argument("--gc-young-threshold", type=_at_least_one, default=GC_YOUNG_THRESHOLD, metavar="N",
                     help="collect Python's youngest generation after this many net container allocations: "
                          "higher means fewer, longer young collections, fewer full ones, and more memory "
                          "held by garbage cycles until collected (bench_scale at 1,000 models, 700 vs "
                          "10,000: garbage collection in the create burst 7.4 vs 5.1 s, peak RSS 170 vs "
                          "187 MiB) (default: %(default)s, Python's)")
    run.add_argument("--log-format", choices=["full", "plain", "json"], default="full",
                     help="Kopf's log formats; object-related lines carry [namespace/name]")
    run.add_argument("--verbose", "-v", action="store_true")
    return parser


class _StandbyHealth(BaseHTTPRequestHandler):
    """Answers liveness while a replica waits for the Lease (Kopf's endpoint is not up yet)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        body = b'{"standby": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def _standby_server(liveness: str | None) -> ThreadingHTTPServer | None:
    """Binds exactly the host and port of ``--liveness``, as Kopf's own endpoint will after it."""
    if not liveness:
        return None
    url = urlsplit(liveness)
    # Kopf's defaults for a URL without them (kopf._core.engines.probing): localhost, port 80.
    server = ThreadingHTTPServer((url.hostname or "localhost", url.port or 80), _StandbyHealth)
    threading.Thread(target=server.serve_forever, name="standby-health", daemon=True).start()
    return server


def gc_freeze_intervals(args: argparse.Namespace) -> tuple[float, float]:
    """(freeze, refresh) seconds of ``sparsegate run``; ValueError names the flags and the broken rule
    (``gc_freeze.check_intervals``)."""
    from sparsegate.gc_freeze import check_intervals

    try:
        check_intervals(args.gc_freeze_interval, args.gc_refresh_interval)
    except ValueError as e:
        raise ValueError(f"--gc-freeze-interval / --gc-refresh-interval: {e}") from None
    return args.gc_freeze_interval, args.gc_refresh_interval


def election_timing(args: argparse.Namespace) -> Timing:
    """The validated durations of ``sparsegate run`` (ValueError names the broken rule)."""
    return Timing(lease_duration_s=args.lease_duration, renew_deadline_s=args.renew_deadline,
                  retry_period_s=args.retry_period)


TRAIN_MODULE = "sparsegate_workload.training"


def train_command(args: list[str]) -> list[str]:
    """The command line ``sparsegate train ARGS`` runs (same interpreter, so the same venv)."""
    return [sys.executable, "-m", TRAIN_MODULE, *args]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    if argv[:1] == ["train"]:
        # find_spec of a top-level name locates it without importing (executing) it.
        if importlib.util.find_spec(TRAIN_MODULE.split(".")[0]) is None:
            parser.error("train: the model-server package (sparsegate_workload) is not "
                         "installed; install sparsegate[workload]")
        command = train_command(argv[1:])
        os.execv(command[0], command)
    args = parser.parse_args(argv)
    if args.command == "version":
        print(version_line("sparsegate"))
        return 0
    try:
        timing = election_timing(args)
        freeze_s, refresh_s = gc_freeze_intervals(args)
    except ValueError as e:
        parser.error(str(e))
    import kopf

    # Kopf's formatter for every logger (ours included): prefixes object lines with the object.
    kopf.configure(debug=args.verbose, log_format=kopf.LogFormat[args.log_format.upper()],
                   log_prefix=True)

    try:
        import sparsegate.main  # noqa: F401  (registers handlers and settings)
    except ValueError as e:
        # The handler modules read their environment on import (sparsegate.envvars, the policy
        # capacity, POD_IPS): a bad value is a usage error naming the variable, not a traceback.
        parser.error(f"environment: {e}")
    from sparsegate import metrics
    from sparsegate.memo import OperatorMemo

    if args.metrics_port:
        try:
            metrics.serve(port=args.metrics_port, addr=args.metrics_address)
        except OSError as e:  # address not local or not an address, port taken or privileged
            parser.error(f"--metrics-address / --metrics-port: cannot listen on "
                         f"{args.metrics_address}:{args.metrics_port}: {e}")
    from sparsegate import gc_freeze
    gc_freeze.set_young_threshold(args.gc_young_threshold)
    gc_freeze.start(freeze_s=freeze_s, refresh_s=refresh_s)
    elector = None
    if args.leader_elect:
        from sparsegate.clients.kube import Kube
        from sparsegate.clients.leader import LeaderElector

        # A client of its own: election requests never queue behind the handlers' requests.
        elector = LeaderElector(Kube.from_environment(), name=args.lease_name,
                                namespace=args.lease_namespace,
                                identity=os.environ.get("POD_NAME") or socket.gethostname(),
                                timing=timing)
        try:
            standby = _standby_server(args.liveness)
        except OSError as e:
            parser.error(f"--liveness: cannot listen on {args.liveness}: {e}")
        try:
            if not elector.acquire(threading.Event()):
                return 1
        finally:
            if standby is not None:  # free the port for Kopf's own liveness endpoint
                standby.shutdown()
                standby.server_close()
        # Losing the Lease (another holder, or no renewal within the renew deadline) ends this
        # process at once with exit status 1; the pod restarts as a standby.
        elector.keep()
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.standalone or None,
        liveness_endpoint=args.liveness,
        # Per-object copies that share its keys (sparsegate.memo); startup fills the rest.
        memo=OperatorMemo(reapply_interval_s=args.reapply_interval),
    )
    if elector is not None:
        # Kopf has stopped (clean shutdown) and its cleanup waited for the work its handlers had handed to
        # threads (sparsegate.main.finish_pool_work): nothing acts any more, so hand the Lease over.
        logging.getLogger("sparsegate.leader").info("Kopf has stopped; handing the Lease over")
        elector.stop()
        elector.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
