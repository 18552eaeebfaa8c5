"""The container pod runner removes a container once, gracefully, however many passes see it go."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from localcluster import containerrunner
from localcluster.containerrunner import ContainerPodRunner


def test_a_container_still_listed_while_it_stops_is_removed_once(monkeypatch, tmp_path: Path) -> None:
    calls: list[tuple[str, ...]] = []
    stopping = threading.Event()

    def fake_podman(*args: str, check: bool = True, timeout: float = 120.0) -> SimpleNamespace:
        calls.append(args)
        if args[0] == "stop":
            stopping.set()
            time.sleep(0.3)  # the grace period: the next passes still see the container
        return SimpleNamespace(returncode=0, stdout="0\n" if args[0] == "inspect" else "", stderr="")

    monkeypatch.setattr(containerrunner.podman, "podman", fake_podman)
    runner = ContainerPodRunner(core_api=None, work_dir=tmp_path, api_host="127.0.0.1", api_port=6443,
                                runner_id="t")
    try:
        runner._remove("k8s_agent_x", grace_s=10)
        assert stopping.wait(5)
        runner._remove("k8s_agent_x", grace_s=10)  # a second pass, mid-stop
        runner._remove("k8s_agent_x", grace_s=10)
        runner.pool.shutdown(wait=True)
    finally:
        runner.pool.shutdown(wait=True)
    assert [c[0] for c in calls] == ["stop", "inspect", "rm"], calls
    assert calls[0] == ("stop", "-t", "10", "--ignore", "k8s_agent_x")  # SIGTERM first, SIGKILL after the grace
    # Once removed, a container of that name may be removed again (a new pod's).
    runner.pool = containerrunner.concurrent.futures.ThreadPoolExecutor(max_workers=1)
    runner._remove("k8s_agent_x", grace_s=10)
    runner.pool.shutdown(wait=True)
    assert [c[0] for c in calls].count("stop") == 2


def test_a_create_that_ends_after_the_listing_is_not_started_again(monkeypatch, tmp_path: Path) -> None:
    """A pass whose container listing predates a create that has since ended must not create the
    container a second time (that `rm -f`s the first: seen as an agent pod started twice)."""
    from localcluster.podplan import ContainerPlan, PodPlan

    created: list[str] = []
    monkeypatch.setattr(ContainerPodRunner, "_create", lambda self, plan, c, name: created.append(name))
    monkeypatch.setattr(ContainerPodRunner, "_image_present", lambda self, image: True)
    runner = ContainerPodRunner(core_api=None, work_dir=tmp_path, api_host="127.0.0.1", api_port=6443,
                                runner_id="t")
    c = ContainerPlan(name="agent", image="img", pull_policy="Never", entrypoint=None, args=None, env=(),
                      mounts=())
    plan = PodPlan(namespace="ns", name="p", uid="u1", pod_ip="127.0.0.2", containers=(c,), volumes=(),
                   unsupported=())
    try:
        listed_at = time.monotonic()
        first = runner._drive(plan, {}, c, None, time.time(), listed_at=listed_at)
        runner.pool.shutdown(wait=True)  # the create ends after the listing it was started from
        assert created == [containerrunner.container_name(plan, "agent")] and first.state == "waiting"
        stale = runner._drive(plan, {}, c, None, time.time(), listed_at=listed_at)
        assert created == [containerrunner.container_name(plan, "agent")], "created twice from a stale listing"
        assert stale.state == "waiting"
        # A listing taken after the create that still lacks the container does create it again.
        runner.pool = containerrunner.concurrent.futures.ThreadPoolExecutor(max_workers=1)
        runner._drive(plan, {}, c, None, time.time(), listed_at=time.monotonic())
        runner.pool.shutdown(wait=True)
        assert len(created) == 2
    finally:
        runner.pool.shutdown(wait=True)


class _FakeCoreApi:
    """The pod-list and pod-delete calls of a CoreV1Api, over plain dicts."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods
        self.deleted: list[tuple[str, str, dict]] = []
        self.api_client = SimpleNamespace(sanitize_for_serialization=lambda obj: obj)

    def list_pod_for_all_namespaces(self) -> SimpleNamespace:
        return SimpleNamespace(items=self.pods)

    def delete_namespaced_pod(self, name: str, namespace: str, *, body: dict, grace_period_seconds: int) -> None:
        self.deleted.append((namespace, name, body))


def test_a_deleted_pod_s_object_goes_only_once_its_containers_have_stopped(monkeypatch, tmp_path: Path) -> None:
    """As a kubelet: the runner stops a deleted pod's containers within the pod's deletion grace,
    keeps its volumes meanwhile, and then deletes the object (grace 0, on its uid), once."""
    from localcluster.podplan import ContainerPlan, PodPlan

    uid = "0123456789abcdef"
    pod = {"metadata": {"name": "leader", "namespace": "ns", "uid": uid, "deletionTimestamp": "2026-12-06T00:00:00Z",
                        "deletionGracePeriodSeconds": 3}}
    api = _FakeCoreApi([pod])
    runner = ContainerPodRunner(core_api=api, work_dir=tmp_path, api_host="127.0.0.1", api_port=6443, runner_id="t")
    c = ContainerPlan(name="operator", image="img", pull_policy="Never", entrypoint=None, args=None, env=(), mounts=())
    plan = PodPlan(namespace="ns", name="leader", uid=uid, pod_ip="127.0.0.2", containers=(c,), volumes=(),
                   unsupported=())
    runner.plans[uid] = plan  # it ran this pod before the deletion
    runner._pod_dir(plan).mkdir(parents=True)
    name = containerrunner.container_name(plan, "operator")
    listed = {name: containerrunner.podman.ContainerState(
        name=name, id="c0ffee", state="running", exit_code=0, started_at=1, exited_at=0,
        labels={containerrunner.podman.LABEL_POD_UID: uid, containerrunner.podman.LABEL_GRACE: "10"})}
    removals: list[tuple[str, int]] = []
    monkeypatch.setattr(containerrunner.podman, "list_containers", lambda runner_id: dict(listed))
    monkeypatch.setattr(ContainerPodRunner, "_remove", lambda self, n, grace_s: removals.append((n, grace_s)))
    try:
        runner.reconcile()  # the container is still there (stopping)
        assert removals == [(name, 3)], "stopped within the deletion's grace, not the pod spec's 10 s"
        assert api.deleted == [], "the object must outlive its running containers"
        assert runner._pod_dir(plan).is_dir(), "a stopping container still reads its volumes"
        runner._removing.add(name)
        listed.clear()  # a listing that no longer shows it, while its removal is still under way
        runner.reconcile()
        assert api.deleted == []
        runner._removing.clear()
        runner.reconcile()
        assert api.deleted == [("ns", "leader", {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})]
        assert not runner._pod_dir(plan).exists() and uid not in runner.plans
        runner.reconcile()  # still listed (another finalizer holds it): not deleted again
        assert len(api.deleted) == 1
        api.pods.clear()
        runner.reconcile()
        assert runner._finished == set()
    finally:
        runner.pool.shutdown(wait=True)


def test_a_deleted_pod_whose_container_is_being_created_waits_for_it(monkeypatch, tmp_path: Path) -> None:
    from localcluster.podplan import ContainerPlan, PodPlan

    uid = "fedcba9876543210"
    api = _FakeCoreApi([{"metadata": {"name": "p", "namespace": "ns", "uid": uid,
                                      "deletionTimestamp": "2026-12-06T00:00:00Z"}}])
    runner = ContainerPodRunner(core_api=api, work_dir=tmp_path, api_host="127.0.0.1", api_port=6443, runner_id="t")
    c = ContainerPlan(name="m", image="img", pull_policy="Never", entrypoint=None, args=None, env=(), mounts=())
    plan = PodPlan(namespace="ns", name="p", uid=uid, pod_ip="127.0.0.2", containers=(c,), volumes=(), unsupported=())
    runner.plans[uid] = plan
    monkeypatch.setattr(containerrunner.podman, "list_containers", lambda runner_id: {})
    track = runner.tracks.setdefault(containerrunner.container_name(plan, "m"), containerrunner._Track())
    track.busy = True  # its create is under way: the listing cannot show it yet
    try:
        runner.reconcile()
        assert api.deleted == []
        track.busy = False
        track.acted_at = time.monotonic() + 60  # it ended after this pass's listing began
        runner.reconcile()
        assert api.deleted == [], "a listing older than the create cannot tell the container is gone"
        track.acted_at = time.monotonic()
        runner.reconcile()  # a listing begun after the create ended, showing no container
        assert len(api.deleted) == 1
    finally:
        runner.pool.shutdown(wait=True)
