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
