"""Pod runner: the kubelet part kwok leaves out, for model pods only.

kwok marks pods Running with a loopback pod IP but runs nothing. The runner watches pods labelled
``app.kubernetes.io/name=sparsegate-model`` and keeps one real process per Running pod with an IP:
by default ``python -m sparsegate_workload.server --host <podIP> --port <port named http>
--gate-config <file> <the container's args>``, where the file holds the pod's gate ConfigMap key
``gate.json`` (kept up to date like a kubelet refreshes a ConfigMap volume) and the environment
carries the container's env (``SPARSEGATE_ADMIN_TOKEN`` from its Secret).

The container's args are what the operator rendered (model shape, admin-token variable), so they
are run as a kubelet would, with ``$(VAR)`` references expanded from the container's env; only the
flags a container cannot mean here are replaced by the runner's values: ``--host`` (the pod IP to
bind, not 0.0.0.0), ``--port`` (the container port) and ``--gate-config`` (the runner's copy of the
ConfigMap file). The image and command are not runnable here: the command comes from the runner's
template, whose ``{pod_args}`` element stands for the forwarded args (a template without it, for
some other program, gets none). The process is stopped when the pod goes away and
restarted (with back-off) if it dies while the pod lives.

Pure parts (:func:`desired_process`, :func:`resolve_env`, :func:`forwarded_args`,
:func:`render_argv`) are unit-tested; the
:class:`PodRunner` applies them with the Kubernetes client and subprocesses.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from localcluster import processes
from localcluster.containerrunner import ContainerPodRunner

LOG = logging.getLogger("localcluster.podrunner")

MODEL_SELECTOR = "app.kubernetes.io/name=sparsegate-model"
MODEL_LABEL = "sparsegate.dev/model"
PORT_NAME = "http"
GATE_KEY = "gate.json"
GATE_MOUNT_DIR = "/etc/sparsegate"
POD_ARGS = "{pod_args}"
DEFAULT_COMMAND = (
    "{python}", "-m", "sparsegate_workload.server",
    "--host", "{host}", "--port", "{port}", "--gate-config", "{gate_config}", POD_ARGS,
)
# Container flags that only make sense inside a real pod; the runner supplies its own values.
OVERRIDDEN_FLAGS = ("--host", "--port", "--gate-config")

Lookup = Callable[[str, str], Mapping[str, str] | None]  # (namespace, name) -> data, None if absent


class NotReadyToRun(Exception):
    """The pod needs something that does not exist yet (its ConfigMap or Secret)."""


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """What should run for one pod; a change of any field but ``gate_json`` means a restart."""

    key: str  # namespace/name/uid
    host: str
    port: int
    env: tuple[tuple[str, str], ...]
    gate_json: str | None
    args: tuple[str, ...] = ()  # the container's args, $(VAR) expanded

    @property
    def dir_name(self) -> str:
        namespace, name, _ = self.key.split("/")
        return f"{namespace}_{name}"

    def identity(self) -> tuple[str, str, int, tuple[tuple[str, str], ...], tuple[str, ...]]:
        return (self.key, self.host, self.port, self.env, self.args)


def _get(obj: Mapping[str, Any] | None, *path: str) -> Any:
    for part in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(part)
    return obj


def serving_container(pod: Mapping[str, Any]) -> tuple[Mapping[str, Any], int] | None:
    """The container exposing the port named ``http``, and that port."""
    for container in _get(pod, "spec", "containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == PORT_NAME:
                return container, int(port["containerPort"])
    return None


def gate_configmap_name(pod: Mapping[str, Any]) -> str | None:
    """The ConfigMap mounted under /etc/sparsegate, else ``<model>-gate`` from the model label."""
    volumes = {v.get("name"): v for v in _get(pod, "spec", "volumes") or []}
    for container in _get(pod, "spec", "containers") or []:
        for mount in container.get("volumeMounts") or []:
            if str(mount.get("mountPath", "")).startswith(GATE_MOUNT_DIR):
                name = _get(volumes.get(mount.get("name")), "configMap", "name")
                if name:
                    return name
    model = _get(pod, "metadata", "labels", MODEL_LABEL)
    return f"{model}-gate" if model else None


def resolve_env(
    container: Mapping[str, Any], *, pod: Mapping[str, Any], secrets: Lookup, configmaps: Lookup
) -> dict[str, str]:
    """The container's env as a kubelet would resolve it (values, Secret/ConfigMap keys, pod fields)."""
    namespace = _get(pod, "metadata", "namespace") or "default"
    fields = {
        "metadata.name": _get(pod, "metadata", "name"),
        "metadata.namespace": namespace,
        "status.podIP": _get(pod, "status", "podIP"),
        "spec.nodeName": _get(pod, "spec", "nodeName"),
    }
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var and var["value"] is not None:
            env[name] = str(var["value"])
            continue
        source = var.get("valueFrom") or {}
        for ref_kind, lookup in (("secretKeyRef", secrets), ("configMapKeyRef", configmaps)):
            ref = source.get(ref_kind)
            if ref:
                data = lookup(namespace, ref["name"])
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        break
                    raise NotReadyToRun(f"{ref_kind} {namespace}/{ref['name']} key {ref['key']} not found")
                env[name] = data[ref["key"]]
                break
        else:
            field = _get(source, "fieldRef", "fieldPath")
            if field in fields and fields[field] is not None:
                env[name] = str(fields[field])
    return env


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_args(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """A kubelet's ``$(VAR)`` expansion: defined vars are replaced, undefined ones kept as
    written, ``$$`` escapes a dollar."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return [_VAR_REF.sub(sub, str(a)) for a in args]


def forwarded_args(args: Sequence[str], *, overridden: Sequence[str] = OVERRIDDEN_FLAGS) -> list[str]:
    """``args`` without the ``overridden`` flags and their values (``--f v`` and ``--f=v``)."""
    out: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
            continue
        if arg in overridden:
            skip_value = True
            continue
        if arg.split("=", 1)[0] in overridden and "=" in arg:
            continue
        out.append(arg)
    return out


def desired_process(pod: Mapping[str, Any], *, secrets: Lookup, configmaps: Lookup) -> ProcessSpec | None:
    """What to run for ``pod``; None if nothing should run (not Running, no IP, deleting, no http port)."""
    if _get(pod, "metadata", "deletionTimestamp") or _get(pod, "status", "phase") != "Running":
        return None
    host = _get(pod, "status", "podIP")
    found = serving_container(pod)
    if not host or found is None:
        return None
    container, port = found
    namespace = _get(pod, "metadata", "namespace") or "default"
    gate_json = None
    cm_name = gate_configmap_name(pod)
    if cm_name:
        data = configmaps(namespace, cm_name)
        if data is None or GATE_KEY not in data:
            raise NotReadyToRun(f"ConfigMap {namespace}/{cm_name} key {GATE_KEY} not found")
        gate_json = data[GATE_KEY]
    env = resolve_env(container, pod=pod, secrets=secrets, configmaps=configmaps)
    key = f"{namespace}/{_get(pod, 'metadata', 'name')}/{_get(pod, 'metadata', 'uid')}"
    args = tuple(expand_args(container.get("args") or [], env))
    return ProcessSpec(key=key, host=host, port=port, env=tuple(sorted(env.items())), gate_json=gate_json,
                       args=args)


def render_argv(
    template: tuple[str, ...] | list[str], *, host: str, port: int, gate_config: Path | None, python: str,
    pod_args: Sequence[str] = (),
) -> list[str]:
    """Fills ``{python} {host} {port} {gate_config} {pod_args}``; without a gate file, drops its flag and value.

    An element that is exactly ``{pod_args}`` becomes the forwarded container args (zero or more
    elements, see :func:`forwarded_args`); inside a longer element it is their shell-quoted join.
    """
    pod = forwarded_args(pod_args)
    argv: list[str] = []
    for i, part in enumerate(template):
        if part == POD_ARGS:
            argv.extend(pod)
            continue
        if gate_config is None and "{gate_config}" in part:
            if argv and argv[-1].startswith("--") and i > 0 and template[i - 1] == argv[-1]:
                argv.pop()
            continue
        argv.append(part.format(python=python, host=host, port=port, gate_config=gate_config or "",
                                pod_args=shlex.join(pod)))
    return argv


@dataclasses.dataclass
class _Running:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    pid_file: Path
    restarts: int = 0
    next_start: float = 0.0


class PodRunner:
    """Reconciles real processes against the model pods of one cluster."""

    def __init__(
        self,
        *,
        core_api: Any,
        work_dir: Path,
        command: tuple[str, ...] | list[str] = DEFAULT_COMMAND,
        label_selector: str = MODEL_SELECTOR,
        python: str = sys.executable,
        extra_env: Mapping[str, str] | None = None,
        resync_s: float = 2.0,
    ) -> None:
        self.api = core_api
        self.work_dir = work_dir
        self.command = tuple(command)
        self.label_selector = label_selector
        self.python = python
        self.extra_env = dict(extra_env or {})
        self.resync_s = resync_s
        self.running: dict[str, _Running] = {}
        self._stop = threading.Event()
        self._changed = threading.Event()

    # -- lookups through the API (None when absent) --------------------------------------

    def _read(self, kind: str, namespace: str, name: str) -> Mapping[str, str] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            if kind == "secret":
                obj = self.api.read_namespaced_secret(name, namespace)
                return {k: base64.b64decode(v).decode() for k, v in (obj.data or {}).items()}
            obj = self.api.read_namespaced_config_map(name, namespace)
            return dict(obj.data or {})
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def reconcile(self) -> None:
        """One pass: start what should run, stop what should not, refresh gate files."""
        pods = self.api.list_pod_for_all_namespaces(label_selector=self.label_selector)
        client = self.api.api_client
        desired: dict[str, ProcessSpec] = {}
        for pod_obj in pods.items:
            pod = client.sanitize_for_serialization(pod_obj)
            try:
                spec = desired_process(
                    pod,
                    secrets=lambda ns, n: self._read("secret", ns, n),
                    configmaps=lambda ns, n: self._read("configmap", ns, n),
                )
            except NotReadyToRun as exc:
                LOG.info("pod %s/%s waits: %s", pod["metadata"]["namespace"], pod["metadata"]["name"], exc)
                continue
            if spec is not None:
                desired[spec.key] = spec
        for key in list(self.running):
            if key not in desired or desired[key].identity() != self.running[key].spec.identity():
                self._stop_process(key)
        for key, spec in desired.items():
            self._ensure(spec)

    def _gate_file(self, spec: ProcessSpec) -> Path | None:
        if spec.gate_json is None:
            return None
        path = self.work_dir / spec.dir_name / GATE_KEY
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != spec.gate_json:
            # Atomic replace, as a kubelet swaps a ConfigMap volume's files.
            tmp = path.with_suffix(".tmp")
            tmp.write_text(spec.gate_json)
            os.replace(tmp, path)
        return path

    def _ensure(self, spec: ProcessSpec) -> None:
        gate_file = self._gate_file(spec)
        current = self.running.get(spec.key)
        if current is not None:
            current.spec = spec
            if current.proc.poll() is None:
                return
            code = current.proc.returncode
            if time.monotonic() < current.next_start:
                return
            LOG.warning("process for %s exited with %s; restarting", spec.key, code)
        argv = render_argv(self.command, host=spec.host, port=spec.port, gate_config=gate_file, python=self.python,
                           pod_args=spec.args)
        env = {**os.environ, **self.extra_env, **dict(spec.env)}
        pod_dir = self.work_dir / spec.dir_name
        proc = processes.start(
            name=spec.key, argv=argv, log_path=pod_dir / "process.log", pid_file=pod_dir / "process.pid",
            cwd=pod_dir, env=env, die_with_parent=True,
        )
        restarts = current.restarts + 1 if current else 0
        # Crash-loop back-off like a kubelet's, capped short for a dev loop.
        backoff = min(0.5 * 2**restarts, 10.0)
        self.running[spec.key] = _Running(spec, proc, pod_dir / "process.pid", restarts, time.monotonic() + backoff)
        LOG.info("started pid %d for %s on %s:%d: %s", proc.pid, spec.key, spec.host, spec.port, shlex.join(argv))

    def _stop_process(self, key: str) -> None:
        entry = self.running.pop(key)
        processes.stop_from_pid_file(entry.pid_file, grace_s=5.0, popen=entry.proc)
        LOG.info("stopped process for %s", key)

    def stop_all(self) -> None:
        for key in list(self.running):
            self._stop_process(key)

    def _watch(self) -> None:
        # Any pod event triggers a full pass; the pass itself is the source of truth.
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                for _ in watch.Watch().stream(
                    self.api.list_pod_for_all_namespaces, label_selector=self.label_selector, timeout_seconds=30
                ):
                    self._changed.set()
                    if self._stop.is_set():
                        return
            except Exception as exc:  # the API may restart; retry after a pause
                LOG.warning("pod watch failed: %s", exc)
                self._stop.wait(1.0)

    def run(self) -> None:
        """Reconciles until :meth:`shutdown`; stops every process on the way out."""
        watcher = threading.Thread(target=self._watch, name="podrunner-watch", daemon=True)
        watcher.start()
        synced = False
        try:
            while not self._stop.is_set():
                self._changed.clear()
                try:
                    self.reconcile()
                    if not synced:
                        synced = True
                        LOG.info("synced: %d processes", len(self.running))
                except Exception as exc:
                    LOG.warning("reconcile failed: %s", exc)
                self._changed.wait(self.resync_s)
        finally:
            self.stop_all()

    def shutdown(self) -> None:
        self._stop.set()
        self._changed.set()


def main(argv: list[str] | None = None, *, state_dir: Path | None = None) -> int:
    from kubernetes import client, config as kube_config

    from localcluster.cluster import default_state_dir

    state = state_dir or default_state_dir()
    parser = argparse.ArgumentParser(prog="python -m localcluster podrunner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", type=Path, default=state / "kubeconfig")
    parser.add_argument("--work-dir", type=Path, default=state / "podrunner")
    parser.add_argument(
        "--command", default=shlex.join(DEFAULT_COMMAND),
        help="command template with {python} {host} {port} {gate_config} {pod_args}; {pod_args} is the "
             "container's args minus --host/--port/--gate-config (default: %(default)s)",
    )
    parser.add_argument("--selector", default=MODEL_SELECTOR)
    parser.add_argument("--pid-file", type=Path, help="write this runner's pid here")
    parser.add_argument("--containers", action="store_true",
                        help="run every pod's containers from their images with podman (containerrunner.py) "
                             "instead of a process per model pod; --command and --selector do not apply")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s podrunner %(levelname)s %(message)s")

    api_client = kube_config.new_client_from_config(config_file=str(args.kubeconfig))
    runner: PodRunner | ContainerPodRunner
    if args.containers:
        server = urlsplit(api_client.configuration.host)
        runner = ContainerPodRunner(core_api=client.CoreV1Api(api_client), work_dir=args.work_dir,
                                    api_host=server.hostname or "127.0.0.1", api_port=server.port or 443)
    else:
        runner = PodRunner(
            core_api=client.CoreV1Api(api_client), work_dir=args.work_dir,
            command=shlex.split(args.command), label_selector=args.selector,
        )
    if args.pid_file:
        args.pid_file.parent.mkdir(parents=True, exist_ok=True)
        args.pid_file.write_text(f"{os.getpid()} {processes.process_start_ticks(os.getpid()) or 0}\n")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.shutdown())
    LOG.info("watching %s with %s", "every pod (containers)" if args.containers else f"pods {args.selector}",
             args.kubeconfig)
    runner.run()
    return 0
