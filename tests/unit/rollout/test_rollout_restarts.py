"""Restarts, leader changes, failed writes, concurrent edits and clock jumps, as Argo Rollouts users meet them.

The pure state machine runs in ``test_rollout``'s fleet (``Driver``) and ``test_rollout_history_kstatus``'
GateConfig (``Gate``); the controller's tick in ``test_rollout_tick_checks``' cluster (``CountingKube``
answers a status write based on an old resourceVersion with a 409, as the API server does).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from test_rollout import Driver, Fleet, healthy, started
from test_rollout import V1 as P1
from test_rollout import V2 as P2
from test_rollout import V3 as P3
from test_rollout import v as version_of
from test_rollout_history_kstatus import Gate
from test_rollout_tick_checks import judge, no_kopf_events  # noqa: F401 (fixtures)
from test_rollout_tick_checks import V1, V2, CountingKube, FakePods, Loop

from sparsegate.clients.kube import Conflict, KubeError
from sparsegate.controllers.rollout import RolloutCache
from sparsegate.domain.rollout import (
    ABORT_ANNOTATION,
    PROMOTE_ANNOTATION,
    PROMOTE_STEP_VALUE,
    RETRY_ANNOTATION,
    ClearAnnotation,
    GateVersion,
    Phase,
    RolloutStatus,
)

CANARY = GateVersion.from_params(V2).version


def spec(params: dict) -> dict:
    return {"params": params, "rollout": {"steps": [25, 50, 100], "analysisInterval": "10s", "minRequests": 5,
                                          "strategy": "instances"}, "calibration": {"qpsThreshold": {"initial": 1}}}


class Cluster(CountingKube):
    """Also takes the annotation merge patches (``fail_clears``: that many answer 503)."""

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.fail_clears = 0
        self.after_clear: Any = None  # run once right after an annotation clear lands

    def request(self, method: str, path: str, *, body: Any = None, query: Any = None,
                content_type: str | None = None) -> dict:
        if path.endswith("/status"):
            return super().request(method, path, body=body, query=query, content_type=content_type)
        assert method == "PATCH" and content_type == "application/merge-patch+json", (method, content_type)
        if self.fail_clears:
            self.fail_clears -= 1
            raise KubeError(503, "ServiceUnavailable", "the API server is restarting")
        for k, value in body["metadata"]["annotations"].items():
            if value is None:
                self.obj["metadata"]["annotations"].pop(k, None)
            else:
                self.obj["metadata"]["annotations"][k] = value
        self.touch()
        answer = copy.deepcopy(self.obj)
        if self.after_clear is not None:
            hook, self.after_clear = self.after_clear, None
            hook()
        return answer

    def annotate(self, name: str, value: str) -> None:
        self.obj["metadata"]["annotations"][name] = value
        self.touch()


class Pods(FakePods):
    """``during_health``: run once while the next tick looks at the pods (between its read and its write)."""

    during_health: Any = None

    async def health(self, targets: Any) -> Any:
        if self.during_health is not None:
            hook, self.during_health = self.during_health, None
            await hook()
        return await super().health(targets)


class Operator:
    """One operator process: a loop and its in-memory cache; ``restart`` loses the memory. A tick's
    API error ends the tick, as in ``handlers.gateconfig.rollout_tick`` (recorded in ``errors``)."""

    def __init__(self, kube: Cluster, pods: Pods, clock: list[float]) -> None:
        self.kube, self.pods, self.clock = kube, pods, clock
        self.errors: list[KubeError] = []
        self.restart()

    def restart(self) -> None:
        self.loop = Loop(kube=self.kube, admin=self.pods, clock=lambda: self.clock[0])  # type: ignore[arg-type]
        self.cache = RolloutCache()

    async def tick(self, dt: float = 1.0) -> dict:
        self.clock[0] += dt
        try:
            await self.loop.tick(namespace="ns", name="gate", models=["m"], cache=self.cache,
                                 inventory=None)  # type: ignore[arg-type]
        except KubeError as e:
            self.errors.append(e)
        return self.kube.status


async def analysing(clock: list[float]) -> tuple[Cluster, Pods, Operator]:
    kube = Cluster(spec(V1))
    pods = Pods(clock)
    op = Operator(kube, pods, clock)
    await op.tick()
    kube.set_spec(spec(V2))
    st = await op.tick()
    assert st["rollout"]["phase"] == "Analysing" and st["rollout"]["stepIndex"] == 0
    return kube, pods, op


# ---------------------------------------------------------------- (1) restarts mid-step


async def test_restarts_in_a_row_never_shorten_the_builtin_window_nor_double_count() -> None:
    """An operator that restarts every 9 s of a 10 s window never promotes the step (each new
    process's direct scrape begins a new window); the step passes on 10 s of data after the last
    restart, judged on that window's requests alone."""
    clock = [1000.0]
    _, pods, op = await analysing(clock)
    for _ in range(5):
        for _ in range(9):
            st = await op.tick()
            assert st["rollout"]["stepIndex"] == 0, st["rollout"]["message"]
        op.restart()
    st = await op.tick()  # the new process's first scrape: its window begins
    assert st["rollout"]["analysisWindow"]["samples"] == 0 and "analysis window restarted" in st["rollout"]["message"]
    for _ in range(9):
        st = await op.tick()
        assert st["rollout"]["stepIndex"] == 0, "promoted on less than a window of fresh data"
    st = await op.tick()
    assert st["rollout"]["stepIndex"] == 1
    # One canary pod at 50 requests/s over the last 10 s: nothing from the windows before.
    assert st["analysisRuns"][0]["phase"] == "Successful"
    assert st["rollout"]["analysis"]["canaryRequests"] == pods.rate * 10


# ---------------------------------------------------------------- (2) restart in RollingBack / promote / pause


def _restarted(d: Driver) -> Driver:
    """A new process: only the persisted status survives; the pods are the same."""
    d2 = Driver(d.fleet, d.raw_spec, now=d.now)
    d2.status = RolloutStatus.from_status(d.status.to_status(steps=(5, 20, 100)))
    return d2


@pytest.mark.parametrize("where", ["rolling back", "promoting fully", "paused"])
def test_a_restart_resumes_the_phase_and_pushes_only_what_is_missing(where: str) -> None:
    """The operator persists a transition and dies before its pushes land: the new process resumes
    the same phase and pushes exactly the pods the transition moves (none while paused)."""
    d = started()
    d.until(Phase.ANALYSING)
    d.tick(dt=11, canary=healthy(), stable=healthy(1000))  # step 2: 4 of 20 pods on the canary
    canary_pods = sorted(d.status.canary_pods)
    held = dict(d.fleet.versions)
    if where == "rolling back":
        st = d.tick(abort=True)
        expected, rest = Phase.ROLLING_BACK, Phase.ABORTED
        moved = [(p, version_of(P1)) for p in canary_pods]
    elif where == "promoting fully":
        st = d.tick(promote=True)
        expected, rest = Phase.PROGRESSING, Phase.SUCCEEDED
        moved = [(p, version_of(P2)) for p in sorted(held) if p not in canary_pods]
        assert st.promote
    else:
        d.raw_spec = {**d.raw_spec, "rollout": {**d.raw_spec["rollout"], "paused": True}}
        st = d.tick()
        expected, rest, moved = Phase.PAUSED, Phase.PAUSED, []
    assert st.phase == expected
    d.fleet.versions = dict(held)  # the pushes never landed
    pushed = len(d.fleet.pushes)
    d2 = _restarted(d)
    st = d2.tick()
    assert st.phase == expected and sorted(d.fleet.pushes[pushed:]) == moved
    for _ in range(3):
        st = d2.tick()
    assert st.phase == rest and sorted(d.fleet.pushes[pushed:]) == moved  # nothing pushed twice


# ---------------------------------------------------------------- (3)/(5) failed writes, two leaders


async def test_a_write_that_conflicts_acts_on_nothing_and_the_abort_made_meanwhile_holds(
        no_kopf_events: list) -> None:
    """The user aborts while a tick that would promote step 1 looks at the pods: its status write is
    a 409 (so is an old leader's write after the new leader's): nothing is pushed or announced; the
    next tick aborts, once."""
    clock = [1000.0]
    kube, pods, op = await analysing(clock)
    before = dict(pods.versions)

    async def user_aborts() -> None:
        kube.annotate(ABORT_ANNOTATION, "now")

    pods.during_health = user_aborts
    await op.tick(11)  # the window is full: this tick would promote step 1
    assert [type(e) for e in op.errors] == [Conflict]
    assert pods.versions == before and kube.status["rollout"]["stepIndex"] == 0
    assert not [r for r, _ in no_kopf_events if r == "StepPromoted"]
    st = await op.tick()
    assert st["rollout"]["phase"] in ("RollingBack", "Aborted") and ABORT_ANNOTATION not in \
        kube.obj["metadata"]["annotations"]
    await op.tick()
    assert [r for r, _ in no_kopf_events].count("Aborted") == 1 and CANARY not in pods.versions.values()


async def test_a_measurement_whose_write_conflicted_is_taken_again_and_counted_once(judge: dict[str, Any]) -> None:
    """A declared check measured in a tick whose status write is a 409: the answer was never
    recorded, so the next tick measures again; the run counts one measurement, not two."""
    clock = [1000.0]
    kube = Cluster(spec(V1))
    pods = Pods(clock)
    op = Operator(kube, pods, clock)
    await op.tick()
    judge["score"] = 0.2
    checks = [{"name": "quality", "provider": {"web": {"url": judge["url"] + "/score", "jsonPath": "score"}},
               "successCondition": "result >= 0.9", "interval": "5s", "count": 3, "failureLimit": 1}]
    kube.set_spec({**spec(V2), "rollout": {**spec(V2)["rollout"], "analysis": {"checks": checks}}})
    assert (await op.tick())["rollout"]["phase"] == "Analysing"

    async def someone_writes() -> None:
        kube.touch()

    pods.during_health = someone_writes
    await op.tick(5)  # measured (failed), not recorded: a 409
    assert len(judge["asked"]) == 1 and [type(e) for e in op.errors] == [Conflict]
    st = await op.tick()
    check = st["analysisRuns"][-1]["checks"][0]
    assert len(judge["asked"]) == 2 and check["failed"] == 1 and len(check["measurements"]) == 1
    assert st["rollout"]["phase"] == "Analysing"  # one failure tolerated (failureLimit 1), not two counted


async def test_an_old_leader_mid_tick_cannot_overwrite_the_new_leaders_status(no_kopf_events: list) -> None:
    """Leader handover: the new leader aborts while the old one, mid-tick, was about to promote the
    step; the old one's write carries the resourceVersion it read, so it is refused and it acts on
    nothing."""
    clock = [1000.0]
    kube, pods, old = await analysing(clock)
    new = Operator(kube, pods, clock)

    async def new_leader_aborts() -> None:
        kube.annotate(ABORT_ANNOTATION, "now")
        await new.tick(0)

    pods.during_health = new_leader_aborts
    await old.tick(11)
    assert [type(e) for e in old.errors] == [Conflict]
    assert kube.status["rollout"]["phase"] in ("RollingBack", "Aborted")
    assert CANARY not in pods.versions.values() and not [r for r, _ in no_kopf_events if r == "StepPromoted"]


async def test_a_step_promote_whose_annotation_clear_failed_is_not_applied_twice() -> None:
    """The status holding a step promote is written, then clearing the annotation fails (the API
    server restarting, or the process ending or losing its Lease in between): the next tick, or the
    next leader, must not promote another step on the same annotation (it skipped step 2's analysis)."""
    clock = [1000.0]
    kube, _, op = await analysing(clock)
    kube.annotate(PROMOTE_ANNOTATION, PROMOTE_STEP_VALUE)
    kube.fail_clears = 1
    await op.tick()
    assert [e.status for e in op.errors] == [503]
    assert kube.status["rollout"]["stepIndex"] == 1 and PROMOTE_ANNOTATION in kube.obj["metadata"]["annotations"]
    op.restart()  # or the same process's next tick: the same
    st = await op.tick()
    assert st["rollout"]["stepIndex"] == 1, "the same promote request moved the rollout a second step"
    assert PROMOTE_ANNOTATION not in kube.obj["metadata"]["annotations"]
    # A new request after that is one step more.
    kube.annotate(PROMOTE_ANNOTATION, PROMOTE_STEP_VALUE)
    st = await op.tick()
    assert st["rollout"]["stepIndex"] == 2


async def test_step_promotes_in_a_row_each_move_one_step_in_a_tick_without_a_conflict() -> None:
    """Clearing the annotation changes the object's resourceVersion: the tick's next write (after
    its pushes) carries the new one instead of ending in a 409 and a lost tick."""
    clock = [1000.0]
    kube, pods, op = await analysing(clock)
    for step in (1, 2):
        kube.annotate(PROMOTE_ANNOTATION, PROMOTE_STEP_VALUE)
        st = await op.tick()
        assert not op.errors, op.errors
        assert st["rollout"]["stepIndex"] == step and st["rollout"]["phase"] == "Analysing"
        assert "consumedRequests" not in st["rollout"] and not kube.obj["metadata"]["annotations"]
    assert list(pods.versions.values()).count(CANARY) == 4


async def test_a_spec_edit_right_after_the_clear_loses_neither_the_request_nor_its_pushes(
        no_kopf_events: list) -> None:
    clock = [1000.0]
    kube, pods, op = await analysing(clock)
    kube.annotate(PROMOTE_ANNOTATION, PROMOTE_STEP_VALUE)
    kube.after_clear = kube.touch  # someone else's write between the clear and the tick's next write
    st = await op.tick()
    assert st["rollout"]["stepIndex"] == 1 and list(pods.versions.values()).count(CANARY) == 2
    assert [r for r, _ in no_kopf_events].count("StepPromoteRequested") == 1
    st = await op.tick()
    assert st["rollout"]["stepIndex"] == 1 and "consumedRequests" not in st["rollout"]


def test_a_request_whose_annotation_is_still_there_is_cleared_not_acted_on_again() -> None:
    """The state machine's side: the status records the requests it acted on until their
    annotations are seen gone; the same annotation seen again is only cleared."""
    g = Gate(P1, steps=[5, 20, 50, 100])
    g.tick()
    g.edit(P2)
    g.until(Phase.ANALYSING)
    promote = {PROMOTE_ANNOTATION: PROMOTE_STEP_VALUE}
    assert g.tick(annotations=promote).step == 1
    g.actions.clear()
    st = g.tick(annotations=promote)  # its clear did not land
    assert st.step == 1 and ClearAnnotation(PROMOTE_ANNOTATION) in g.actions
    assert st.consumed_requests == ("promote_step",)
    assert g.tick().consumed_requests == ()  # seen gone
    assert g.tick(annotations=promote).step == 2  # a new request
    # Another kind of request is not held back by the record of the first.
    assert g.tick(annotations={ABORT_ANNOTATION: "now"}).phase == Phase.ROLLING_BACK


# ---------------------------------------------------------------- (4) concurrent edits and requests


def test_a_new_version_while_paused_waits_paused_then_replaces_the_old_canary() -> None:
    """Paused at step 2, the spec moves to a third version: the rollout starts it over at step 1 and
    stays paused (nothing pushed: the superseded canary's pods are held as they are); resuming
    sends the new canary out and the superseded one is gone."""
    g = Gate(P1, steps=[5, 20, 100])
    g.tick()
    g.edit(P2)
    g.until(Phase.ANALYSING)
    g.tick(dt=11, canary=healthy(), stable=healthy(1000))
    st = g.until(Phase.ANALYSING)
    assert st.step == 1 and list(g.pods.values()).count(version_of(P2)) == 4
    g.edit(paused=True)
    assert g.tick().phase == Phase.PAUSED
    g.edit(P3)
    held = dict(g.pods)
    st = g.tick()
    assert st.phase == Phase.PAUSED and st.step == 0 and st.canary.version == version_of(P3) and g.pods == held
    g.edit(paused=False)
    st = g.until(Phase.ANALYSING)
    assert st.step == 0 and version_of(P2) not in g.pods.values()
    assert list(g.pods.values()).count(version_of(P3)) == 1


def test_abort_wins_over_a_retry_seen_with_it_and_a_promote_during_the_rollback_is_ignored() -> None:
    """The order of two annotations seen in one tick is not known: abort wins (the retry is cleared
    unused, as the README says of a retry with nothing to retry). Promote during RollingBack (no
    canary in flight: the plugin refuses it) is cleared unused; the rollback completes."""
    g = Gate(P1, steps=[5, 20, 100])
    g.tick()
    g.edit(P2)
    g.until(Phase.ANALYSING)
    st = g.tick(annotations={ABORT_ANNOTATION: "now", RETRY_ANNOTATION: "now"})
    assert st.phase == Phase.ROLLING_BACK and st.rejected_version == version_of(P2)
    g.pods[sorted(g.pods)[0]] = version_of(P2)  # one pod not back yet
    st = g.tick(annotations={PROMOTE_ANNOTATION: "now"})
    assert ClearAnnotation(PROMOTE_ANNOTATION) in g.actions and st.phase == Phase.ROLLING_BACK
    assert g.tick().phase == Phase.ABORTED and version_of(P2) not in g.pods.values()
    assert g.tick(annotations={RETRY_ANNOTATION: "now"}).phase == Phase.PROGRESSING  # retried when asked again


# ---------------------------------------------------------------- (6) the wall clock moving back


async def test_the_clock_moving_back_analyses_the_step_again_instead_of_waiting_out_the_jump() -> None:
    """Status keeps wall-clock times. The clock stepping back an hour mid-window never promotes on
    less than a full window, and the step is judged a window after the jump, not an hour later."""
    clock = [100_000.0]
    _, _, op = await analysing(clock)
    for _ in range(5):
        st = await op.tick()
    clock[0] -= 3600
    for n in range(30):
        st = await op.tick()
        if st["rollout"]["stepIndex"] == 1:
            break
        assert st["rollout"]["stepIndex"] == 0
    assert st["rollout"]["stepIndex"] == 1, st["rollout"]["message"]
    assert n >= 10, "promoted on less than a window of data after the jump"
    assert st["analysisRuns"][0]["phase"] == "Terminated" and st["analysisRuns"][1]["phase"] == "Successful"


def test_a_small_step_back_only_delays_the_window() -> None:
    d = Driver(Fleet.of(20, version_of(P1)), {"params": P1, "rollout": {"analysisInterval": "10s", "minRequests": 20,
                                                                       "strategy": "instances"}})
    d.tick()
    d.raw_spec = {**d.raw_spec, "params": P2}
    st = d.until(Phase.ANALYSING)
    started_at = st.analysis_started_at
    d.tick(dt=5, canary=healthy(), stable=healthy(1000))
    st = d.tick(dt=-2, canary=healthy(), stable=healthy(1000))  # back 2 s, not past the analysis start
    assert st.phase == Phase.ANALYSING and st.analysis_started_at == started_at
    st = d.tick(dt=6, canary=healthy(), stable=healthy(1000))  # 9 s after the start, by the clock
    assert st.phase == Phase.ANALYSING
    st = d.tick(dt=1, canary=healthy(), stable=healthy(1000))
    assert st.phase == Phase.PROGRESSING and st.step == 1


# ---------------------------------------------------------------- GitOps: a request annotation held in Git


def _argo_applies(kube: Cluster, name: str, value: str) -> None:
    """What ``kubectl apply`` (Argo CD's client-side sync) leaves: the annotation, and kubectl's
    last-applied copy naming it; self-heal puts the annotation back whenever it is gone."""
    applied = {"metadata": {"annotations": {name: value}}, "spec": kube.obj["spec"]}
    kube.obj["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = json.dumps(applied)
    kube.annotate(name, value)


async def test_a_request_annotation_held_in_git_acts_once_per_value_under_self_heal(
        no_kopf_events: list) -> None:
    """Argo CD self-heal (or Flux) re-applies an annotation the operator cleared: a step promote held
    in Git promoted another step on every sync (a whole rollout without analysis), an abort aborted
    every later rollout. A request an applier declares acts once per value and stays in place
    (clearing it only made the app OutOfSync); a new value is a new request."""
    clock = [1000.0]
    kube, _, op = await analysing(clock)
    _argo_applies(kube, PROMOTE_ANNOTATION, PROMOTE_STEP_VALUE)
    for _ in range(4):
        st = await op.tick()
        if PROMOTE_ANNOTATION not in kube.obj["metadata"]["annotations"]:
            kube.annotate(PROMOTE_ANNOTATION, PROMOTE_STEP_VALUE)  # self-heal
    assert not op.errors, op.errors
    assert st["rollout"]["stepIndex"] == 1, "the same promote in Git moved the rollout again"
    assert kube.obj["metadata"]["annotations"][PROMOTE_ANNOTATION] == PROMOTE_STEP_VALUE  # in sync with Git
    assert [r for r, _ in no_kopf_events].count("StepPromoteRequested") == 1
    # Git's abort, then a later rollout: the abort acts on the first only.
    _argo_applies(kube, ABORT_ANNOTATION, "1")
    st = await op.tick()
    assert st["rollout"]["phase"] in ("RollingBack", "Aborted")
    for _ in range(3):
        st = await op.tick()
    kube.set_spec(spec(P3))
    for _ in range(3):
        st = await op.tick()
    assert st["rollout"]["phase"] == "Analysing", st["rollout"]
    # A new value in Git is a new request.
    _argo_applies(kube, ABORT_ANNOTATION, "2")
    st = await op.tick()
    assert st["rollout"]["phase"] in ("RollingBack", "Aborted")
    # Resting with Git's requests in place: quiet, nothing cleared.
    for _ in range(3):
        st = await op.tick()
    assert st["rollout"]["phase"] == "Aborted" and Loop.resting(kube.obj)
    assert kube.obj["metadata"]["annotations"][ABORT_ANNOTATION] == "2"
    # Removed from Git, then `kubectl annotate` (no applier declares it): one-shot again, cleared.
    kube.obj["metadata"]["annotations"].clear()
    await op.tick()
    assert "handledRequests" not in kube.status["rollout"]
    kube.annotate(PROMOTE_ANNOTATION, "now")
    await op.tick()
    assert not kube.obj["metadata"]["annotations"]
