"""``kubectl sparsegate``: watch and steer GateConfig rollouts (after ``kubectl argo rollouts``).

Commands: ``get [NAME] [-A]``, ``status NAME [--watch [--timeout DURATION]]`` (the watch ends, 0 or 1, once
the rollout comes to rest), ``pause``, ``resume``, ``promote [--full]``, ``abort``, ``retry``,
``undo [--to-revision N]``. Uses the user's kubeconfig (``$KUBECONFIG``,
``--kubeconfig``, ``--context``) through the official Kubernetes client, and writes only what a
user could write with kubectl: ``spec.rollout.paused``, ``spec.params`` (undo) and the one-shot
annotations the operator consumes. It never writes status: the operator is its one writer.
Printing and patch building are pure functions in :mod:`sparsegate.kubectl_plugin.view`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from sparsegate_contracts import names
from sparsegate_contracts.version import version_line

from sparsegate.kubectl_plugin import view

PROG = "kubectl-sparsegate"


def _duration(text: str) -> float:
    try:
        return view.parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    # Connection flags go before or after the command, as with kubectl (SUPPRESS: a subcommand
    # that does not repeat a flag leaves the value given before it alone).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", default=argparse.SUPPRESS,
                        help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    common.add_argument("--context", default=argparse.SUPPRESS, help="kubeconfig context (default: the current one)")
    common.add_argument("-n", "--namespace", default=argparse.SUPPRESS,
                        help="namespace (default: the context's, else 'default')")
    p = argparse.ArgumentParser(prog=PROG, description="Watch and steer sparsegate GateConfig rollouts.",
                                parents=[common])
    p.add_argument("--version", action="version", version=version_line(PROG))
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, parents=[common])

    get = command("get", "table of GateConfigs: phase, step, canary share, versions, analysis")
    get.add_argument("name", nargs="?")
    get.add_argument("-A", "--all-namespaces", action="store_true")
    status = command("status", "one GateConfig in detail: steps, analysis values, the latest AnalysisRun, history")
    status.add_argument("name")
    status.add_argument("-w", "--watch", action="store_true",
                        help="print again on every change until the rollout comes to rest: exit 0 when it "
                             "Succeeded, 1 when it Failed, RolledBack or Aborted (or the GateConfig is deleted)")
    status.add_argument("-t", "--timeout", type=_duration, default=0.0,
                        help="with --watch: give up after this long (90s, 5m, 1h30m; 0, the default: never), exit 1")
    for verb, text in (("pause", "hold the rollout at its step (spec.rollout.paused: true)"),
                       ("resume", "continue a paused rollout (spec.rollout.paused: false)"),
                       ("abort", "roll the canary back to the stable version"),
                       ("retry", "roll out again the version a rollback or abort rejected, or re-analyse a "
                                 "failed or inconclusive step")):
        command(verb, text).add_argument("name")
    promote = command("promote", "skip the current step's analysis: on to the next step")
    promote.add_argument("name")
    promote.add_argument("--full", action="store_true", help="skip every remaining step: all instances at once")
    undo = command("undo", "roll out an earlier version from status.history (writes spec.params)")
    undo.add_argument("name")
    undo.add_argument("--to-revision", type=int, help="revision number (default: the one before the stable)")
    return p


class Client:
    """The few GateConfig calls the commands make (CustomObjectsApi with the user's kubeconfig)."""

    def __init__(self, *, kubeconfig: str | None, context: str | None) -> None:
        from kubernetes import client, config

        config.load_kube_config(config_file=kubeconfig, context=context)
        self.api = client.CustomObjectsApi()
        contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)
        chosen = next((c for c in contexts if c.get("name") == context), current) if context else current
        self.default_namespace = ((chosen or {}).get("context") or {}).get("namespace") or "default"

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.api.get_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.GATECONFIGS, name)

    def list(self, namespace: str | None) -> list[dict[str, Any]]:
        if namespace is None:
            out = self.api.list_cluster_custom_object(names.GROUP, names.VERSION, names.GATECONFIGS)
        else:
            out = self.api.list_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.GATECONFIGS)
        return list(out.get("items") or [])

    def patch(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        # A dict goes as a merge patch, a list as a JSON patch (named: the client sends merge
        # patches unless told otherwise).
        kind = "application/json-patch+json" if isinstance(body, list) else "application/merge-patch+json"
        return self.api.patch_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.GATECONFIGS,
                                                       name, body, _content_type=kind)

    def watch(self, namespace: str, name: str, *, timeout_seconds: int | None = None) -> Any:
        """The GateConfig's watch events; with ``timeout_seconds`` the API server ends the stream then
        (and a connection that goes quiet past it is dropped), to be watched again if need be."""
        from kubernetes import watch

        bounded: dict[str, Any] = {} if timeout_seconds is None else {
            "timeout_seconds": timeout_seconds, "_request_timeout": (10, timeout_seconds + 10)}
        return watch.Watch().stream(self.api.list_namespaced_custom_object, names.GROUP, names.VERSION, namespace,
                                    names.GATECONFIGS, field_selector=f"metadata.name={name}", **bounded)


def _watch_status(client: Client, namespace: str, name: str, out: Callable[[str], None], *,
                  timeout: float = 0.0, clock: Callable[[], float] = time.monotonic) -> int:
    """Print the GateConfig on every change until its rollout comes to rest (:func:`view.watch_outcome`):
    its exit code; 1 when the GateConfig is deleted; :class:`view.PluginError` after ``timeout``
    seconds (0: none)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    deleted = f"GateConfig {namespace}/{name} deleted\n"
    deadline = clock() + timeout if timeout > 0 else None
    last: dict[str, Any] | None = None

    def timed_out() -> view.PluginError:
        phase = view.row(last)[1] if last is not None else "unknown"
        return view.PluginError(f"timed out after {timeout:g}s waiting for GateConfig {namespace}/{name} to come "
                                f"to rest (phase {phase})")

    shown = None  # resourceVersion last printed: a new watch opens with the object as it is, maybe already shown
    while True:
        bound: dict[str, Any] = {}
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                raise timed_out()
            bound = {"timeout_seconds": max(1, math.ceil(left))}  # the server ends the stream by the deadline
        try:
            for event in client.watch(namespace, name, **bound):
                if event["type"] == "DELETED":
                    out(deleted)
                    return 1
                obj = event["object"]
                last = obj
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if version is None or version != shown:
                    out(clear + view.status_view(obj))
                shown = version
                outcome = view.watch_outcome(obj)
                if outcome is not None:
                    out(outcome[1] + "\n")
                    return outcome[0]
                if deadline is not None and clock() >= deadline:
                    raise timed_out()
        except ApiException as e:
            # 410 Gone: the resourceVersion the watch resumes from was compacted away (a quiet
            # object watched for long); the client retries it once, then raises. Start afresh.
            if e.status != 410:
                raise
        except HTTPError:
            if deadline is None or clock() < deadline:
                raise
            raise timed_out() from None  # the quiet connection dropped at the deadline
        try:  # a deletion while no watch was open is never delivered: look before watching again
            client.get(namespace, name)
        except ApiException as e:
            if e.status == 404:
                out(deleted)
                return 1
            raise


def _write(text: str) -> None:
    # Flushed each time: piped (`status --watch | tee`), stdout is block-buffered and each page
    # would wait for the next several.
    sys.stdout.write(text)
    sys.stdout.flush()


def run(argv: Sequence[str], *, client_factory: Callable[..., Client] = Client,
        out: Callable[[str], None] = _write, clock: Callable[[], float] = time.monotonic) -> int:
    args = _parser().parse_args(argv)
    client = client_factory(kubeconfig=getattr(args, "kubeconfig", None), context=getattr(args, "context", None))
    namespace = getattr(args, "namespace", None) or client.default_namespace
    cmd = args.command
    if cmd == "get":
        if args.name and args.all_namespaces:  # as kubectl: -A would otherwise be ignored silently
            raise view.PluginError("a GateConfig cannot be retrieved by name across all namespaces")
        if args.name:
            objs = [client.get(namespace, args.name)]
        else:
            objs = client.list(None if args.all_namespaces else namespace)
        out(view.get_table(objs, with_namespace=args.all_namespaces) + "\n")
        return 0
    if cmd == "status":
        if args.timeout and not args.watch:  # not a one-shot print that exits 0 whatever the phase
            raise view.PluginError("--timeout applies to status --watch")
        if args.watch:
            client.get(namespace, args.name)  # a clear "not found" rather than a silent wait
            return _watch_status(client, namespace, args.name, out, timeout=args.timeout, clock=clock)
        else:
            out(view.status_view(client.get(namespace, args.name)))
        return 0
    obj = client.get(namespace, args.name)  # also: a clear "not found" before any write
    if cmd in ("pause", "resume"):
        body: Any = view.pause_patch(True) if cmd == "pause" else view.resume_patch(obj)
        done = "paused" if cmd == "pause" else "resumed"
    elif cmd == "promote":
        body, done = view.promote_patch(obj, full=args.full), "promote requested" + (" (full)" if args.full else "")
    elif cmd == "abort":
        body, done = view.abort_patch(obj), "abort requested"
    elif cmd == "retry":
        body, done = view.retry_patch(obj), "retry requested"
    else:
        target = view.undo_target(obj, to_revision=args.to_revision)
        body = view.undo_patch(obj, to_revision=args.to_revision)
        done = f"spec.params set to revision {target.get('revision')} ({target.get('version')})"
    client.patch(namespace, args.name, body)
    out(f"gateconfig.{names.GROUP}/{args.name} {done}\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``kubectl-sparsegate``, so kubectl finds it as ``kubectl sparsegate``)."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException
    from urllib3.exceptions import HTTPError

    try:
        return run(sys.argv[1:] if argv is None else argv)
    except view.PluginError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    except ConfigException as e:  # no kubeconfig, or no such context
        sys.stderr.write(f"error: kubeconfig: {e}\n")
        return 1
    except BrokenPipeError:
        # The reader went away (`... | head`): not an API server problem. End quietly, as a
        # SIGPIPE'd kubectl does; stdout to /dev/null so the exit-time flush does not fail again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except (HTTPError, OSError) as e:  # the API server cannot be reached
        sys.stderr.write(f"error: cannot reach the API server: {e}\n")
        return 1
    except ApiException as e:
        try:
            detail = json.loads(e.body or "{}").get("message") or ""
        except (ValueError, AttributeError):
            detail = ""
        sys.stderr.write(f"error: {e.status} {e.reason}" + (f": {detail}" if detail else "") + "\n")
        return 1
    except KeyboardInterrupt:
        return 130
