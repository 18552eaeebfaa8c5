"""The access round's log lines for a pod that keeps refusing its PUT /admin/access: pushed again
every round (5 s), it was a WARNING per pod per round for as long as it lasted."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sparsegate.clients.podadmin import AccessAnswer, PodTarget
from sparsegate.controllers.rollout import Fleet, RolloutCache
from sparsegate.handlers.accesssync import AccessSync

MODEL = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel",
         "metadata": {"namespace": "ns", "name": "m", "uid": "u-1", "generation": 1},
         "spec": {"access": {"requestAuth": "Enforce"}}}
TARGET = PodTarget(name="m-0", ip="127.0.0.1", port=8000, admin_port=8443)


class FakeKube:
    def get(self, kind: str, *, namespace: str, name: str) -> dict:
        return MODEL

    def update_status(self, kind: str, *, namespace: str, name: str, mutate: Any) -> None:
        mutate({**MODEL, "status": {}})


class FakeFleets:
    async def fleet(self, **_: Any) -> Fleet:
        return Fleet(targets={"m-0": TARGET}, all_pods=("m-0",))

    async def credentials(self, **_: Any) -> dict[str, PodTarget]:
        return {"m-0": TARGET}


class RefusingAdmin:
    def __init__(self) -> None:
        self.refuse: str | None = "PUT /admin/access 401: token refused"
        self.holds: str | None = None

    async def access(self, targets: Any) -> dict[str, AccessAnswer]:
        return {t.name: AccessAnswer(name=t.name, revision=self.holds) for t in targets}

    async def push_access(self, pushes: Any) -> dict[str, AccessAnswer]:
        if self.refuse is not None:
            return {t.name: AccessAnswer(name=t.name, error=self.refuse) for t, _ in pushes}
        self.holds = pushes[0][1]["revision"]
        return {t.name: AccessAnswer(name=t.name, revision=self.holds) for t, _ in pushes}


def test_a_pod_refusing_its_access_push_is_warned_about_once_not_every_round(caplog) -> None:
    admin = RefusingAdmin()
    sync = AccessSync(kube=FakeKube(), admin=admin)  # type: ignore[arg-type]
    sync.fleets = FakeFleets()  # type: ignore[assignment]
    cache = RolloutCache()
    logger = logging.getLogger("test.access")
    caplog.set_level(logging.DEBUG, logger="test.access")

    def rounds(n: int) -> list[str]:
        caplog.clear()
        for _ in range(n):
            asyncio.run(sync.tick(namespace="ns", name="m", sources=[], cache=cache, inventory=None,  # type: ignore[arg-type]
                                  logger=logger))
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert rounds(12) == ["access rules for ns/m on pod m-0 failed: PUT /admin/access 401: token refused"]
    assert any("failed again" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    admin.refuse = "PUT /admin/access: ClientConnectorError"  # another failure: news
    assert rounds(3) == ["access rules for ns/m on pod m-0 failed: PUT /admin/access: ClientConnectorError"]
    admin.refuse = None  # it took the rules: forgotten, a later refusal is news again
    assert rounds(2) == [] and cache.push_failures == {}
