"""ProbeConfigMaps against a fake of our Kube wrapper: what is written for a plan of probes."""

from __future__ import annotations

import asyncio
from typing import Any

from sparsegate_contracts import probes as contract

from sparsegate.clients.kube import Conflict
from sparsegate.clients.probe_config import ProbeConfigMaps

CONFIG = {"n1": {"interfaces": ["eth0"]}}


class FakeKube:
    """get / create_if_absent / create / replace, recording every write."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self.gets = 0
        self.conflict = False  # replace answers 409 (someone wrote since the read)

    def get(self, kind: str, *, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        return self.objects.get(name)

    def create_if_absent(self, obj: dict[str, Any]) -> bool:
        name = obj["metadata"]["name"]
        self.writes.append(("create_if_absent", name))
        if name in self.objects:
            return False
        self.objects[name] = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}
        return True

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.writes.append(("create", obj["metadata"]["name"]))
        self.objects[obj["metadata"]["name"]] = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}
        return obj

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.conflict:
            raise Conflict(409, "Conflict", {})
        self.writes.append(("replace", obj["metadata"]["name"]))
        self.objects[obj["metadata"]["name"]] = obj
        return obj


def publish(kube: FakeKube, configs: dict[str, Any]) -> bool:
    return asyncio.run(ProbeConfigMaps(kube=kube, namespace="sg").publish(configs))  # type: ignore[arg-type]


def test_no_probe_and_nothing_published_writes_nothing() -> None:
    kube = FakeKube()
    assert publish(kube, {}) is False
    assert kube.writes == [] and kube.gets == 1


def test_a_probe_creates_the_reports_and_the_configuration() -> None:
    kube = FakeKube()
    assert publish(kube, CONFIG) is True
    assert kube.writes == [("create_if_absent", contract.REPORT_CONFIGMAP_NAME),
                           ("create", contract.CONFIG_CONFIGMAP_NAME)]
    assert set(kube.objects[contract.CONFIG_CONFIGMAP_NAME]["data"]) == {"n1"}
    assert publish(kube, CONFIG) is False  # unchanged: no configuration write
    assert [w for w in kube.writes if w[1] == contract.CONFIG_CONFIGMAP_NAME] == [
        ("create", contract.CONFIG_CONFIGMAP_NAME)]


def test_the_last_probe_gone_empties_the_published_configuration() -> None:
    kube = FakeKube()
    publish(kube, CONFIG)
    assert publish(kube, {}) is True
    assert kube.writes[-1] == ("replace", contract.CONFIG_CONFIGMAP_NAME)
    assert kube.objects[contract.CONFIG_CONFIGMAP_NAME]["data"] == {}


def test_reports_of_nodes_that_left_are_dropped_and_the_others_kept() -> None:
    kube = FakeKube()
    store = ProbeConfigMaps(kube=kube, namespace="sg")  # type: ignore[arg-type]
    publish(kube, CONFIG)
    reports = kube.objects[contract.REPORT_CONFIGMAP_NAME]
    reports["data"] = {"n1": "{}", "gone-0": "{}", "gone-1": "{}"}
    assert asyncio.run(store.prune_reports({"n1", "n2"})) == ["gone-0", "gone-1"]
    kept = kube.objects[contract.REPORT_CONFIGMAP_NAME]
    assert kept["data"] == {"n1": "{}"}
    # The object as read goes back (its resourceVersion: an agent's patch since makes the PUT 409).
    assert kept["metadata"]["resourceVersion"] == "1" and kept["metadata"]["labels"] == reports["metadata"]["labels"]
    writes = len(kube.writes)
    assert asyncio.run(store.prune_reports({"n1"})) == [] and len(kube.writes) == writes  # nothing stale


def test_a_prune_that_conflicts_drops_nothing_and_says_so() -> None:
    kube = FakeKube()
    store = ProbeConfigMaps(kube=kube, namespace="sg")  # type: ignore[arg-type]
    assert asyncio.run(store.prune_reports({"n1"})) == []  # no reports ConfigMap: nothing to do
    publish(kube, CONFIG)
    kube.objects[contract.REPORT_CONFIGMAP_NAME]["data"] = {"gone": "{}"}
    kube.conflict = True
    assert asyncio.run(store.prune_reports({"n1"})) is None
    assert kube.objects[contract.REPORT_CONFIGMAP_NAME]["data"] == {"gone": "{}"}


def test_holds_tells_a_deleted_or_edited_configuration_with_one_get_and_no_write() -> None:
    kube = FakeKube()
    maps = ProbeConfigMaps(kube=kube, namespace="sg")  # type: ignore[arg-type]
    assert asyncio.run(maps.holds({})) is True  # absent is what no probe looks like
    assert asyncio.run(maps.holds(CONFIG)) is False  # deleted
    publish(kube, CONFIG)
    kube.writes.clear()
    gets = kube.gets
    assert asyncio.run(maps.holds(CONFIG)) is True and kube.gets == gets + 1
    kube.objects[contract.CONFIG_CONFIGMAP_NAME]["data"] = {"n1": "{}"}  # edited by hand
    assert asyncio.run(maps.holds(CONFIG)) is False
    assert kube.writes == []
