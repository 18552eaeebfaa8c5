"""RoutingPolicy watch events of a deletion (``handlers.routingpolicy.routing_policy_event``): the sync
they run computes the allow-list from the policies Kopf's index holds, and a policy deleted and
created again under the same name (``kubectl replace --force``, a GitOps re-create) keeps its
entries: Kopf handles each uid's events apart, so the old object's DELETED may come after the new
object's first event, when the index already holds the new policy."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sparsegate.domain.policy import PolicySource
from sparsegate.handlers import routingpolicy

SPEC = {"action": "Allow", "sources": [{"namespace": "web"}], "targets": [{"sparseModel": "mixtral"}],
        "ports": [{"port": 8080}]}


class RecordingSync:
    """Stands in for ``PolicySync``: records the policies each sync was given; never writes status."""

    def __init__(self) -> None:
        self.synced: list[list[str]] = []
        self.kube = None

    async def sync(self, *, policies: list[PolicySource], pods: list[Any]) -> None:
        self.synced.append([p.key for p in policies])


def _body(uid: str, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "models", "name": "allow-web", "uid": uid, "generation": 1, **meta},
            "spec": SPEC}


def test_the_old_policys_deleted_event_after_the_new_ones_first_keeps_the_new_policy(monkeypatch) -> None:
    sync = RecordingSync()
    monkeypatch.setattr(routingpolicy, "_state", lambda: sync)
    written: list[str] = []

    async def write_status(_sync: Any, *, key: str, **_: Any) -> None:
        written.append(key)

    monkeypatch.setattr(routingpolicy, "_write_status", write_status)
    new = PolicySource(namespace="models", name="allow-web", generation=1, spec=SPEC)
    index = {("models", "allow-web"): [new]}  # the index holds the re-created policy (uid-2)
    log = logging.getLogger("test")

    async def run() -> None:
        common = {"name": "allow-web", "namespace": "models", "sparsegate_routing_policies": index,
                  "sparsegate_flow_pods": {}, "logger": log}
        try:
            await routingpolicy.routing_policy_event(type="ADDED", body=_body("uid-2"),
                                                     meta=_body("uid-2")["metadata"], **common)
            # The old object's DELETED, handled after the new one's first event.
            await routingpolicy.routing_policy_event(type="DELETED", body=_body("uid-1"),
                                                     meta=_body("uid-1")["metadata"], **common)
        finally:
            await routingpolicy._loops.stop()

    asyncio.run(run())
    assert sync.synced, "the deletion ran no sync"
    assert sync.synced[-1] == ["models/allow-web"], \
        f"the re-created policy was left out of the allow-list: synced {sync.synced}"
    assert written == [], "a deletion must not write the (new) policy's status from the old one's event"


def test_a_deleted_policy_is_synced_without_it_and_writes_no_status(monkeypatch) -> None:
    """The plain deletion: the index no longer holds the policy (Kopf drops it before the handler runs)."""
    sync = RecordingSync()
    monkeypatch.setattr(routingpolicy, "_state", lambda: sync)
    written: list[str] = []

    async def write_status(_sync: Any, *, key: str, **_: Any) -> None:
        written.append(key)

    monkeypatch.setattr(routingpolicy, "_write_status", write_status)
    other = PolicySource(namespace="models", name="other", generation=1, spec=SPEC)
    index = {("models", "other"): [other]}

    async def run() -> None:
        try:
            await routingpolicy.routing_policy_event(
                type="DELETED", body=_body("uid-1"), meta=_body("uid-1")["metadata"], name="allow-web",
                namespace="models", sparsegate_routing_policies=index, sparsegate_flow_pods={},
                logger=logging.getLogger("test"))
        finally:
            await routingpolicy._loops.stop()

    asyncio.run(run())
    assert sync.synced == [["models/other"]] and written == []


def test_the_last_policy_deleted_while_opa_is_down_leaves_the_allow_list_once_opa_answers(monkeypatch) -> None:
    """The deletion narrows the allow-list without OPA (its entries go, the model stays policed: narrowing
    adds nothing). With no policy left no loop remains to sync again, so once OPA answers the
    deletion's sync must be tried again; otherwise the model stays policed with nothing allowed (all
    traffic to it refused) until the operator restarts or some policy is created."""
    from sparsegate.clients.opa import OpaUnavailable
    from sparsegate.handlers.periodic import ObjectLoops
    from test_policy_sync_narrowing import ALLOW, M, TRUSTED, decided, opa_answer

    monkeypatch.setattr(routingpolicy, "_loops", ObjectLoops(kind="RoutingPolicy", interval_s=0.01))
    monkeypatch.setattr(routingpolicy, "_sync", None)  # no client of this process's own to close

    def policed(document: dict[str, Any] | None) -> list[Any]:
        return list((document or {}).get("policedDestinations") or [])

    async def run() -> None:
        store, opa, sync = await decided([ALLOW], [M, TRUSTED])
        assert policed(store.document)
        monkeypatch.setattr(routingpolicy, "_state", lambda: sync)
        opa.answer = OpaUnavailable("OPA at http://opa.test:8181: ConnectionError")
        try:
            await routingpolicy.routing_policy_event(
                type="DELETED", body=_body("uid-1"), meta=_body("uid-1")["metadata"], name=ALLOW.name,
                namespace=ALLOW.namespace, sparsegate_routing_policies={},  # gone from the index
                sparsegate_flow_pods={"models": [M], "web": [TRUSTED]}, logger=logging.getLogger("test"))
            assert policed(store.document), "narrowed while OPA is down: still policed, nothing added"
            opa.answer = opa_answer([])  # OPA is back
            for _ in range(200):
                if not policed(store.document):
                    break
                await asyncio.sleep(0.01)
            assert not policed(store.document), "no policy left, yet the model stays policed"
        finally:
            await routingpolicy.close_opa_client()  # the operator's cleanup: loops and any pending retry

    asyncio.run(run())


def test_opa_down_is_warned_about_once_per_policy_not_every_resync(monkeypatch, caplog) -> None:
    """OPA unreachable fails every resync (10 s) of every policy: one WARNING per policy when it
    starts and when its error changes, not one per policy per resync for as long as OPA is down."""
    errors: list[Exception | None] = []

    async def sync_and_status(**_: Any) -> Exception | None:
        return errors.pop(0)

    monkeypatch.setattr(routingpolicy, "_sync_and_status", sync_and_status)
    caplog.set_level(logging.DEBUG, logger="test.opa-down")
    logger = logging.getLogger("test.opa-down")
    down, refused = routingpolicy.OpaUnavailable("connection refused"), routingpolicy.OpaUnavailable("timed out")
    errors += [down] * 10 + [refused] * 2 + [None] + [down]

    async def resyncs(n: int) -> None:
        for _ in range(n):
            await routingpolicy.resync_routing_policy(logger=logger, name="p", namespace="ns", meta={})
    asyncio.run(resyncs(14))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [f"OPA not usable, allow-list kept (fail closed): {e}" for e in (down, refused, down)]
    routingpolicy._resync_errors.clear()
