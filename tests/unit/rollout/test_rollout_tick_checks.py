"""The rollout tick (controllers.rollout.RolloutLoop) with declared checks and across a restart.

Our own wrappers stand in for the cluster and the pods (``Kube``: one GateConfig object whose
status JSON patches are applied; ``PodAdmin``: pods that take pushes and expose counters); the
web check's target is a real HTTP server on loopback, and the tick's code runs unchanged.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

import sparsegate.controllers.rollout as controller
from sparsegate.clients.podadmin import PodAdmin, PodHealth, PodTarget, PushResult
from sparsegate.domain.rollout import GateVersion
from sparsegate.clients.kube import Conflict, KubeError
from sparsegate.controllers.rollout import RolloutLoop, RolloutCache, Fleet
from sparsegate.domain import admin_tls, render
from sparsegate_contracts import names
from sparsegate_contracts.canary import document_key
from sparsegate_contracts.canary import parse_gate_set
from sparsegate_contracts.gate import GateParamsError

V1 = {"toolGateThreshold": 0.85}
V2 = {"toolGateThreshold": 0.8}
PODS = ("m-0", "m-1", "m-2", "m-3")


class FakeKube:
    """One GateConfig: GET returns a copy, PATCH .../status applies the tick's JSON patch."""

    def __init__(self, spec: dict) -> None:
        self.obj: dict[str, Any] = {"metadata": {"name": "gate", "namespace": "ns", "generation": 1,
                                                 "resourceVersion": "1", "annotations": {}}, "spec": spec}

    def get(self, kind: str, *, namespace: str, name: str) -> dict | None:
        assert kind == "GateConfig"
        return copy.deepcopy(self.obj)

    def request(self, method: str, path: str, *, body: Any = None, query: Any = None,
                content_type: str | None = None) -> dict:
        assert method == "PATCH" and path.endswith("/gateconfigs/gate/status"), (method, path)
        for op in body:
            if op["path"] == "/metadata/resourceVersion":
                assert op["value"] == self.obj["metadata"]["resourceVersion"]
            else:
                self.obj["status"] = copy.deepcopy(op["value"])
        self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(self.obj)

    def set_spec(self, spec: dict) -> None:
        self.obj["spec"] = spec
        self.obj["metadata"]["generation"] += 1

    @property
    def status(self) -> dict:
        return self.obj.get("status") or {}


class FakePods(PodAdmin):
    """Pods that apply pushes and count requests: ``rate`` per second, ``errors`` the 5xx share."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.versions = {p: GateVersion.from_params(V1).version for p in PODS}
        self.clock = clock
        self.rate, self.errors = 50.0, 0.0

    async def health(self, targets: Any) -> dict[str, PodHealth]:
        return {t.name: PodHealth(name=t.name, version=self.versions[t.name]) for t in targets}

    async def push(self, pushes: Any) -> dict[str, PushResult]:
        for target, doc in pushes:
            self.versions[target.name] = doc["version"]
        return {t.name: PushResult(name=t.name, ok=True, version=d["version"]) for t, d in pushes}

    async def scrape(self, targets: Any, *, names: Any = ()) -> dict[str, str]:
        # As the model server labels them: by the gate version that served the requests (here the
        # pod's whole history is counted under its current version).
        n = self.rate * self.clock[0]
        bad = n * self.errors

        def text(version: str) -> str:
            v = f'gate_version="{version}"'
            return (f'sparsegate_requests_total{{code="200",{v}}} {n - bad}\n'
                    f'sparsegate_requests_total{{code="503",{v}}} {bad}\n'
                    f'sparsegate_request_duration_seconds_bucket{{{v},le="0.1"}} {n}\n'
                    f'sparsegate_request_duration_seconds_bucket{{{v},le="+Inf"}} {n}\n')
        return {t.name: text(self.versions[t.name]) for t in targets}


class Loop(RolloutLoop):
    async def _fleet(self, *, namespace: str, models: Any, inventory: Any) -> Fleet:
        targets = {p: PodTarget(name=p, ip="127.0.0.1", port=1) for p in PODS}
        return Fleet(targets=targets, all_pods=PODS)

    async def credentials(self, *, namespace: str, fleet: Fleet, pods: Any, cache: Any) -> dict[str, PodTarget]:
        return {p: fleet.targets[p] for p in pods}  # FakePods takes pushes without a token


@pytest.fixture(autouse=True)
def no_kopf_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(controller.kopf, "event", lambda body, *, type, reason, message: events.append((reason, message)))
    return events


@pytest.fixture
async def judge() -> AsyncIterator[dict[str, Any]]:
    state: dict[str, Any] = {"score": 0.95, "asked": [], "queries": []}

    async def score(request: web.Request) -> web.Response:
        state["asked"].append(request.query.get("v"))
        state["queries"].append(dict(request.query))
        return web.json_response({"score": state["score"]})

    app = web.Application()
    app.router.add_get("/score", score)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        yield state
    finally:
        await runner.cleanup()


def spec(params: dict, *, checks: list[dict] | None = None) -> dict:
    rollout: dict[str, Any] = {"steps": [25, 100], "analysisInterval": "10s", "minRequests": 5,
                               "strategy": "instances"}
    if checks is not None:
        rollout["analysis"] = {"checks": checks}
    return {"params": params, "rollout": rollout, "calibration": {"qpsThreshold": {"initial": 1}}}


async def tick(loop: RolloutLoop, cache: RolloutCache, clock: list[float], dt: float) -> dict:
    clock[0] += dt
    await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None)  # type: ignore[arg-type]
    return loop.kube.obj["status"]  # type: ignore[attr-defined]


async def test_web_check_measured_when_due_and_recorded(judge: dict[str, Any]) -> None:
    clock = [1000.0]
    kube = FakeKube(spec(V1))
    pods = FakePods(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    assert (await tick(loop, cache, clock, 1))["rollout"]["phase"] == "Succeeded"
    check = {"name": "quality", "provider": {"web": {"url": judge["url"] + "/score?v={{args.canaryVersion}}",
                                                      "jsonPath": "score"}},
             "successCondition": "result >= 0.9", "interval": "5s", "count": 2}
    kube.set_spec(spec(V2, checks=[check]))
    new = GateVersion.from_params(V2).version
    st = await tick(loop, cache, clock, 1)
    assert st["rollout"]["phase"] == "Analysing" and list(pods.versions.values()).count(new) == 1
    assert judge["asked"] == []
    st = await tick(loop, cache, clock, 5)
    assert judge["asked"] == [new]
    run = st["analysisRuns"][-1]
    assert run["phase"] == "Running" and run["checks"][0]["measurements"][0]["value"] == 0.95
    st = await tick(loop, cache, clock, 2)
    assert judge["asked"] == [new]  # not due again before the interval
    st = await tick(loop, cache, clock, 3)
    # Promoted to step 2: pushed, and in the same tick observed again, every pod in place.
    assert st["rollout"]["phase"] == "Analysing" and st["rollout"]["step"] == 2 and st["rollout"]["reason"] == "Analysing"
    assert st["analysisRuns"][0]["phase"] == "Successful" and st["analysisRuns"][0]["checks"][0]["count"] == 2


async def test_pod_placeholders_under_the_requests_strategy(judge: dict[str, Any]) -> None:
    """Under `requests` every pod serves both versions: {{args.stablePods}} names them all, as the
    builtin's stable group (it was `_`, no pod, so a canary-vs-stable query had no stable data)."""
    class SetPods(FakePods):  # pods that take a stable + canary set and report its key
        async def health(self, targets: Any) -> dict[str, PodHealth]:
            return {t.name: PodHealth(name=t.name, version=self.versions[t.name].split("+")[0],
                                      served=self.versions[t.name]) for t in targets}

        async def push(self, pushes: Any) -> dict[str, PushResult]:
            for target, doc in pushes:
                self.versions[target.name] = document_key(doc)
            return {t.name: PushResult(name=t.name, ok=True, version=document_key(d)) for t, d in pushes}

    clock = [1000.0]
    kube = FakeKube(spec(V1))
    loop, cache = Loop(kube=kube, admin=SetPods(clock), clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    requests = spec(V2, checks=[{"name": "q", "provider": {"web": {
        "url": judge["url"] + "/score?c={{args.canaryPods}}&s={{args.stablePods}}", "jsonPath": "score"}},
        "successCondition": "result >= 0.9", "interval": "5s"}])
    requests["rollout"]["strategy"] = "requests"
    kube.set_spec(requests)
    assert (await tick(loop, cache, clock, 1))["rollout"]["phase"] == "Analysing"
    await tick(loop, cache, clock, 5)
    assert judge["queries"] == [{"c": "|".join(PODS), "s": "|".join(PODS)}]


async def test_a_step_whose_pods_all_went_waits_for_them_instead_of_promoting() -> None:
    """The model's Deployment deleted mid-step (re-created by the operator a moment later): its pods
    fail the owner check (Deployment not found) or are going, so the fleet has none for a tick or
    more while the model lives. The canary was judged on no pod: it must not be promoted as
    'no instances use this GateConfig'."""
    replaced: list[bool] = []

    class Replaced(Loop):
        async def _fleet(self, *, namespace: str, models: Any, inventory: Any) -> Fleet:
            if not replaced:
                return await super()._fleet(namespace=namespace, models=models, inventory=inventory)
            # What RolloutLoop._fleet returns then (tests/unit/rollout/test_admin_fleet.py).
            return Fleet(targets={}, all_pods=(), withheld={p: (f"{p}-uid", "Deployment m not found") for p in PODS},
                         server_names={"m": "m.ns.admin.sparsegate.dev"})

    clock = [1000.0]
    kube = FakeKube(spec(V1))
    loop, cache = Replaced(kube=kube, admin=FakePods(clock), clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec(V2))
    assert (await tick(loop, cache, clock, 1))["rollout"]["phase"] == "Analysing"
    replaced.append(True)
    for _ in range(3):
        st = await tick(loop, cache, clock, 5)
        assert st["rollout"]["phase"] == "Progressing", st["rollout"]
    assert st["rollout"]["reason"] == "WaitingForInstances"
    assert st["stable"]["version"] == GateVersion.from_params(V1).version


async def test_inconclusive_web_check_pauses(judge: dict[str, Any], no_kopf_events: list) -> None:
    clock = [1000.0]
    kube = FakeKube(spec(V1))
    loop, cache = Loop(kube=kube, admin=FakePods(clock), clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    judge["score"] = 0.7
    kube.set_spec(spec(V2, checks=[{"name": "quality", "provider": {"web": {"url": judge["url"] + "/score",
                                                                              "jsonPath": "score"}},
                                    "successCondition": "result >= 0.9", "failureCondition": "result < 0.5",
                                    "interval": "5s"}]))
    await tick(loop, cache, clock, 1)
    before = controller.MEASUREMENTS.labels(provider="web", answer="value")._value.get()
    st = await tick(loop, cache, clock, 5)
    assert controller.MEASUREMENTS.labels(provider="web", answer="value")._value.get() == before + 1
    assert st["rollout"]["phase"] == "Paused" and st["rollout"]["analysisPaused"] is True
    assert st["rollout"]["reason"] == "AnalysisInconclusive" and ("AnalysisInconclusive", st["rollout"]["message"]) \
        in no_kopf_events


async def test_operator_restart_needs_a_full_window_of_fresh_data() -> None:
    """The builtin direct scrape, through the real tick: the restarted process (new loop, new cache)
    scrapes a new window start and does not promote until analysisInterval of data from it."""
    clock = [1000.0]
    kube = FakeKube(spec(V1))
    pods = FakePods(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec(V2))
    st = await tick(loop, cache, clock, 1)
    assert st["rollout"]["phase"] == "Analysing"
    started = clock[0]
    st = await tick(loop, cache, clock, 1)  # the window's first scrape
    first_from = st["rollout"]["analysisWindow"]["from"]
    for _ in range(4):
        st = await tick(loop, cache, clock, 1)
    assert st["rollout"]["phase"] == "Analysing" and st["rollout"]["analysis"]["verdict"] == "Pass"
    # Crash 6 s into the 10 s window; back 20 s later with no memory but status.
    clock[0] += 20
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    st = await tick(loop, cache, clock, 0)
    assert st["rollout"]["analysisWindow"]["from"] != first_from and st["rollout"]["analysisWindow"]["samples"] == 0
    assert "analysis window restarted" in st["rollout"]["message"]
    restarted = clock[0]
    assert restarted - started > 10  # wall time since the analysis began is long past the window...
    for _ in range(9):
        st = await tick(loop, cache, clock, 1)
        assert st["rollout"]["phase"] == "Analysing", "promoted on less than a window of fresh data"
    st = await tick(loop, cache, clock, 1)  # ...but only now is there 10 s of data after the restart
    assert st["rollout"]["step"] == 2 and st["analysisRuns"][0]["phase"] == "Successful"
    assert st["analysisRuns"][0]["checks"][0]["measurements"][-1]["time"] == st["rollout"]["stepStartedAt"]


class CountingKube(FakeKube):
    """FakeKube that counts GETs and answers a status write based on an old resourceVersion with a
    409, as the API server does."""

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.gets = 0

    def get(self, kind: str, *, namespace: str, name: str) -> dict | None:
        self.gets += 1
        return super().get(kind, namespace=namespace, name=name)

    def request(self, method: str, path: str, *, body: Any = None, query: Any = None,
                content_type: str | None = None) -> dict:
        for op in body:
            if op["path"] == "/metadata/resourceVersion" and op["value"] != self.obj["metadata"]["resourceVersion"]:
                raise Conflict(409, "Conflict", "the object has been modified")
        return super().request(method, path, body=body, query=query, content_type=content_type)

    def touch(self) -> None:
        """Someone else's write (a label, say): a new resourceVersion, still resting."""
        self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)


async def test_a_resting_pod_check_starts_from_the_watched_copy_unless_it_is_stale() -> None:
    clock = [1000.0]
    kube = CountingKube(spec(V1))
    pods = FakePods(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None)  # type: ignore[arg-type]
    assert kube.gets == 1 and loop.resting(kube.obj)
    stable = GateVersion.from_params(V1).version

    async def check(seen: dict, changes: int) -> None:
        clock[0] += 1
        await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None,  # type: ignore[arg-type]
                        seen=seen, pod_changes=changes)

    # The watch delivered the written object; a pod comes back without the stable gate: pushed, no GET.
    seen = RolloutLoop.quiet_view(copy.deepcopy(kube.obj))
    assert "snapshot" in seen
    pods.versions["m-0"] = "something-else"
    await check(seen, 1)
    assert kube.gets == 1 and pods.versions["m-0"] == stable
    # A copy at a resourceVersion our own write replaced predates that write: read the object.
    old = RolloutLoop.quiet_view(copy.deepcopy(kube.obj))
    cache.superseded.append(kube.obj["metadata"]["resourceVersion"])
    await check(old, 2)
    assert kube.gets == 2
    # A copy someone else's write made stale: whatever the check writes is a 409 (nothing acted on),
    # and the next check reads the object.
    cache.superseded.clear()
    stale = RolloutLoop.quiet_view(copy.deepcopy(kube.obj))
    kube.touch()
    kube.obj["status"]["rollout"]["message"] = "written by another process"
    pods.versions["m-1"] = "something-else"
    with pytest.raises(Conflict):
        await check(stale, 3)
    assert cache.read_fresh and pods.versions["m-1"] == "something-else" and kube.gets == 2
    await check(stale, 4)
    assert kube.gets == 3 and not cache.read_fresh and pods.versions["m-1"] == stable


class FlakyKube(CountingKube):
    """The API server answers ``failures`` status writes with a 503 (etcd slow), then recovers."""

    failures = 0

    def request(self, method: str, path: str, *, body: Any = None, query: Any = None,
                content_type: str | None = None) -> dict:
        if self.failures:
            self.failures -= 1
            raise KubeError(503, "Service Unavailable", "etcdserver: request timed out")
        return super().request(method, path, body=body, query=query, content_type=content_type)


@pytest.mark.parametrize("trouble", ["503", "conflict"])
async def test_a_resting_pod_check_that_failed_is_not_counted_as_done(trouble: str) -> None:
    """A pod back without the stable gate, whose check failed on the API server (a 503) or lost a
    race (409): the next tick checks again, not the safety net RESTING_CHECK_S later."""
    clock = [1000.0]
    kube = FlakyKube(spec(V1))
    pods = FakePods(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None)  # type: ignore[arg-type]
    stable = GateVersion.from_params(V1).version
    seen = RolloutLoop.quiet_view(copy.deepcopy(kube.obj))
    if trouble == "503":
        kube.failures = 1
    else:
        kube.touch()  # someone else's write: the watched copy is stale
    pods.versions["m-1"] = "something-else"
    clock[0] += 1
    with pytest.raises(KubeError):
        await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None,  # type: ignore[arg-type]
                        seen=seen, pod_changes=1)
    assert pods.versions["m-1"] == "something-else"
    assert loop.next_tick_in(seen, cache=cache, interval_s=5) in (None, 5)  # None: the tick interval
    clock[0] += 5  # the next tick, no further pod event
    await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None,  # type: ignore[arg-type]
                    seen=RolloutLoop.quiet_view(copy.deepcopy(kube.obj)), pod_changes=1)
    assert pods.versions["m-1"] == stable


async def test_a_resting_push_that_failed_is_tried_again_at_the_next_tick() -> None:
    """A pod back without the stable gate whose push failed (unreachable for a moment): the next
    tick pushes again, not the safety net RESTING_CHECK_S (300 s) later."""
    class FailOnce(FakePods):
        fail = 0

        async def push(self, pushes: Any) -> dict[str, PushResult]:
            if self.fail:
                self.fail -= 1
                return {t.name: PushResult(name=t.name, ok=False, error="PUT /admin/gate: timed out")
                        for t, _ in pushes}
            return await super().push(pushes)

    clock = [1000.0]
    kube = CountingKube(spec(V1))
    pods = FailOnce(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None)  # type: ignore[arg-type]
    stable = GateVersion.from_params(V1).version
    pods.versions["m-1"] = "something-else"
    pods.fail = 1
    clock[0] += 1
    await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None,  # type: ignore[arg-type]
                    seen=RolloutLoop.quiet_view(copy.deepcopy(kube.obj)), pod_changes=1)
    assert pods.versions["m-1"] == "something-else"  # its push failed
    seen = RolloutLoop.quiet_view(copy.deepcopy(kube.obj))
    assert loop.next_tick_in(seen, cache=cache, interval_s=5) in (None, 5)  # None: the tick interval
    clock[0] += 5  # the next tick, no further pod event
    await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None,  # type: ignore[arg-type]
                    seen=seen, pod_changes=1)
    assert pods.versions["m-1"] == stable


async def test_an_unreachable_prometheus_leaves_the_step_waiting_and_says_why() -> None:
    """With SPARSEGATE_PROMETHEUS_URL set, the builtin check reads Prometheus; when it cannot be
    reached the tick still records the step (no exception out of the tick), waits for metrics, and
    the step's message names the failure; nothing is promoted on missing data."""
    from localcluster.ports import free_port

    from sparsegate.clients.metrics_source import PrometheusAPI

    clock = [1000.0]
    kube = FakeKube(spec(V1))
    pods = FakePods(clock)
    down = PrometheusAPI(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)  # nothing listens there
    loop = Loop(kube=kube, admin=pods, clock=lambda: clock[0], prometheus=down)  # type: ignore[arg-type]
    cache = RolloutCache()
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec(V2))
    st = await tick(loop, cache, clock, 1)
    assert st["rollout"]["phase"] == "Analysing"
    for _ in range(4):  # well past analysisInterval (10 s)
        st = await tick(loop, cache, clock, 5)
    assert st["rollout"]["phase"] == "Analysing" and st["rollout"]["step"] == 1, st["rollout"]
    message = st["rollout"]["message"]
    assert "waiting for metrics (" in message and "ClientConnectorError" in message, message


async def test_a_hanging_prometheus_does_not_hold_the_tick_nor_an_abort() -> None:
    """The builtin check's Prometheus groups were awaited inside the tick (5 s a group, two groups,
    up to three looks a tick): an abort waited that long. Bounded like declared checks (check_wait_s);
    an answer still coming is picked up by a later tick."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from sparsegate.clients.metrics_source import PrometheusAPI

    release = asyncio.Event()

    async def query(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"status": "success", "data": {
            "resultType": "vector", "result": [{"metric": {}, "value": [0, "2"]}]}})

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    async with TestServer(app, host="127.0.0.1") as srv:
        clock = [1000.0]
        kube = AnnotatedKube(spec(V1))
        prom = PrometheusAPI(f"http://127.0.0.1:{srv.port}")  # its own timeout: 5 s
        loop = Loop(kube=kube, admin=FakePods(clock), clock=lambda: clock[0], prometheus=prom)  # type: ignore[arg-type]
        loop.check_wait_s = 0.2
        cache = RolloutCache()
        await tick(loop, cache, clock, 1)
        kube.set_spec(spec(V2))
        st = await bounded_tick(loop, cache, clock, 1)
        assert st["rollout"]["phase"] == "Analysing"
        st = await bounded_tick(loop, cache, clock, 5)
        assert "waiting for metrics" in st["rollout"]["message"], st["rollout"]
        release.set()  # the answer comes: a later tick records it
        await asyncio.sleep(0.3)
        st = await bounded_tick(loop, cache, clock, 1)
        assert st["rollout"]["analysis"]["canaryRequests"] == 2.0, st["rollout"]  # the late answer, recorded
        release.clear()
        st = await bounded_tick(loop, cache, clock, 5)
        kube.obj["metadata"]["annotations"]["sparsegate.dev/abort"] = "now"
        st = await bounded_tick(loop, cache, clock, 1)
        assert st["rollout"]["phase"] in ("RollingBack", "Aborted"), st["rollout"]
        release.set()


async def test_a_tick_whose_push_lands_records_one_calibration_sample(no_kopf_events: list) -> None:
    """A tick looks again right after a push lands (to record the verified pods), but it takes one
    calibration sample: the second look's rates would span only the moment since the first."""
    clock = [1000.0]

    def now() -> float:  # each read of the clock is a little later, as in a real tick
        clock[0] += 0.25
        return clock[0]

    kube = FakeKube(spec(V1))
    pods = FakePods(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=now), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec(V2))
    st = await tick(loop, cache, clock, 1)
    counts, steps = [], []
    for _ in range(5):  # through step 1's analysis and the push of step 2
        st = await tick(loop, cache, clock, 5)
        counts.append(len(st["rollout"]["calibration"]["qps"]))
        steps.append(st["rollout"].get("step"))
    assert 2 in steps, steps  # a step was promoted (pushed) within these ticks
    assert all(b - a <= 1 for a, b in zip(counts, counts[1:])), (counts, steps)


class SecretKube(FakeKube):
    """The GateConfig, model ``m`` and its admin Secret (a PUT replaces it, as the API server does)."""

    def __init__(self, spec: dict, *, validity: datetime.timedelta) -> None:
        super().__init__(spec)
        self.model = {"apiVersion": names.API_VERSION, "kind": "SparseModel",
                      "metadata": {"name": "m", "namespace": "ns", "uid": "m-uid", "generation": 1},
                      "status": {"observedGeneration": 1}}
        now = datetime.datetime.now(datetime.timezone.utc)
        cert, key = admin_tls.issue(server_name=SERVER_NAME, now=now, validity=validity)
        secret = render.render_secret(self.model, material=admin_tls.AdminMaterial(token="t0", cert_pem=cert,
                                                                                    key_pem=key))
        secret["metadata"]["resourceVersion"] = "1"
        self.secret = secret
        self.secret_gets = 0

    def get(self, kind: str, *, namespace: str, name: str) -> dict | None:
        if kind == "Secret":
            self.secret_gets += 1
            return copy.deepcopy(self.secret)
        if kind == "SparseModel":
            return copy.deepcopy(self.model)
        return super().get(kind, namespace=namespace, name=name)

    def replace(self, obj: dict) -> dict:
        assert obj["kind"] == "Secret"
        assert obj["metadata"]["resourceVersion"] == self.secret["metadata"]["resourceVersion"]
        self.secret = copy.deepcopy(obj)
        self.secret["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(self.secret)


SERVER_NAME = names.admin_server_name(model="m", namespace="ns")
DAY = 86400.0  # controller.ADMIN_SECRET_CHECK_S by default


class SecretLoop(Loop):
    """Pods of model ``m`` (while ``live``), sent its admin credentials as the real loop sends them."""

    live = True
    credentials = RolloutLoop.credentials  # type: ignore[assignment]

    async def _fleet(self, *, namespace: str, models: Any, inventory: Any) -> Fleet:
        if not self.live:
            return Fleet(targets={}, all_pods=())
        fleet = await super()._fleet(namespace=namespace, models=models, inventory=inventory)
        return dataclasses.replace(fleet, server_names={"m": SERVER_NAME}, model_of=dict.fromkeys(PODS, "m"))


async def test_a_resting_gateconfig_renews_an_admin_certificate_nobody_changed(no_kopf_events: list) -> None:
    """Nothing but a reconcile of the model (a change of it, an operator restart) used to renew its
    admin certificate: a year after the last one every push was refused ("certificate has
    expired"). A resting GateConfig's full checks read each model's Secret once a day and renew one
    ending within admin_tls.RENEW_BEFORE, with no change to the model, before it ends."""
    clock = [1000.0]
    kube = SecretKube(spec(V1), validity=datetime.timedelta(days=20))
    loop = SecretLoop(kube=kube, admin=FakePods(clock), clock=lambda: clock[0])  # type: ignore[arg-type]
    cache = RolloutCache()
    await tick(loop, cache, clock, 1)
    assert loop.resting(kube.obj) and kube.secret_gets == 0  # first seen: its reconcile just checked it
    for _ in range(3):  # resting checks within the day read no Secret
        await tick(loop, cache, clock, controller.RESTING_CHECK_S)
    assert kube.secret_gets == 0 and admin_tls.material_from_secret(kube.secret).token == "t0"
    await tick(loop, cache, clock, DAY)
    assert admin_tls.secret_problem(kube.secret, server_name=SERVER_NAME,
                                    now=datetime.datetime.now(datetime.timezone.utc)) is None
    assert admin_tls.material_from_secret(kube.secret).token != "t0"
    assert kube.secret["metadata"]["ownerReferences"][0]["uid"] == "m-uid"
    assert [r for r, _ in no_kopf_events if r == "AdminSecretReplaced"] == ["AdminSecretReplaced"]
    # Fine now: the next day's check reads it (one GET) and leaves it alone.
    renewed, gets = kube.secret["metadata"]["resourceVersion"], kube.secret_gets
    await tick(loop, cache, clock, DAY)
    assert kube.secret["metadata"]["resourceVersion"] == renewed and kube.secret_gets == gets + 1


async def test_a_model_that_leaves_the_gateconfig_leaves_no_credentials_behind() -> None:
    """The credentials a push built (two TLS contexts, ~19 KiB a model) were kept for as long as
    the GateConfig lived, whatever became of the model: a GateConfig outliving many models grew."""
    clock = [1000.0]
    kube = SecretKube(spec(V1), validity=datetime.timedelta(days=365))
    pods = FakePods(clock)
    loop = SecretLoop(kube=kube, admin=pods, clock=lambda: clock[0])  # type: ignore[arg-type]
    cache = RolloutCache()
    await tick(loop, cache, clock, 1)
    pods.versions["m-0"] = "something-else"  # back from a restart without the stable gate: pushed
    await tick(loop, cache, clock, controller.RESTING_CHECK_S)
    assert pods.versions["m-0"] == GateVersion.from_params(V1).version and kube.secret_gets == 1
    assert list(cache.credentials._entries) == [("ns", "m")]
    loop.live = False  # the model deleted, or pointed at another GateConfig
    await tick(loop, cache, clock, controller.RESTING_CHECK_S)
    assert cache.credentials._entries == {}


async def test_a_pod_that_keeps_refusing_pushes_is_warned_about_once_not_every_tick(caplog) -> None:
    """A rollback whose canary pod refuses every push (its token refused, say) is pushed again each
    tick for as long as it lasts: one WARNING, not one per pod per tick (12 a minute, forever); a
    different failure, or the same one after a push landed, is warned about again."""
    class Refusing(FakePods):
        refuse: str | None = None

        async def push(self, pushes: Any) -> dict[str, PushResult]:
            if self.refuse is None:
                return await super().push(pushes)
            return {t.name: PushResult(name=t.name, ok=False, error=self.refuse) for t, _ in pushes}

    clock = [1000.0]
    kube = FakeKube(spec(V1))
    pods = Refusing(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec(V2))
    assert (await tick(loop, cache, clock, 1))["rollout"]["phase"] == "Analysing"  # m-0 runs the canary
    pods.refuse = "PUT /admin/gate 401: token refused"
    kube.set_spec(spec(V1))  # reverted: m-0 is to go back to stable, and refuses
    caplog.set_level(logging.DEBUG, logger="test.refusing")
    logger = logging.getLogger("test.refusing")

    async def ticks(n: int) -> list[str]:
        caplog.clear()
        for _ in range(n):
            clock[0] += 5
            await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None,  # type: ignore[arg-type]
                            logger=logger)
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "push to" in r.getMessage()]

    assert await ticks(24) == ["push to m-0 failed: PUT /admin/gate 401: token refused"]
    assert kube.status["rollout"]["phase"] == "RollingBack"
    assert any("failed again" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    pods.refuse = "PUT /admin/gate: ClientConnectorError"
    assert await ticks(3) == ["push to m-0 failed: PUT /admin/gate: ClientConnectorError"]
    pods.refuse = None  # it took one: a later refusal is news again
    await ticks(1)
    assert cache.push_failures == {}


class AnnotatedKube(FakeKube):
    """FakeKube that also takes the tick's merge patch clearing one-shot annotations."""

    def request(self, method: str, path: str, *, body: Any = None, query: Any = None,
                content_type: str | None = None) -> dict:
        if path.endswith("/gateconfigs/gate"):
            for k, v in body["metadata"]["annotations"].items():
                assert v is None
                self.obj["metadata"]["annotations"].pop(k, None)
            self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)
            return copy.deepcopy(self.obj)
        return super().request(method, path, body=body, query=query, content_type=content_type)


@pytest.fixture
async def held_judge() -> AsyncIterator[dict[str, Any]]:
    """A web check endpoint that answers only once ``release`` is set."""
    state: dict[str, Any] = {"release": asyncio.Event(), "asked": 0}

    async def score(request: web.Request) -> web.Response:
        state["asked"] += 1
        await state["release"].wait()
        return web.json_response({"score": 0.95})

    app = web.Application()
    app.router.add_get("/score", score)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state["url"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/score"  # type: ignore[union-attr]
    try:
        yield state
    finally:
        state["release"].set()
        await runner.cleanup()


def held_check(url: str) -> dict[str, Any]:
    # The CRD bounds a web check's timeout by nothing: 10 minutes is a valid spec.
    return {"name": "quality", "provider": {"web": {"url": url, "jsonPath": "score", "timeout": "10m"}},
            "successCondition": "result >= 0.9", "interval": "5s"}


async def bounded_tick(loop: RolloutLoop, cache: RolloutCache, clock: list[float], dt: float) -> dict:
    started = time.monotonic()
    st = await asyncio.wait_for(tick(loop, cache, clock, dt), 5)  # the old code waited the check's 10m out
    assert time.monotonic() - started < 2
    return st


async def test_a_hanging_web_check_does_not_hold_the_tick_nor_an_abort(held_judge: dict[str, Any]) -> None:
    clock = [1000.0]
    kube = AnnotatedKube(spec(V1))
    pods = FakePods(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    loop.check_wait_s = 0.2
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec(V2, checks=[held_check(held_judge["url"])]))
    assert (await tick(loop, cache, clock, 1))["rollout"]["phase"] == "Analysing"
    st = await bounded_tick(loop, cache, clock, 5)  # the check is due: its endpoint hangs
    assert held_judge["asked"] == 1 and st["rollout"]["phase"] == "Analysing"
    assert not st["analysisRuns"][-1]["checks"][0].get("measurements")
    st = await bounded_tick(loop, cache, clock, 1)  # still in flight: not asked a second time
    assert held_judge["asked"] == 1
    kube.obj["metadata"]["annotations"]["sparsegate.dev/abort"] = "now"
    st = await bounded_tick(loop, cache, clock, 1)
    assert st["rollout"]["phase"] in ("RollingBack", "Aborted"), st["rollout"]
    assert st["analysisRuns"][-1]["phase"] == "Terminated"
    assert not cache.measuring  # the measurement of the ended run was dropped (its request cancelled)


async def test_a_slow_web_check_is_recorded_by_a_later_tick_at_its_start(held_judge: dict[str, Any]) -> None:
    clock = [1000.0]
    kube = FakeKube(spec(V1))
    loop, cache = Loop(kube=kube, admin=FakePods(clock), clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    loop.check_wait_s = 0.2
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec(V2, checks=[held_check(held_judge["url"])]))
    await tick(loop, cache, clock, 1)
    st = await bounded_tick(loop, cache, clock, 5)
    asked_at = clock[0]
    assert not st["analysisRuns"][-1]["checks"][0].get("measurements")
    held_judge["release"].set()
    await asyncio.sleep(0.2)
    st = await bounded_tick(loop, cache, clock, 1)
    (m,) = st["analysisRuns"][0]["checks"][0]["measurements"]  # passed: the step was promoted
    assert m["value"] == 0.95 and held_judge["asked"] == 1 and st["rollout"]["step"] == 2
    assert m["time"] == datetime.datetime.fromtimestamp(asked_at, tz=datetime.UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


async def _in_flight(held_judge: dict[str, Any]) -> tuple[FakeKube, RolloutLoop, RolloutCache, list[float]]:
    """A GateConfig analysing V2 whose hanging web check is in flight (``cache.measuring``)."""
    clock = [1000.0]
    kube = FakeKube(spec(V1))
    loop, cache = Loop(kube=kube, admin=FakePods(clock), clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    loop.check_wait_s = 0.2
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec(V2, checks=[held_check(held_judge["url"])]))
    await tick(loop, cache, clock, 1)
    await bounded_tick(loop, cache, clock, 5)
    assert held_judge["asked"] == 1 and set(cache.measuring) == {"quality"}
    return kube, loop, cache, clock


async def test_a_deleted_gateconfigs_measurement_in_flight_is_cancelled(held_judge: dict[str, Any]) -> None:
    """Its request ran to the check's own timeout (10 minutes here), held by the cache of a gone object."""
    kube, loop, cache, clock = await _in_flight(held_judge)
    (_, task), = cache.measuring.values()
    kube.get = lambda *a, **k: None  # type: ignore[method-assign]  # deleted (404)
    assert await asyncio.wait_for(loop.tick(namespace="ns", name="gate", models=["m"], cache=cache,
                                            inventory=None), 5) is None  # type: ignore[arg-type]
    await asyncio.wait([task], timeout=2)  # (the old code: still waiting on the endpoint)
    assert not cache.measuring and task.cancelled()


async def test_an_invalid_spec_cancels_the_measurement_in_flight(held_judge: dict[str, Any]) -> None:
    kube, loop, cache, clock = await _in_flight(held_judge)
    (_, task), = cache.measuring.values()
    kube.set_spec({**spec(V2), "rollout": {"steps": "all at once"}})
    await bounded_tick(loop, cache, clock, 1)
    await asyncio.wait([task], timeout=2)  # (the old code: still waiting on the endpoint)
    assert not cache.measuring and task.cancelled()


async def test_a_gateconfigs_deleted_event_cancels_its_measurements(held_judge: dict[str, Any], monkeypatch) -> None:
    """The DELETED event ends the loop (a tick waiting on the check is cancelled, not the check's task)
    and Kopf forgets the memo: nothing else would ever cancel the request."""
    import types

    from sparsegate.handlers import gateconfig
    from sparsegate.handlers.periodic import ObjectLoops

    _, _, cache, _ = await _in_flight(held_judge)
    (_, task), = cache.measuring.values()
    monkeypatch.setattr(gateconfig, "_loops", ObjectLoops(kind="GateConfig", interval_s=300))
    body = {"metadata": {"name": "gate", "namespace": "ns", "uid": "u1"}}
    await gateconfig.gateconfig_rollout_loop(type="DELETED", body=body, namespace="ns", name="gate",
                                             memo=types.SimpleNamespace(rollout_cache=cache), models_by_gate={},
                                             logger=logging.getLogger("test"),
                                             **dict.fromkeys(("sparsegate_model_views", "sparsegate_model_pod_views",
                                                              "sparsegate_model_deployment_views",
                                                              "sparsegate_model_replicaset_views",
                                                              "sparsegate_gate_views"), {}))
    await asyncio.wait([task], timeout=2)  # (the old code: still waiting on the endpoint)
    assert not cache.measuring and task.cancelled()


async def test_a_wall_clock_jump_forward_neither_completes_the_window_nor_thins_its_rates() -> None:
    """Direct scrape: the window's span and rates are the monotonic clock's. The wall clock jumping
    an hour ahead 2 s into a 10 s window made the window look full at once, its canary qps an
    hour's average of 2 s of requests (and the calibration's fleet qps sample with it)."""
    wall, mono = [1000.0], [50.0]
    kube = FakeKube(spec(V1))
    pods = FakePods(mono)  # the pods count requests in real time
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: wall[0]), RolloutCache()  # type: ignore[arg-type]
    loop.monotonic = lambda: mono[0]

    async def step(dt: float, jump: float = 0.0) -> dict:
        mono[0] += dt
        wall[0] += dt + jump
        return await tick(loop, cache, [0.0], 0)

    await step(1)
    kube.set_spec(spec(V2))
    assert (await step(1))["rollout"]["phase"] == "Analysing"
    await step(1)  # the window's first scrape
    st = await step(1)
    assert st["rollout"]["analysis"]["verdict"] == "Pass"
    st = await step(1, jump=3600)
    assert st["rollout"]["phase"] == "Analysing" and st["rollout"]["step"] == 1, "promoted on 2 s of data"
    assert st["rollout"]["analysis"]["canaryQps"] == pytest.approx(50)
    for _ in range(7):
        st = await step(1)
        assert st["rollout"]["phase"] == "Analysing" and st["rollout"]["step"] == 1
    st = await step(1)  # 10 s of data since the window began
    assert st["rollout"]["step"] == 2 and st["analysisRuns"][0]["phase"] == "Successful"


async def test_outcome_push_and_step_series_exist_at_zero_before_their_first_count() -> None:
    """The dashboard's "Finished rollouts by outcome" and "Median step duration" take increase()
    over the range, which counts a series from its first sample: a series born at 1 (an outcome's
    first rollout since the operator started, a percent's first step) showed 0 or nothing."""
    get = controller.prometheus_client.REGISTRY.get_sample_value
    for outcome in ("succeeded", "rolled_back", "aborted", "failed", "superseded", "reverted"):
        assert get("sparsegate_rollouts_total", {"outcome": outcome}) is not None, outcome
    for result in ("ok", "error"):
        assert get("sparsegate_rollout_gate_pushes_total", {"result": result}) is not None, result
    step = {"percent": "37", "le": "+Inf"}
    assert get("sparsegate_rollout_step_duration_seconds_bucket", step) is None
    clock = [1000.0]
    kube = FakeKube(spec(V1))
    kube.obj["spec"]["rollout"]["steps"] = [37, 100]
    loop, cache = Loop(kube=kube, admin=FakePods(clock), clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    # Step 37 has not run, let alone ended: its series are there, at 0.
    assert get("sparsegate_rollout_step_duration_seconds_bucket", step) == 0
    assert get("sparsegate_rollout_step_duration_seconds_count", {"percent": "37"}) == 0


def test_a_step_of_an_hour_lands_in_a_finite_bucket() -> None:
    """analysisInterval has no upper bound: an hour-long step fell only in +Inf, where the
    dashboard's histogram_quantile answers the last finite bound (1800 s) whatever the real time."""
    get = controller.prometheus_client.REGISTRY.get_sample_value
    controller.STEP_SECONDS.labels(percent="unit-hour").observe(3600)
    assert get("sparsegate_rollout_step_duration_seconds_bucket", {"percent": "unit-hour", "le": "1800.0"}) == 0
    assert get("sparsegate_rollout_step_duration_seconds_bucket", {"percent": "unit-hour", "le": "3600.0"}) == 1


class ContractPods(FakePods):
    """Pods that check each pushed document as the model server does (``parse_gate_set``, for a
    model of ``experts`` experts) and report a refused one as ``PodAdmin.push`` does (a 422)."""

    def __init__(self, clock: list[float], *, experts: int | None = None) -> None:
        super().__init__(clock)
        self.experts = experts
        self.pushed: list[str] = []

    async def push(self, pushes: Any) -> dict[str, PushResult]:
        out = {}
        for target, doc in pushes:
            self.pushed.append(target.name)
            try:
                parse_gate_set(doc, num_experts=self.experts)
            except GateParamsError as e:
                detail = f"{e} (this model has {self.experts or 4} experts)"
                out[target.name] = PushResult(name=target.name, ok=False, status=422, detail=detail,
                                              error=f"PUT /admin/gate 422: {{'error': {detail!r}, 'status': 422}}")
                continue
            self.versions[target.name] = document_key(doc)
            out[target.name] = PushResult(name=target.name, ok=True, version=document_key(doc))
        return out


def condition(status: dict, ctype: str) -> dict:
    return next(c for c in status.get("conditions") or [] if c["type"] == ctype)


async def test_a_stable_gate_edited_out_of_its_hash_is_reported_and_not_pushed_every_tick(
        no_kopf_events: list) -> None:
    """status.stable.params edited (by hand, or a tool restoring status) so they no longer hash to its
    version and checksum: every pod refuses it (422). The rollback that needs it used to push it every
    tick forever with no condition saying so. Now the pods' own answer sets Stalled/Degraded (reason
    StableChecksumMismatch, naming the GateConfig, the pods and the fix), the push backs off, and the
    fix (status.stable removed: restored from status.history) lands at the next look."""
    clock = [1000.0]
    kube = FakeKube(spec(V1))
    pods = ContractPods(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec(V2))
    assert (await tick(loop, cache, clock, 1))["rollout"]["phase"] == "Analysing"  # m-0 holds the canary
    stable = GateVersion.from_params(V1)
    kube.obj["status"]["stable"]["params"] = {"toolGateThreshold": 0.5}  # version/checksum still V1's
    kube.set_spec(spec(V1))  # reverted: m-0 is to go back to stable, which no pod accepts
    pods.pushed.clear()
    status = await tick(loop, cache, clock, 5)
    assert status["rollout"]["phase"] == "RollingBack" and pods.versions["m-0"] != stable.version
    for ctype, value in (("Stalled", "True"), ("Degraded", "True"), ("Ready", "False"), ("Reconciling", "False")):
        c = condition(status, ctype)
        assert (c["status"], c["reason"]) == (value, "StableChecksumMismatch"), c
    message = condition(status, "Stalled")["message"]
    for part in ("GateConfig ns/gate", "(m-0)", f"status.stable {stable.version}", "checksum mismatch",
                 "remove status.stable", "status.history"):
        assert part in message, (part, message)
    assert [r for r, _ in no_kopf_events].count("StableChecksumMismatch") == 1
    for _ in range(30):  # 150 s: pushed every tick (5 s) before, now after 10, 20, 40, 80 s
        status = await tick(loop, cache, clock, 5)
    assert 2 <= len(pods.pushed) <= 5, pods.pushed
    assert condition(status, "Stalled")["reason"] == "StableChecksumMismatch"
    assert [r for r, _ in no_kopf_events].count("StableChecksumMismatch") == 1  # once, not per push
    del kube.obj["status"]["stable"]  # the fix the message gives
    status = await tick(loop, cache, clock, 5)
    assert pods.versions["m-0"] == stable.version and status["stable"]["params"] == V1
    assert status["rollout"]["phase"] == "Succeeded"
    assert condition(status, "Stalled")["status"] == "False" and condition(status, "Ready")["status"] == "True"
    assert cache.refused == {}


async def test_a_gate_the_pods_refuse_for_their_model_is_reported_and_backs_off(no_kopf_events: list) -> None:
    """A version the operator accepts but the model's pods refuse (maxExpertsPerToken beyond a
    2-expert model's experts: 422) is reported from the pods' answer (reason GatePushRefused, their
    message), and the refused canary is not pushed to them again at every tick; a new spec goes at once."""
    clock = [1000.0]
    kube = FakeKube(spec(V1))
    pods = ContractPods(clock, experts=2)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    kube.set_spec(spec({"toolGateThreshold": 0.8, "maxExpertsPerToken": 4}))
    status = await tick(loop, cache, clock, 1)
    stalled = condition(status, "Stalled")
    assert (stalled["status"], stalled["reason"]) == ("True", "GatePushRefused"), stalled
    assert "GateConfig ns/gate" in stalled["message"] and "this model has 2 experts" in stalled["message"]
    assert "422" in stalled["message"] and "m-0" in stalled["message"]
    pushed = len(pods.pushed)
    for _ in range(3):
        await tick(loop, cache, clock, 2)
    assert len(pods.pushed) == pushed  # within the 10 s delay: not pushed again
    kube.set_spec(spec(V2))  # a version the pods take: pushed at once, the refusal is gone
    status = await tick(loop, cache, clock, 1)
    assert pods.versions["m-0"] == GateVersion.from_params(V2).version
    assert condition(status, "Stalled")["status"] == "False" and cache.refused == {}


async def test_a_resting_gateconfig_whose_pod_refuses_its_stable_sleeps_until_the_retry(no_kopf_events: list) -> None:
    """At rest, a pod back on another gate is pushed status.stable; when it refuses it (params edited
    out of their hash) the GateConfig says so and its loop sleeps until the push's delay ends, rather
    than checking and pushing again at every tick (before: at once, forever)."""
    clock = [1000.0]
    kube = FakeKube(spec(V1))
    pods = ContractPods(clock)
    loop, cache = Loop(kube=kube, admin=pods, clock=lambda: clock[0]), RolloutCache()  # type: ignore[arg-type]
    await tick(loop, cache, clock, 1)
    kube.obj["status"]["stable"]["params"] = {"toolGateThreshold": 0.5}
    pods.versions["m-1"] = GateVersion.from_params(V2).version  # back from a restart on another gate
    pods.pushed.clear()

    async def resting_tick(dt: float, changes: int) -> float | None:
        clock[0] += dt
        seen = RolloutLoop.quiet_view(copy.deepcopy(kube.obj))
        await loop.tick(namespace="ns", name="gate", models=["m"], cache=cache, inventory=None,  # type: ignore[arg-type]
                        seen=seen, pod_changes=changes)
        return loop.next_tick_in(RolloutLoop.quiet_view(copy.deepcopy(kube.obj)), cache=cache, interval_s=5)

    assert await resting_tick(1, 1) == pytest.approx(controller.REFUSED_RETRY_S)
    assert pods.pushed == ["m-1"]
    assert condition(kube.status, "Stalled")["reason"] == "StableChecksumMismatch"
    for _ in range(3):  # ticks within the delay find nothing to do
        await resting_tick(2, 1)
    assert pods.pushed == ["m-1"]
    assert await resting_tick(5, 1) == pytest.approx(2 * controller.REFUSED_RETRY_S)  # pushed again, refused
    assert pods.pushed == ["m-1", "m-1"]
