"""Leader election over a Lease: the pure decisions (domain.lease) and the elector (clients.leader)
against a fake API (our own wrapper's ``request``) on an injected monotonic clock."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest

from sparsegate import cli
from sparsegate.clients.kube import Conflict, KubeError, NotFound
from sparsegate.clients.leader import LOST_EXIT_CODE, LeaderElector
from sparsegate.domain import lease

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)
PATH = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l"


def held(by, *, renewed=NOW, duration=15, rv="7"):
    return {"metadata": {"name": "l", "namespace": "ns", "resourceVersion": rv},
            "spec": {"holderIdentity": by, "leaseDurationSeconds": duration,
                     "renewTime": lease.format_time(renewed)}}


# -- pure decisions --------------------------------------------------------------------------

@pytest.mark.parametrize("skew_h", [0, -5, +5, -1000, +1000])
def test_expiry_is_measured_from_observation_never_from_the_holders_timestamps(skew_h):
    """A holder whose clock is hours off (renewTime far past or future) changes nothing: the Lease
    expires for us leaseDuration after we last saw it change, on our monotonic clock."""
    record = held("b", renewed=NOW + datetime.timedelta(hours=skew_h))
    seen = lease.observe(None, record, now=100.0)
    assert not lease.may_acquire(seen, identity="a", now=100.0)
    # The same record read again later: the observation (and its time) stays.
    again = lease.observe(seen, record, now=114.0)
    assert again.observed_at == 100.0
    assert not lease.may_acquire(again, identity="a", now=115.0)  # exactly 15 s: not yet
    assert lease.may_acquire(again, identity="a", now=115.1)
    assert lease.expires_in(again, now=110.0) == pytest.approx(5.0)


def test_a_change_restarts_the_expiry_clock():
    seen = lease.observe(None, held("b", rv="7"), now=100.0)
    renewed = lease.observe(seen, held("b", renewed=NOW + datetime.timedelta(seconds=2), rv="8"), now=113.0)
    assert renewed.observed_at == 113.0
    assert not lease.may_acquire(renewed, identity="a", now=120.0)
    assert lease.may_acquire(renewed, identity="a", now=128.1)
    # Another holder's leaseDurationSeconds counts, not ours.
    short = lease.observe(renewed, held("c", duration=3, rv="9"), now=130.0)
    assert lease.may_acquire(short, identity="a", now=133.1)


def test_absent_free_or_own_lease_can_be_taken_at_once():
    assert lease.may_acquire(lease.observe(None, None, now=0.0), identity="a", now=0.0)
    free = held(None)
    assert lease.may_acquire(lease.observe(None, free, now=0.0), identity="a", now=0.0)
    assert lease.may_acquire(lease.observe(None, held("a"), now=0.0), identity="a", now=0.0)


def test_claim_counts_transitions_keeps_resource_version_and_always_changes_the_record():
    taken = lease.claimed(held("b", renewed=NOW - datetime.timedelta(seconds=30)), name="l", namespace="ns",
                          identity="a", duration_s=15, now=NOW)
    assert taken["spec"]["holderIdentity"] == "a" and taken["spec"]["leaseTransitions"] == 1
    assert taken["metadata"]["resourceVersion"] == "7"
    assert lease.parse_time(taken["spec"]["renewTime"]) == NOW
    # Renewing in the same microsecond (or with a clock stepped back onto the same stamp) still
    # changes renewTime: otherwise standbys would see no change and take over from a live leader.
    renewed = lease.claimed(taken, name="l", namespace="ns", identity="a", duration_s=15, now=NOW)
    assert renewed["spec"]["leaseTransitions"] == 1
    assert renewed["spec"]["renewTime"] != taken["spec"]["renewTime"]
    fresh = lease.claimed(None, name="l", namespace="ns", identity="a", duration_s=15, now=NOW)
    assert "resourceVersion" not in fresh["metadata"] and fresh["spec"]["leaseTransitions"] == 0
    free = lease.released(renewed, now=NOW)
    assert free["spec"]["holderIdentity"] is None and free["metadata"]["resourceVersion"] == "7"


@pytest.mark.parametrize("kwargs, message", [
    ({"renew_deadline_s": 15}, "shorter than the lease duration"),
    ({"renew_deadline_s": 20}, "shorter than the lease duration"),
    ({"retry_period_s": 9}, "1.2 x retry period"),
    ({"retry_period_s": 0}, "positive"),
    ({"lease_duration_s": 0}, "whole number"),
    ({"lease_duration_s": 15.5}, "whole number"),
    # NaN passes every comparison: a leader that never gives up, a standby that never waits.
    ({"renew_deadline_s": float("nan")}, "finite"),
    ({"retry_period_s": float("nan")}, "finite"),
    ({"retry_period_s": float("inf")}, "finite"),
])
def test_timing_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lease.Timing(**kwargs)


def test_defaults_are_controller_runtimes():
    timing = lease.Timing()
    assert (timing.lease_duration_s, timing.renew_deadline_s, timing.retry_period_s) == (15, 10.0, 2.0)


def test_cli_flags_carry_and_validate_the_durations(capsys):
    parse = cli._parser().parse_args
    args = parse(["run", "--leader-elect"])
    assert cli.election_timing(args) == lease.Timing()
    args = parse(["run", "--lease-duration", "30", "--renew-deadline", "20", "--retry-period", "4"])
    assert cli.election_timing(args) == lease.Timing(30, 20.0, 4.0)
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--leader-elect", "--lease-duration", "10", "--renew-deadline", "10"])
    assert exc.value.code == 2
    assert "must be shorter than the lease duration" in capsys.readouterr().err


# -- the elector on a fake clock and a fake API ------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Exited(BaseException):
    """Stands in for os._exit: nothing after the loss may run."""


class FakeApi:
    """The Lease endpoint of an API server, with optimistic concurrency, behind our wrapper's
    ``request``. ``fail`` may raise (or advance the clock) before a request is served."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.lease: dict[str, Any] | None = None
        self.rv = 0
        self.fail: Callable[[str, float], None] | None = None
        self.calls: list[tuple[str, float, float]] = []  # (method, start, timeout)

    def request(self, method: str, path: str, *, body: Any = None, timeout: float, **_: Any) -> dict:
        self.calls.append((method, self.clock.t, timeout))
        if self.fail is not None:
            self.fail(method, timeout)
        if method == "GET":
            if self.lease is None:
                raise NotFound(404, "Not Found", {})
            return self.lease
        if method == "POST" and self.lease is not None:
            raise Conflict(409, "Conflict", {})
        if method == "PUT" and body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", {})
        self.store(body)
        return self.lease

    def store(self, body: dict[str, Any]) -> None:
        self.rv += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.rv)}}


def elector(api: FakeApi, clock: Clock, identity: str = "a", *, exits: list[int] | None = None,
            wall: datetime.datetime = NOW) -> LeaderElector:
    def exit_(code: int) -> None:
        if exits is not None:
            exits.append(code)
        raise Exited(code)
    return LeaderElector(api, name="l", namespace="ns", identity=identity, clock=clock,  # type: ignore[arg-type]
                         wall=lambda: wall, exit=exit_)


def test_a_standby_waits_a_full_lease_from_its_first_sight_whatever_renewTime_says():
    clock = Clock()
    api = FakeApi(clock)
    # The holder died long ago by its stamp (an hour back) -- we cannot know its clock, so we wait.
    api.store(held("b", renewed=NOW - datetime.timedelta(hours=1)))
    b = elector(api, clock, "standby")
    assert not b.try_acquire_or_renew()
    clock.t += 15
    assert not b.try_acquire_or_renew()
    clock.t += 0.5
    assert b.try_acquire_or_renew() and api.lease["spec"]["holderIdentity"] == "standby"
    # A holder whose stamp lies an hour in the future does not block longer either.
    api2 = FakeApi(clock)
    api2.store(held("b", renewed=NOW + datetime.timedelta(hours=1)))
    c = elector(api2, clock, "c")
    assert not c.try_acquire_or_renew()
    clock.t += 15.5
    assert c.try_acquire_or_renew()


def test_a_renewing_leader_keeps_the_standby_out():
    clock = Clock()
    api = FakeApi(clock)
    leader, standby = elector(api, clock, "a"), elector(api, clock, "b")
    assert leader.try_acquire_or_renew()
    for _ in range(20):  # 40 s of renewals every 2 s; the standby polls in between
        clock.t += 1
        assert not standby.try_acquire_or_renew()
        clock.t += 1
        assert leader.renew_once()
    assert api.lease["spec"]["holderIdentity"] == "a"


@pytest.mark.parametrize("error", [ConnectionResetError("reset by peer"), socket.timeout("timed out"),
                                   OSError("network unreachable"), KubeError(500, "x", {}),
                                   ValueError("a bug")])
def test_any_failure_of_renewal_ends_leadership_at_the_deadline(error):
    clock = Clock()
    api = FakeApi(clock)
    exits: list[int] = []
    a = elector(api, clock, exits=exits)
    assert a.try_acquire_or_renew()
    started = a.renewed_at

    def broken(method: str, timeout: float) -> None:
        raise error
    api.fail = broken
    # Failed attempts every 2 s are logged and retried while the deadline is ahead...
    for _ in range(4):
        clock.t += 2
        assert a.renew_once() and not exits
    # ...and the first check at or after it ends the process.
    clock.t = started + 10
    with pytest.raises(Exited):
        a.renew_once()
    assert exits == [LOST_EXIT_CODE]


def test_no_request_may_outlive_the_deadline():
    """Each election request's timeout is at most the time left before the renew deadline."""
    clock = Clock()
    api = FakeApi(clock)
    exits: list[int] = []
    a = elector(api, clock, exits=exits)
    assert a.try_acquire_or_renew()
    deadline = a.deadline()

    def slow(method: str, timeout: float) -> None:
        # The API hangs: the request runs until its timeout, then fails like urllib3 would.
        assert clock.t + timeout <= deadline + 1e-9, (method, clock.t, timeout, deadline)
        clock.t += timeout
        raise socket.timeout("read timed out")
    api.fail = slow
    clock.t += 2
    with pytest.raises(Exited):  # one call burns all the time left; the check after it exits
        a.renew_once()
    assert clock.t == pytest.approx(deadline) and exits == [LOST_EXIT_CODE]
    assert api.calls[-1][2] == pytest.approx(8.0)


def test_the_watchdog_check_needs_no_request():
    clock = Clock()
    api = FakeApi(clock)
    a = elector(api, clock, exits=[])
    assert a.try_acquire_or_renew()
    clock.t += 9.9
    assert a.check_deadline()
    clock.t += 0.1
    with pytest.raises(Exited):
        a.check_deadline()


def test_another_holder_ends_leadership_at_once():
    clock = Clock()
    api = FakeApi(clock)
    exits: list[int] = []
    a = elector(api, clock, exits=exits)
    assert a.try_acquire_or_renew()
    api.store(held("intruder", rv="ignored"))
    clock.t += 2
    with pytest.raises(Exited):
        a.renew_once()
    assert exits == [LOST_EXIT_CODE]


def test_a_conflict_is_a_failed_attempt_not_a_loss():
    clock = Clock()
    api = FakeApi(clock)
    exits: list[int] = []
    a = elector(api, clock, exits=exits)
    assert a.try_acquire_or_renew()

    def someone_labels_the_lease(method: str, timeout: float) -> None:
        if method == "PUT":
            api.store(api.lease)  # same holder, new resourceVersion: our PUT conflicts
    api.fail = someone_labels_the_lease
    clock.t += 2
    assert a.renew_once() and not exits
    api.fail = None
    clock.t += 2
    assert a.renew_once() and a.renewed_at == clock.t


def test_release_frees_the_lease_only_while_leading():
    clock = Clock()
    api = FakeApi(clock)
    a = elector(api, clock)
    a.release()  # never led: nothing written
    assert api.lease is None
    assert a.try_acquire_or_renew()
    a.release()
    assert api.lease["spec"]["holderIdentity"] is None
    b = elector(api, clock, "b")
    assert b.try_acquire_or_renew()  # at once, no expiry wait


# -- the threads, on the real clock with short durations ---------------------------------------

def test_renewer_thread_survives_errors_and_watchdog_exits_at_the_deadline():
    timing = lease.Timing(lease_duration_s=2, renew_deadline_s=0.6, retry_period_s=0.1)
    api = FakeApi(Clock())
    exited = threading.Event()
    exits: list[tuple[int, float]] = []

    def exit_(code: int) -> None:
        exits.append((code, time.monotonic()))
        exited.set()
    a = LeaderElector(api, name="l", namespace="ns", identity="a", timing=timing, exit=exit_)  # type: ignore[arg-type]
    assert a.try_acquire_or_renew()
    a.keep()
    time.sleep(0.35)  # a few good renewals
    renewed = a.renewed_at
    assert renewed is not None and not exits

    def hang(method: str, timeout: float) -> None:
        time.sleep(timeout)  # a request stuck until its timeout, then reset
        raise ConnectionResetError("reset")
    api.fail = hang
    assert exited.wait(3.0), "the process did not stop"
    code, at = exits[0]
    # Stopped at the deadline after the last good renewal began, not a renewal period later.
    assert code == LOST_EXIT_CODE
    # (0.5 s of slack for a loaded 2-core machine.)
    assert a.renewed_at + 0.6 <= at < a.renewed_at + 0.6 + 0.5, (at - a.renewed_at)
    assert len(exits) == 1 and all(t.name.startswith("lease-") for t in a._threads)
    a.stop()


def test_clean_stop_ends_the_threads_and_hands_the_lease_back():
    timing = lease.Timing(lease_duration_s=2, renew_deadline_s=0.6, retry_period_s=0.1)
    api = FakeApi(Clock())
    a = LeaderElector(api, name="l", namespace="ns", identity="a", timing=timing,  # type: ignore[arg-type]
                      exit=lambda code: pytest.fail("exited on a clean stop"))
    assert a.try_acquire_or_renew()
    a.keep()
    time.sleep(0.3)
    a.stop()
    assert not any(t.is_alive() for t in a._threads)
    a.release()
    assert api.lease["spec"]["holderIdentity"] is None
    time.sleep(0.7)  # past the old deadline: the disarmed watchdog stays quiet


# -- the real exit, in a child process ---------------------------------------------------------

LOSE = """
import logging, sys, threading
from sparsegate.clients.leader import LeaderElector
class Stuck(logging.Handler):
    def emit(self, record):
        threading.Event().wait()  # a stalled log pipe
logging.basicConfig(stream=sys.stderr)
if sys.argv[1] == "stuck":
    logging.getLogger().addHandler(Stuck())
LeaderElector(None, name="l", namespace="ns", identity="a").lose("test")
print("still running")
"""


@pytest.mark.parametrize("logging_", ["ok", "stuck"])
def test_a_loss_ends_the_process_at_once_with_status_1(logging_):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", LOSE, logging_], capture_output=True, text=True, timeout=30)
    assert proc.returncode == LOST_EXIT_CODE == 1 and "still running" not in proc.stdout, proc
    assert "leader election lost (test)" in proc.stderr
    if logging_ == "stuck":  # the backstop ends it although the log call never returns
        assert time.monotonic() - t0 < 10


# -- a clean stop: nothing of this process writes once Kopf has returned -----------------------

KOPF_STOP = r"""
import asyncio, json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# An API server with no resources: Kopf's discovery finds nothing to watch.
class Api(BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/api": {"kind": "APIVersions", "versions": []},
                "/apis": {"kind": "APIGroupList", "groups": []}}.get(self.path.split("?")[0])
        data = json.dumps(body or {"kind": "Status", "code": 404}).encode()
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
threading.Thread(target=server.serve_forever, daemon=True).start()
with open(sys.argv[1], "w") as f:
    f.write(f"apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{server.server_port}'}}}}]\n"
            "users: [{name: u, user: {token: t}}]\n"
            "contexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n")
os.environ["KUBECONFIG"] = sys.argv[1]

import kopf  # the Kubernetes client reads $KUBECONFIG on import
from kopf._core.intents import causes, registries
import sparsegate.main
from sparsegate.handlers.pools import loop_reader
from sparsegate.memo import OperatorMemo

# `sparsegate run`'s startup configuration and every cleanup handler it has; no resource handler,
# so discovery is all Kopf asks of the API server.
registry = registries.SmartOperatorRegistry()
for handler in registries.get_default_registry()._activities.get_all_handlers():
    if handler.activity == causes.Activity.CLEANUP or handler.fn is sparsegate.main.configure:
        registry._activities.append(handler)
stop, done = threading.Event(), []

@kopf.on.startup(registry=registry)
async def start_a_reconcile(memo, **_):
    await asyncio.sleep(0.2)  # after sparsegate.main.configure made the pools
    read = loop_reader(lambda: "index")  # as a reconcile reads the Kopf indexes from its thread

    def reconcile():
        stop.wait(30)
        time.sleep(1.0)  # still applying when Kopf has cancelled its handlers (milliseconds later)
        done.append(read())  # then its status write, from what the indexes hold
    memo.model_pool.submit(reconcile)
    threading.Timer(0.5, stop.set).start()  # SIGTERM, once Kopf is up

kopf.run(registry=registry, clusterwide=False, namespaces=["x"], standalone=True, memo=OperatorMemo(),
         stop_flag=stop)
print("returned after:", done)
"""


def test_kopf_returns_only_once_the_pools_work_is_done_so_the_lease_is_handed_over_after_it(tmp_path):
    """``sparsegate run --leader-elect`` hands the Lease over as soon as ``kopf.run`` returns. Kopf
    cancels the handlers that await a pool thread, not the thread: a reconcile running at SIGTERM
    went on (its index reads failing once the loop was closed) while the standby already led."""
    proc = subprocess.run([sys.executable, "-c", KOPF_STOP, str(tmp_path / "kubeconfig")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "returned after: ['index']", proc.stderr[-3000:]


def test_shutdown_waits_for_the_models_service_applies_too_and_drops_those_only_queued():
    """A model's Service apply runs in a pool of its own that no reconcile waits for
    (``modelsync.PendingService``), and Kopf cancels the handler that does: at shutdown an apply
    already running went on after ``kopf.run`` returned and the Lease was handed over, and one only
    queued (8 threads, thousands of models) started afterwards."""
    import asyncio
    import concurrent.futures

    import kopf

    import sparsegate.main
    from sparsegate.handlers import modelsync

    release, started, landed = threading.Event(), threading.Event(), []

    class SlowKube:
        def apply(self, obj):
            started.set()
            release.wait(10)
            time.sleep(0.2)
            landed.append(obj["metadata"]["name"])

    kube = SlowKube()
    service = {"kind": "Service", "metadata": {"name": "m", "namespace": "ns"}}
    running = modelsync.start_service_apply(kube, ("ns", "m"), service, None)
    assert started.wait(5)
    blockers = [modelsync._SERVICE_POOL.submit(release.wait, 10) for _ in range(7)]  # the pool's other threads
    queued = modelsync.start_service_apply(kube, ("ns", "q"), {**service, "metadata": {"name": "q"}}, None)
    memo = kopf.Memo()
    memo.model_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    memo.status_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    threading.Timer(0.3, release.set).start()  # the apply ends a moment after SIGTERM
    try:
        asyncio.run(sparsegate.main.finish_pool_work(memo=memo))
        assert landed == ["m"]  # the running one has landed when the cleanup returns
        assert running.done() and queued.cancelled()
    finally:
        release.set()
        concurrent.futures.wait([running, queued, *blockers], timeout=10)
    time.sleep(0.3)
    assert landed == ["m"]  # the queued one never ran
