"""Restart handover, the pure parts: the exit decision (from a DaemonSet body, NotFound, or an error),
the DaemonSet read against a stub API server on loopback, the bounded wait for the first policy, and
the start-up metrics. No BPF: the e2e test tests/e2e/ebpf/test_ebpf_agent_restart.py runs the real thing."""
from __future__ import annotations

import argparse
import http.server
import json
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sparsegate_ebpf import agent
from sparsegate_ebpf.handover import (
    ExitAction, OnExit, StartCollector, StartState, decide_from_daemonset, decide_on_exit, read_daemonset)

DS = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "sg-agent", "namespace": "sg"}}


def test_daemonset_present_keeps_the_program() -> None:
    d = decide_from_daemonset(DS, None)
    assert d.action == ExitAction.KEEP and "restart" in d.reason


def test_daemonset_not_found_detaches() -> None:
    d = decide_from_daemonset(None, None)
    assert d.action == ExitAction.DETACH and "gone" in d.reason


def test_daemonset_being_deleted_detaches() -> None:
    deleting = {**DS, "metadata": {**DS["metadata"], "deletionTimestamp": "2026-12-03T10:00:00Z"}}
    d = decide_from_daemonset(deleting, None)
    assert d.action == ExitAction.DETACH and "being deleted" in d.reason


def test_an_unanswered_question_keeps_the_program_and_says_why() -> None:
    d = decide_from_daemonset(None, ConnectionRefusedError("connection refused"))
    assert d.action == ExitAction.KEEP and "connection refused" in d.reason


def test_fixed_modes_ask_nobody() -> None:
    def reader(ns: str, name: str):
        raise AssertionError("asked the API server")

    assert decide_on_exit(OnExit.KEEP, daemonset=("sg", "a"), reader=reader).action == ExitAction.KEEP
    assert decide_on_exit(OnExit.DETACH, daemonset=None, reader=reader).action == ExitAction.DETACH


def test_daemonset_mode_asks_for_the_named_daemonset() -> None:
    asked: list[tuple[str, str]] = []

    def reader(ns: str, name: str):
        asked.append((ns, name))
        return None, None

    assert decide_on_exit(OnExit.DAEMONSET, daemonset=("sg", "sg-agent"), reader=reader).action == ExitAction.DETACH
    assert asked == [("sg", "sg-agent")]
    with pytest.raises(ValueError):
        decide_on_exit(OnExit.DAEMONSET, daemonset=None, reader=reader)


def test_daemonset_mode_needs_a_daemonset_flag() -> None:
    base = ["--interfaces", "eth0", "--policy-file", "p.json"]
    with pytest.raises(SystemExit):
        agent.parse_args([*base, "--on-exit", "daemonset"])
    args = agent.parse_args([*base, "--on-exit", "daemonset", "--daemonset", "sg/sg-agent"])
    assert (args.on_exit, args.daemonset) == ("daemonset", "sg/sg-agent")
    assert agent.parse_args(base).on_exit == "detach"  # unchanged default for stand-alone use


# --- read_daemonset against a stub API server (loopback) ------------------------------------------

@pytest.fixture
def apiserver() -> Iterator[dict]:
    """Answers GET /apis/apps/v1/namespaces/<ns>/daemonsets/<name> with reply["status"], reply["body"]."""
    reply: dict = {"status": 200, "body": DS, "paths": []}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            reply["paths"].append(self.path)
            data = json.dumps(reply["body"]).encode()
            self.send_response(reply["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    reply["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield reply
    server.shutdown()
    server.server_close()


def _client(url: str):
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = url
    cfg.retries = 0
    return client.ApiClient(cfg)


def test_read_daemonset_returns_the_body(apiserver: dict) -> None:
    body, err = read_daemonset("sg", "sg-agent", api_client=_client(apiserver["url"]))
    assert (body, err) == (DS, None)
    assert apiserver["paths"] == ["/apis/apps/v1/namespaces/sg/daemonsets/sg-agent"]


def test_read_daemonset_not_found_is_none_without_error(apiserver: dict) -> None:
    apiserver.update(status=404, body={"kind": "Status", "reason": "NotFound", "code": 404})
    assert read_daemonset("sg", "sg-agent", api_client=_client(apiserver["url"])) == (None, None)


def test_read_daemonset_forbidden_or_unauthorized_means_removed(apiserver: dict) -> None:
    # An uninstall deletes the agent's Role/RoleBinding and ServiceAccount with its DaemonSet,
    # often before the pod's SIGTERM: the agent is being removed, so it detaches.
    for status, reason in ((403, "Forbidden"), (401, "Unauthorized")):
        apiserver.update(status=status, body={"kind": "Status", "reason": reason, "code": status})
        body, err = read_daemonset("sg", "sg-agent", api_client=_client(apiserver["url"]))
        assert body is None and getattr(err, "status", None) == status
        assert decide_from_daemonset(body, err).action == ExitAction.DETACH


def test_read_daemonset_unreachable_is_an_error_within_its_timeout() -> None:
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    body, err = read_daemonset("sg", "sg-agent", timeout=1.0, api_client=_client(url))
    assert body is None and err is not None and time.monotonic() - t0 < 5


# --- the bounded wait for the first policy ---------------------------------------------------------

def _args(timeout: float, telemetry_only: bool = False) -> argparse.Namespace:
    return argparse.Namespace(initial_policy_timeout=timeout, telemetry_only=telemetry_only,
                              enforcement="off" if telemetry_only else "enforce")


def test_first_policy_ends_the_wait() -> None:
    first, stop, start = threading.Event(), threading.Event(), StartState()
    threading.Timer(0.2, first.set).start()
    assert agent._wait_first_policy(_args(10.0), first_policy=first, start=start, stop=stop) is True
    assert 0.15 < start.initial_policy_wait_seconds < 5


def test_no_policy_in_time_attaches_anyway() -> None:
    first, stop, start = threading.Event(), threading.Event(), StartState()
    assert agent._wait_first_policy(_args(0.3), first_policy=first, start=start, stop=stop) is True
    assert 0.25 < start.initial_policy_wait_seconds < 5


def test_stop_during_the_wait_attaches_nothing() -> None:
    first, stop, start = threading.Event(), threading.Event(), StartState()
    threading.Timer(0.1, stop.set).start()
    assert agent._wait_first_policy(_args(30.0), first_policy=first, start=start, stop=stop) is False


def test_telemetry_only_does_not_wait() -> None:
    first, stop, start = threading.Event(), threading.Event(), StartState()
    assert agent._wait_first_policy(_args(30.0, telemetry_only=True), first_policy=first, start=start,
                                    stop=stop) is True
    assert start.initial_policy_wait_seconds == 0.0


def test_start_metrics() -> None:
    state = StartState(initial_policy_wait_seconds=1.5, attached_without_policy=True)
    registry = CollectorRegistry()
    registry.register(StartCollector(state=state))
    text = generate_latest(registry).decode()
    assert "sparsegate_agent_initial_policy_wait_seconds 1.5" in text
    assert "sparsegate_agent_attached_without_policy 1.0" in text
    state.attached_without_policy = False
    assert "sparsegate_agent_attached_without_policy 0.0" in generate_latest(registry).decode()
    assert "sparsegate_agent_daemonset_followed" not in text  # only with --on-exit daemonset
    assert "sparsegate_agent_pinned 0.0" in text
    state.pinned = True
    assert "sparsegate_agent_pinned 1.0" in generate_latest(registry).decode()


def test_on_applied_runs_only_after_a_valid_policy_is_swapped_in() -> None:
    from sparsegate_ebpf.metrics import AgentState
    from sparsegate_ebpf.policyswap import SwapResult

    class Swapper:  # our own wrapper's interface, not BCC's
        max_records = 65536  # the pool maps' max_entries, which documents are parsed against

        def __init__(self) -> None:
            self.applied: list[str] = []

        def apply(self, policy, extra_sources=None):
            self.applied.append(policy.version)
            return SwapResult(len(self.applied), "policy_a", 1, 0.0, 0.0)

    state = AgentState(swapper=Swapper())
    calls: list[str] = []
    on_document = agent.make_policy_handler(state=state, on_applied=lambda: calls.append(state.policy_version))
    on_document("{broken")
    assert calls == [] and state.policy_errors == 1
    on_document(json.dumps({"version": "v1", "defaultAction": "deny", "entries": []}))
    assert calls == ["v1"] and state.swapper.applied == ["v1"]


def test_daemonset_watch_read_reports_what_it_followed() -> None:
    """The exit decision uses what the watch saw while the agent ran (no API call at exit)."""
    from sparsegate_ebpf.handover import DaemonSetWatch

    w = DaemonSetWatch("sg", "sg-agent")
    assert w.read("sg", "sg-agent", grace_s=0)[0] is None  # never read: an error, so KEEP
    assert decide_from_daemonset(*w.read("sg", "sg-agent", grace_s=0)).action == ExitAction.KEEP
    w._seen(DS)
    assert decide_from_daemonset(*w.read("sg", "sg-agent", grace_s=0)).action == ExitAction.KEEP
    w._seen({"metadata": {"name": "sg-agent", "deletionTimestamp": "2026-12-03T00:00:00Z"}})
    d = decide_from_daemonset(*w.read("sg", "sg-agent", grace_s=0))
    assert d.action == ExitAction.DETACH and "being deleted" in d.reason
    gone = DaemonSetWatch("sg", "sg-agent")
    gone._seen(None)
    d = decide_from_daemonset(*gone.read("sg", "sg-agent", grace_s=0))
    assert d.action == ExitAction.DETACH and "gone" in d.reason


def test_audit_mode_does_not_wait_either() -> None:
    """An audit program drops nothing, so there is nothing to widen by attaching it at once."""
    first, stop, start = threading.Event(), threading.Event(), StartState()
    args = argparse.Namespace(initial_policy_timeout=30.0, telemetry_only=False, enforcement="audit")
    assert agent._wait_first_policy(args, first_policy=first, start=start, stop=stop) is True


def test_enforcement_flag_and_allow_sources_are_validated() -> None:
    base = ["--interfaces", "eth9", "--policy-file", "/nonexistent"]
    assert agent.parse_args(base).enforcement == "enforce"
    assert agent.parse_args([*base, "--telemetry-only"]).enforcement == "off"
    args = agent.parse_args([*base, "--enforcement", "audit", "--allow-sources", "10.0.0.1, 10.0.0.2"])
    assert (args.enforcement, args.telemetry_only, args.allow_sources) == ("audit", False, ["10.0.0.1", "10.0.0.2"])
    for bad in (["--allow-sources", "10.0.0.300"], ["--telemetry-only", "--enforcement", "enforce"]):
        with pytest.raises(SystemExit):
            agent.parse_args([*base, *bad])


def test_daemonset_watch_takes_a_refusal_for_removal_only_after_the_credentials_worked() -> None:
    """Right after an install the authorizer may not know the agent's RoleBinding yet (403): that is
    retried, not taken for an uninstall, else a mere restart of that agent would detach XDP. A refusal
    after a successful read is the release going; a DaemonSet seen again clears it."""
    import time

    from sparsegate_ebpf.handover import DaemonSetWatch

    reply: dict = {"status": 403, "lists": 0}
    listing = {"kind": "DaemonSetList", "apiVersion": "apps/v1", "metadata": {"resourceVersion": "7"},
               "items": [DS]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = reply["status"]
            if status == 200 and "watch=" in self.path:
                time.sleep(0.05)  # an empty watch that ends: the follower lists again
                data = b""
            elif status == 200:
                reply["lists"] += 1
                data = json.dumps(listing).encode()
            else:
                data = json.dumps({"kind": "Status", "reason": "Forbidden", "code": status}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()
    w = DaemonSetWatch("sg", "sg-agent", api_client=_client(f"http://127.0.0.1:{server.server_address[1]}"))
    registry = CollectorRegistry()
    registry.register(StartCollector(state=StartState(daemonset_watch=w)))

    def followed() -> str:
        return [line for line in generate_latest(registry).decode().splitlines()
                if line.startswith("sparsegate_agent_daemonset_followed ")][0]

    t = threading.Thread(target=w.run, args=(stop,), kwargs={"first_backoff_s": 0.02}, daemon=True)

    def until(cond, what: str) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    try:
        t.start()
        until(lambda: getattr(w.error, "status", None) == 403, "a refused first read")
        time.sleep(0.2)  # several refused retries
        assert not w.removed.is_set() and not w.read_once
        assert followed() == "sparsegate_agent_daemonset_followed 0.0"  # what the e2e waits for
        d = decide_from_daemonset(*w.read("sg", "sg-agent", grace_s=0))
        assert d.action == ExitAction.KEEP and "never read" in d.reason

        reply["status"] = 200  # the RoleBinding takes effect
        until(lambda: w.read_once and reply["lists"] >= 1, "a successful list")
        assert followed() == "sparsegate_agent_daemonset_followed 1.0"
        assert decide_from_daemonset(*w.read("sg", "sg-agent", grace_s=0)).action == ExitAction.KEEP

        reply["status"] = 403  # the release's RBAC is deleted
        until(w.removed.is_set, "the refusal taken for removal")
        d = decide_from_daemonset(*w.read("sg", "sg-agent", grace_s=0))
        assert d.action == ExitAction.DETACH and "credentials" in d.reason

        reply["status"] = 200  # seen again (a transient refusal): the verdict is cleared
        until(lambda: not w.removed.is_set(), "the DaemonSet seen again")
        assert decide_from_daemonset(*w.read("sg", "sg-agent", grace_s=0)).action == ExitAction.KEEP
    finally:
        stop.set()
        t.join(timeout=5)
        server.shutdown()
        server.server_close()
