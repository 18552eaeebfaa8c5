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
