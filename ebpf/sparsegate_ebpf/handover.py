"""Restarting the agent without widening what the data plane allows.

An agent restart (DaemonSet rolling update, crash, OOM kill) must not open a window in which a
flow the policy denies passes. Two rules close it:

* **Start** (``--enforcement enforce`` only: in ``audit`` and ``off`` the program drops nothing, so
  it is attached at once, with no wait, no carry-over and
  `sparsegate_agent_attached_without_policy` 0): the new program gets the first
  valid policy in its maps *before* it is attached, then replaces its predecessor in one netlink
  call (xdp.attach). The wait is bounded (--initial-policy-timeout), because a node must not stay
  without telemetry for ever. When it expires, the policy the predecessor's program still
  enforces is copied into the new program (inherit.py; `sparsegate_agent_inherited_policy`); with
  no predecessor (or one without a policy) the program is attached with none and passes
  everything (counted `no_policy`), logged and exported (`sparsegate_agent_attached_without_policy`).
* **Exit**: an agent being restarted leaves its program attached. The attachment holds the
  program and the program its maps, so the policy in force stays enforced until the successor
  replaces it; a SIGKILLed agent leaves it the same way. Only an agent being *removed* detaches.

SIGTERM looks the same in both cases, so in Kubernetes the agent follows its own DaemonSet (a list,
then a watch: :class:`DaemonSetWatch`) from start, and at exit decides from what that watch has
seen, with no API call then: detach when the DaemonSet is gone or being deleted. An uninstall also
takes away the agent's ServiceAccount and RBAC, often before its pod stops: a 401 or 403 after the
agent has read its DaemonSet once counts as removal (detach), else the program would enforce its
last policy on the node for ever. When it cannot tell (the watch never read the DaemonSet: API
server unreachable or refusing since start) it keeps the program: a kept program enforces the last
policy it had, while detaching on a mere restart would let everything through until the successor
attaches.
"""
from __future__ import annotations

import enum
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)


class OnExit(str, enum.Enum):
    KEEP = "keep"
    # leave the program attached (restarts handled by the successor's atomic replace)
    DETACH = "detach"
    # remove the program (stand-alone use, tests)
    DAEMONSET = "daemonset"
    # keep unless the agent's DaemonSet is gone or being deleted (as its DaemonSetWatch saw it)


class ExitAction(str, enum.Enum):
    KEEP = "keep"
    # the program stays attached with its maps and the policy in force
    DETACH = "detach"
    # the program is removed from the interfaces (only where it is still ours)


@dataclass(frozen=True)
class ExitDecision:
    action: ExitAction
    reason: str


def decide_from_daemonset(body: Mapping[str, Any] | None, error: BaseException | None) -> ExitDecision:
    """Keep or detach, given the DaemonSet as a :data:`DaemonSetReader` reports it at exit (None:
    NotFound) or its error."""
    if getattr(error, "status", None) in (401, 403):
        return ExitDecision(ExitAction.DETACH, f"the agent's credentials or RBAC are gone ({getattr(error, 'status')}): "
                                               "removed with its release")
    if error is not None:
        return ExitDecision(ExitAction.KEEP, f"cannot tell whether the DaemonSet is being removed ({error}); "
                                             "keeping the program, which enforces the last policy it had")
    if body is None:
        return ExitDecision(ExitAction.DETACH, "the DaemonSet is gone")
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return ExitDecision(ExitAction.DETACH, "the DaemonSet is being deleted")
    return ExitDecision(ExitAction.KEEP, "the DaemonSet still exists (a restart): the successor replaces the program")


DaemonSetReader = Callable[[str, str], tuple[Mapping[str, Any] | None, BaseException | None]]


def read_daemonset(namespace: str, name: str, *, timeout: float = 3.0,
                   api_client: Any = None) -> tuple[Mapping[str, Any] | None, BaseException | None]:
    """(body, None), (None, None) when NotFound, or (None, error): one read, made when called
    (:func:`decide_on_exit`'s default reader; the agent passes its :class:`DaemonSetWatch` instead).
    Bounded, to fit a termination grace period (one retry, `timeout` seconds per attempt)."""
    try:
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException
    except ImportError as exc:
        return None, exc
    try:
        if api_client is None:
            cfg = client.Configuration()
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
            cfg.retries = 1
            api_client = client.ApiClient(cfg)
        resp = client.AppsV1Api(api_client).read_namespaced_daemon_set(
            name, namespace, _preload_content=False, _request_timeout=timeout)
        return json.loads(resp.data), None
    except Exception as exc:  # the decision, not the agent, handles every failure
        if isinstance(exc, ApiException) and exc.status == 404:
            return None, None
        return None, exc


class DaemonSetWatch:
    """Follows the agent's own DaemonSet while the agent runs, so the exit decision needs no fresh
    API call at exit: an uninstall removes the pod's token and CA files, its ServiceAccount and
    RBAC, often before the agent's SIGTERM, so a read at exit would fail and keep the program.

    Removal is seen as the DaemonSet's DELETED event, its deletionTimestamp, its absence, or the
    API server refusing the agent's credentials (401/403: the release's RBAC or ServiceAccount went)
    *after* it had accepted them once. A refusal before the first successful read is retried: right
    after an install the API server's authorizer may not have seen the new RoleBinding yet (and a
    restarted API server answers 403 while its caches fill), and a permanent "removed" verdict taken
    then would make a mere restart of this agent detach XDP.
    """

    def __init__(self, namespace: str, name: str, *, api_client: Any = None) -> None:
        self.namespace, self.name = namespace, name
        self.removed = threading.Event()
        self.body: Mapping[str, Any] | None = None
        self.error: BaseException | None = None
        self._api_client = api_client
        self.read_once = False  # the DaemonSet was listed at least once with these credentials

    def _api(self) -> Any:
        from kubernetes import client, config

        if self._api_client is None:
            cfg = client.Configuration()
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
            self._api_client = client.ApiClient(cfg)
        return client.AppsV1Api(self._api_client)

    def _seen(self, obj: Mapping[str, Any] | None) -> None:
        # The latest state wins: a DaemonSet seen again (re-installed, or a refusal that passed)
        # clears an earlier verdict.
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            self.removed.set()
        else:
            self.removed.clear()
        self.body = obj

    def run(self, stop: threading.Event, *, first_backoff_s: float = 1.0) -> None:
        """List, then watch, until ``stop``; every error is retried (backoff from
        ``first_backoff_s`` up to 30 s; refusals every ``first_backoff_s``)."""
        backoff = first_backoff_s
        while not stop.is_set():
            try:
                from kubernetes import watch

                api = self._api()
                listed = api.list_namespaced_daemon_set(self.namespace, field_selector=f"metadata.name={self.name}",
                                                        _preload_content=False, _request_timeout=10)
                body = json.loads(listed.data)
                items = body.get("items") or []
                self.error, self.read_once = None, True
                self._seen(items[0] if items else None)
                w = watch.Watch()
                for event in w.stream(api.list_namespaced_daemon_set, self.namespace,
                                      field_selector=f"metadata.name={self.name}",
                                      resource_version=body["metadata"]["resourceVersion"], timeout_seconds=30):
                    obj = event["object"].to_dict() if hasattr(event["object"], "to_dict") else event["object"]
                    if event["type"] == "DELETED":
                        self._seen(None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        meta = obj.get("metadata") or {}
                        self._seen({"metadata": {"deletionTimestamp": meta.get("deletion_timestamp")
                                                 or meta.get("deletionTimestamp"), "name": meta.get("name")}})
                    if stop.is_set():
                        w.stop()
                        break
                backoff = first_backoff_s
            except Exception as exc:  # noqa: BLE001 (the decision reads self.error)
                refused = getattr(exc, "status", None) in (401, 403)
                if refused and not self.read_once:
                    log.warning("the API server refuses the agent's credentials (%s) before it could read its "
                                "DaemonSet %s/%s once: retrying (RBAC not in effect yet?)",
                                getattr(exc, "status"), self.namespace, self.name)
                elif refused and not self.removed.is_set():
                    log.info("the API server refuses the agent's credentials (%s): its release is being removed",
                             getattr(exc, "status"))
                self.error = exc
                if refused and self.read_once:
                    self.body = None
                    self.removed.set()
                stop.wait(first_backoff_s if refused else backoff)
                backoff = min(backoff * 2, 30.0)

    def read(self, namespace: str, name: str, *, grace_s: float = 2.0) -> tuple[Mapping[str, Any] | None,
                                                                                 BaseException | None]:
        """A :data:`DaemonSetReader`: waits ``grace_s`` for a removal already under way to be seen
        (the DaemonSet's deletion event races the pod's SIGTERM), then reports what was seen."""
        if self.removed.wait(grace_s):
            if getattr(self.error, "status", None) in (401, 403):
                return None, self.error
            return self.body, None  # None: gone; a body: being deleted
        if self.body is not None:
            return self.body, None
        if not self.read_once:  # a refusal before any read is not a removal: the error keeps the program
            return None, RuntimeError(f"the DaemonSet was never read ({self.error or 'no answer yet'})")
        return None, self.error or RuntimeError("the DaemonSet was never read")


def decide_on_exit(on_exit: OnExit, *, daemonset: tuple[str, str] | None,
                   reader: DaemonSetReader = read_daemonset) -> ExitDecision:
    """What to do with the attached program now that the agent stops."""
    if on_exit == OnExit.KEEP:
        return ExitDecision(ExitAction.KEEP, "--on-exit keep")
    if on_exit == OnExit.DETACH:
        return ExitDecision(ExitAction.DETACH, "--on-exit detach")
    if daemonset is None:
        raise ValueError("--on-exit daemonset needs --daemonset NAMESPACE/NAME")
    return decide_from_daemonset(*reader(*daemonset))


@dataclass
class StartState:
    """How the agent started (read by the collector without a lock: single attribute reads)."""

    initial_policy_wait_seconds: float = 0.0
    attached_without_policy: bool = False
    inherited_policy: bool = False
    daemonset_watch: DaemonSetWatch | None = None  # --on-exit daemonset only
    pinned: bool = False  # this agent's program and maps pinned under --bpffs-dir (pins.py)


class StartCollector:
    def __init__(self, *, state: StartState) -> None:
        self._state = state

    def describe(self) -> Sequence[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        wait = GaugeMetricFamily("sparsegate_agent_initial_policy_wait_seconds",
                                 "Time the agent waited for its first policy before attaching XDP")
        wait.add_metric([], self._state.initial_policy_wait_seconds)
        yield wait
        without = GaugeMetricFamily(
            "sparsegate_agent_attached_without_policy",
            "1 while XDP is attached with no policy because none arrived within --initial-policy-timeout "
            "(the program passes everything until one does)")
        without.add_metric([], 1.0 if self._state.attached_without_policy else 0.0)
        yield without
        inherited = GaugeMetricFamily(
            "sparsegate_agent_inherited_policy",
            "1 while the live policy is the one carried over from the previous agent's program "
            "(no document within --initial-policy-timeout)")
        inherited.add_metric([], 1.0 if self._state.inherited_policy else 0.0)
        yield inherited
        pinned = GaugeMetricFamily(
            "sparsegate_agent_pinned",
            "1 when this agent's program and policy maps are pinned under --bpffs-dir, so its successor "
            "can replace the program and carry over its policy; 0 without --bpffs-dir or when pinning "
            "failed (a successor without CAP_SYS_ADMIN then cannot attach where this program runs)")
        pinned.add_metric([], 1.0 if self._state.pinned else 0.0)
        yield pinned
        watch = self._state.daemonset_watch
        if watch is not None:
            followed = GaugeMetricFamily(
                "sparsegate_agent_daemonset_followed",
                "1 while the agent reads its own DaemonSet (--on-exit daemonset); 0 before the first read "
                "or after an error. At exit, never read keeps XDP attached (RBAC missing: it can never "
                "detach); credentials refused after a read count as the release being removed (detach)")
            followed.add_metric([], 1.0 if watch.read_once and watch.error is None else 0.0)
            yield followed
