"""ProbeSync (the handler's state) against fakes of our own wrappers: publish only on change, retry
a failed publish, and the status write computed from the reports."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest
from sparsegate_contracts import probes as contract

from sparsegate.domain.telemetry_probe import node_info, probe_source
from sparsegate.handlers import telemetryprobe

PROBE = probe_source({"metadata": {"namespace": "ns", "name": "p", "generation": 2,
                                   "creationTimestamp": "2026-12-03T10:00:00Z"},
                      "spec": {"interfaces": ["eth0"], "xdpMode": "auto"}})
NODE = node_info({"metadata": {"name": "n1", "labels": {}}})


class FakeStore:
    def __init__(self, *, fail: int = 0) -> None:
        self.fail = fail
        self.published: list[dict[str, Any]] = []
        self.report: dict[str, contract.NodeReport] = {}
        self.pruned: list[set[str]] = []  # the node lists prune_reports was called with
        self.prune_conflicts = 0
        self.config: dict[str, Any] | None = None  # what the configuration ConfigMap holds
        self.checks = 0  # holds() calls: GETs of the configuration ConfigMap

    async def publish(self, configs: dict[str, Any]) -> bool:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("409 Conflict")
        self.published.append(dict(configs))
        self.config = dict(configs)
        return True

    async def holds(self, configs: dict[str, Any]) -> bool:
        self.checks += 1
        return self.config == configs

    async def reports(self) -> dict[str, contract.NodeReport]:
        return dict(self.report)

    async def prune_reports(self, nodes: Any) -> list[str] | None:
        self.pruned.append(set(nodes))
        if self.prune_conflicts:
            self.prune_conflicts -= 1
            return None
        return []


class FakeKube:
    """Kube.update_status's contract: mutate(current) -> patch or None."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] = {"metadata": {"name": "p"}, "status": {}}
        self.writes = 0

    def update_status(self, kind: str, *, namespace: str, name: str, mutate: Any) -> dict[str, Any]:
        assert (kind, namespace, name) == ("TelemetryProbe", "ns", "p")
        patch = mutate(self.obj)
        if patch is not None:
            self.obj["status"] = {**self.obj["status"], **patch}
            self.writes += 1
        return self.obj


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_publishes_only_when_the_plan_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    store = FakeStore()
    sync = telemetryprobe.ProbeSync(store=store, kube=FakeKube())  # type: ignore[arg-type]
    run(sync.sync(probes=[PROBE], nodes=[NODE]))
    run(sync.sync(probes=[PROBE], nodes=[NODE]))
    assert [set(c) for c in store.published] == [{"n1"}]
    run(sync.sync(probes=[], nodes=[NODE]))  # the probe went: the node's key goes
    assert store.published[-1] == {}


def test_a_failed_publish_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(telemetryprobe.asyncio, "sleep", no_sleep)
    store = FakeStore(fail=2)
    sync = telemetryprobe.ProbeSync(store=store, kube=FakeKube())  # type: ignore[arg-type]
    run(sync.sync(probes=[PROBE], nodes=[NODE]))
    assert len(store.published) == 1 and sync.published == store.published[0]
    store.fail = telemetryprobe.PUBLISH_ATTEMPTS
    with pytest.raises(RuntimeError):
        run(sync.sync(probes=[], nodes=[NODE]))
    assert sync.published == store.published[0]  # not recorded: the next sync tries again


def test_a_configuration_deleted_or_edited_by_another_writer_is_published_again() -> None:
    """Level-triggered: the cache of what was published must not hide a ConfigMap deleted or edited
    since (agents would fall back to --interfaces until some probe or node changed). Checked once
    per interval however many probes' loops sync: one GET, not one per probe."""
    t = [0.0]
    store = FakeStore()
    sync = telemetryprobe.ProbeSync(store=store, kube=FakeKube(), recheck_s=5.0,  # type: ignore[arg-type]
                                    clock=lambda: t[0])
    run(sync.sync(probes=[PROBE], nodes=[NODE]))
    assert len(store.published) == 1
    store.config = None  # deleted (by hand, or pruned by a GitOps tool)
    t[0] = 1.0
    run(sync.sync(probes=[PROBE], nodes=[NODE]))  # just written: not read back yet
    assert len(store.published) == 1 and store.checks == 0
    t[0] = 6.0
    for _ in range(3):  # three probes' loops in the same interval
        run(sync.sync(probes=[PROBE], nodes=[NODE]))
    assert len(store.published) == 2 and store.config == store.published[0] and store.checks == 1
    store.config = {"n1": {"interfaces": []}}  # edited by hand
    t[0] = 12.0
    run(sync.sync(probes=[PROBE], nodes=[NODE]))
    assert len(store.published) == 3 and store.config == store.published[0]
    t[0] = 18.0
    run(sync.sync(probes=[PROBE], nodes=[NODE]))  # in place: read, not written
    assert len(store.published) == 3 and store.checks == 3


def test_a_check_that_keeps_failing_is_warned_about_once_not_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    """The API server down fails the ConfigMap check every recheck_s (5 s): one WARNING with its
    traceback when it starts or changes, the same one again at DEBUG (it was a traceback every 5 s)."""
    class Unreadable(FakeStore):
        error: str | None = "503 Service Unavailable"

        async def holds(self, configs: dict[str, Any]) -> bool:
            if self.error is not None:
                raise RuntimeError(self.error)
            return await super().holds(configs)

    t = [0.0]
    store = Unreadable()
    sync = telemetryprobe.ProbeSync(store=store, kube=FakeKube(), recheck_s=5.0,  # type: ignore[arg-type]
                                    clock=lambda: t[0])
    run(sync.sync(probes=[PROBE], nodes=[NODE]))
    caplog.set_level(logging.DEBUG, logger=telemetryprobe.log.name)

    def intervals(n: int) -> int:
        caplog.clear()
        for _ in range(n):
            t[0] += 6.0
            run(sync.sync(probes=[PROBE], nodes=[NODE]))
        return sum(1 for r in caplog.records if r.levelno >= logging.WARNING and "probe configuration" in r.getMessage())

    assert intervals(10) == 1
    store.error = "connection refused"  # another failure: news
    assert intervals(3) == 1
    store.error = None  # read again: a later failure is news again
    assert intervals(1) == 0
    store.error = "connection refused"
    assert intervals(2) == 1


def test_status_is_written_from_reports_and_not_rewritten_when_unchanged() -> None:
    store, kube = FakeStore(), FakeKube()
    sync = telemetryprobe.ProbeSync(store=store, kube=kube)  # type: ignore[arg-type]
    current = run(sync.sync(probes=[PROBE], nodes=[NODE]))
    run(sync.write_status(probe=PROBE, current=current))
    assert kube.obj["status"]["attachedNodes"] == 0 and kube.obj["status"]["observedGeneration"] == 2
    version = current.configs["n1"]["version"]
    store.report["n1"] = contract.NodeReport(node="n1", config_version=version, program_id=11,
                                             interfaces=(contract.InterfaceReport("eth0", "native"),))
    run(sync.write_status(probe=PROBE, current=current))
    run(sync.write_status(probe=PROBE, current=current))
    assert kube.writes == 2
    assert kube.obj["status"]["attachments"] == [{"node": "n1", "interface": "eth0", "mode": "native",
                                                  "programId": 11}]
    ready = next(c for c in kube.obj["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"


def test_a_configuration_too_large_for_its_configmap_is_not_published_and_stalls_every_probe() -> None:
    """16 interfaces (the CRD's most) on 1,000 nodes: over a ConfigMap's 1 MiB. It is not published
    (the API server would refuse it, and the sync raised with no condition written); the agents keep
    the last configuration and the probe says why, with the numbers. Shrunk, it is published."""
    from sparsegate.domain.telemetry_probe import NodeInfo

    big = probe_source({"metadata": {"namespace": "ns", "name": "p", "generation": 1,
                                     "creationTimestamp": "2026-01-01T00:00:00Z"},
                        "spec": {"interfaces": [f"ens{i}f{j}" for i in range(4) for j in range(4)],
                                 "xdpMode": "native"}})
    nodes = [NodeInfo(name=f"ip-10-0-{i // 250}-{i % 250}.eu-west-1.compute.internal") for i in range(1000)]
    store, kube = FakeStore(), FakeKube()
    sync = telemetryprobe.ProbeSync(store=store, kube=kube)  # type: ignore[arg-type]
    current = run(sync.sync(probes=[big], nodes=nodes))
    assert current.config_bytes > contract.CONFIG_MAX_BYTES and store.published == []
    run(sync.write_status(probe=big, current=current))
    conds = {c["type"]: c for c in kube.obj["status"]["conditions"]}
    assert (conds["Stalled"]["status"], conds["Stalled"]["reason"]) == ("True", "ConfigurationTooLarge")
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "ConfigurationTooLarge")
    assert f"{current.config_bytes} bytes for 1000 node(s)" in conds["Stalled"]["message"]
    assert conds["Reconciling"]["status"] == "False"
    current = run(sync.sync(probes=[big], nodes=nodes[:100]))
    assert current.too_large is None and len(store.published) == 1 and len(store.published[0]) == 100


def test_node_events_prune_the_reports_on_start_and_when_a_node_left() -> None:
    """The first node event prunes (nodes deleted while the operator was down); later ones read the
    reports again only once a node left, with the node list read then; a conflict is retried."""
    store = FakeStore()
    sync = telemetryprobe.ProbeSync(store=store, kube=FakeKube())  # type: ignore[arg-type]
    nodes = {"n1", "n2"}

    def prune() -> None:
        run(sync.prune_reports(lambda: iter(sorted(nodes))))

    prune()
    assert store.pruned == [{"n1", "n2"}]
    prune()
    nodes.add("n3")  # a node came: nothing to drop, no read
    prune()
    assert len(store.pruned) == 1
    nodes.discard("n1")
    store.prune_conflicts = 1
    prune()  # an agent wrote meanwhile: tried again on the next event
    prune()
    prune()
    assert store.pruned[1:] == [{"n2", "n3"}, {"n2", "n3"}]


def test_a_node_event_prunes_with_the_node_index(monkeypatch: pytest.MonkeyPatch) -> None:
    store = FakeStore()
    monkeypatch.setattr(telemetryprobe, "_sync", telemetryprobe.ProbeSync(store=store, kube=FakeKube()))  # type: ignore[arg-type]
    index = {"n1": [NODE], "n2": [node_info({"metadata": {"name": "n2"}})]}  # a kopf.Index's shape
    run(telemetryprobe.probe_node_event(sparsegate_telemetry_probes={}, sparsegate_probe_nodes=index))
    assert store.pruned == [{"n1", "n2"}]


def test_the_last_probe_deleted_while_its_publish_fails_leaves_the_configuration_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The deletion's sync is the only one left when the last probe goes (no loop remains to sync
    again): a publish that fails then (the API server erroring for a few seconds) must be tried
    again until it lands, not leave the deleted probe's interfaces attached until some node changes."""
    real_sleep = asyncio.sleep
    monkeypatch.setattr(telemetryprobe, "_settings", dataclasses.replace(telemetryprobe._settings, resync_seconds=0.01))
    store = FakeStore()
    monkeypatch.setattr(telemetryprobe, "_sync", telemetryprobe.ProbeSync(store=store, kube=FakeKube()))  # type: ignore[arg-type]
    nodes = {"n1": [NODE]}

    async def scenario() -> None:
        await telemetryprobe._sync.sync(probes=[PROBE], nodes=[NODE])  # the probe's interfaces published
        assert set(store.config or {}) == {"n1"}
        store.fail = telemetryprobe.PUBLISH_ATTEMPTS  # the deletion's publish fails
        try:
            await telemetryprobe.telemetry_probe_event(
                type="DELETED", namespace="ns", name="p",
                body={"metadata": {"namespace": "ns", "name": "p", "uid": "u1"}},
                logger=logging.getLogger("test"), sparsegate_telemetry_probes={}, sparsegate_probe_nodes=nodes)
        except RuntimeError:
            pass  # the old handler raised (Kopf logs it; nothing tries again)
        for _ in range(50):
            if store.config == {}:
                break
            await real_sleep(0.01)
        try:
            assert store.config == {}, "the deleted probe's interfaces stayed in the configuration"
        finally:
            await telemetryprobe.stop_probe_loops()

    run(scenario())
