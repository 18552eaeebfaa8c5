"""Restarting the agent without widening what the data plane allows.

An agent restart (DaemonSet rolling update, crash, OOM kill) must not open a window in which a
flow the policy denies passes. Two rules close it:

* **Start**: the new program gets the first valid policy in its maps *before* it is attached,
  then replaces its predecessor in one netlink call (xdp.attach). The wait is bounded
  (--initial-policy-timeout), because a node must not stay without telemetry for ever. When it
  expires, the policy the predecessor's program still enforces is copied into the new program
  (inherit.py; `sparsegate_agent_inherited_policy`); with no predecessor (or one without a
  policy) the program is attached with none and passes everything (counted `no_policy`), logged
  and exported (`sparsegate_agent_attached_without_policy`).
* **Exit**: an agent being restarted leaves its program attached. The attachment holds the
  program and the program its maps, so the policy in force stays enforced until the successor
  replaces it; a SIGKILLed agent leaves it the same way. Only an agent being *removed* detaches.

SIGTERM looks the same in both cases, so in Kubernetes the agent asks the API server, at exit,
whether its DaemonSet still exists and is not being deleted. When it cannot tell (API server
unreachable, no RBAC) it keeps the program: a kept program enforces the last policy it had,
while detaching on a mere restart would let everything through until the successor attaches.
"""
from __future__ import annotations

import enum
import json
import logging
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
    # keep unless the agent's DaemonSet is gone or being deleted (asked at exit)


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
    """Keep or detach, given the DaemonSet as read at exit (None: NotFound) or the read's error."""
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
    """(body, None), (None, None) when NotFound, or (None, error). Bounded: it runs inside the pod's
    termination grace period (one retry, `timeout` seconds per attempt)."""
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
