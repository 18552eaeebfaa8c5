"""The allow-list at operator start: a set of shards whose head does not match them (a publish cut
short) is left as it is, so the agents keep the last whole policy they read; only with nothing
published at all is an (empty) document written."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from sparsegate_contracts import flowpolicy, flowpolicy_shards

from sparsegate.clients.flow_policy import KEY, FlowPolicyConfigMap
from sparsegate.domain.policy import Port
from sparsegate.domain.policy_compile import PodInfo, flow_document
from sparsegate.handlers import routingpolicy


def _document(models: int) -> dict[str, Any]:
    pods = [PodInfo(namespace="models", name=f"m-{i}", ip=f"127.21.{i // 250}.{i % 250 + 1}", service_account="default",
                    labels=(("sparsegate.dev/model", "mixtral"),), ports=(Port(8080),)) for i in range(models)]
    return flow_document(decisions={}, pods=pods, policed_models=[("models", "mixtral")], allowed_sources=[])


class ShardedStore(FlowPolicyConfigMap):
    """The ConfigMaps as a dict (name -> data) instead of the API server."""

    def __init__(self, maps: dict[str, dict[str, str]]) -> None:
        super().__init__(namespace="sparsegate-system", max_bytes=4096)
        self.maps = maps

    def _get(self, name: str) -> Any:
        data = self.maps.get(name)
        return None if data is None else SimpleNamespace(data=data, metadata=SimpleNamespace(annotations={}))


def _published(document: dict[str, Any]) -> dict[str, dict[str, str]]:
    layout = flowpolicy_shards.split(document, max_bytes=4096)
    assert layout.shards, "the test document must be sharded"
    maps = {name: {flowpolicy_shards.SHARD_KEY: text} for name, text in layout.shards}
    maps[flowpolicy.CONFIGMAP_NAME] = {KEY: layout.head}
    return maps


def test_a_head_whose_shards_do_not_match_is_read_as_half_published() -> None:
    maps = _published(_document(600))
    store = ShardedStore(maps)
    document, _ = asyncio.run(store.read_published())
    assert document is not None and not store.half_published
    assert len(flowpolicy.parse_document(document).policed_destinations) == 600
    first = flowpolicy_shards.shard_name(flowpolicy.CONFIGMAP_NAME, 0)
    maps[first] = {flowpolicy_shards.SHARD_KEY: "{}"}  # rewritten by a publish that then stopped
    document, _ = asyncio.run(store.read_published())
    assert document is None and store.half_published


@pytest.mark.parametrize("head", ["{cut short", "[]", '"text"', "null"])
def test_a_head_that_is_not_a_document_is_read_as_half_published(head: str) -> None:
    """Not an error that stops every sync from publishing (the agents refuse such a head and keep
    their last policy): no document, left as it is at startup, overwritten by the next publish."""
    store = ShardedStore({flowpolicy.CONFIGMAP_NAME: {KEY: head}})
    document, basis = asyncio.run(store.read_published())
    assert (document, basis) == (None, None) and store.half_published


@pytest.mark.parametrize("half", [True, False])
def test_startup_leaves_a_half_published_set_and_publishes_only_when_nothing_is(monkeypatch, half: bool) -> None:
    class Store:
        half_published = half

        def __init__(self) -> None:
            self.writes: list[dict[str, Any]] = []

        async def read_published(self) -> tuple[None, None]:
            return None, None

        async def publish(self, document: dict[str, Any], *, basis: Any = None) -> None:
            self.writes.append(document)

    store = Store()
    monkeypatch.setattr(routingpolicy, "_state",
                        lambda: SimpleNamespace(store=store, settings=SimpleNamespace(allowed_sources=["10.0.0.2"])))
    asyncio.run(routingpolicy.check_allow_list_at_startup(logger=logging.getLogger("test")))
    if half:
        assert store.writes == []  # the agents keep the last whole policy; the first sync republishes
    else:
        assert len(store.writes) == 1 and store.writes[0]["rules"] == []


class WritableStore(ShardedStore):
    def _put(self, name: str, data: dict[str, str], annotations: dict[str, str]) -> None:
        self.maps[name] = dict(data)

    def _clear(self, name: str) -> None:
        if name in self.maps:  # never created when absent
            self.maps[name] = {}


def test_the_first_publish_empties_shards_a_publish_cut_short_left_unnamed() -> None:
    """A publish that stopped after writing its shards, before its head, left shards no head names;
    the next process's first publish (here back to one ConfigMap) empties them too."""
    maps = _published(_document(600))  # the head names some shards
    named = flowpolicy_shards.shards_named(maps[flowpolicy.CONFIGMAP_NAME][KEY])
    bigger = flowpolicy_shards.split(_document(2000), max_bytes=4096)
    assert len(bigger.shards) > len(named)
    for name, text in bigger.shards:  # the cut-short publish: shards written, head never
        maps[name] = {flowpolicy_shards.SHARD_KEY: text}
    store = WritableStore(maps)
    asyncio.run(store.read_published())
    asyncio.run(store.publish(_document(1)))  # one ConfigMap
    left = {name: data for name, data in maps.items() if name != flowpolicy.CONFIGMAP_NAME and data}
    assert left == {}, f"stale shards kept: {sorted(left)}"
    # A process's later publishes empty only what the head they replace named.
    cleared: list[str] = []
    store._clear = cleared.append  # type: ignore[method-assign]
    asyncio.run(store.publish(_document(2)))
    assert cleared == []


def test_a_request_the_api_server_never_answers_times_out(monkeypatch) -> None:
    """A kept-alive connection whose peer is gone (or an API server that accepts and stalls) left a
    read or publish blocked for good, and with it the policy sync's lock: no later policy change,
    a Deny included, ever reached the data plane."""
    import socket
    import threading

    import kubernetes

    from sparsegate.clients import flow_policy

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()[0]) for _ in range(8)], daemon=True).start()
    monkeypatch.setattr(flow_policy, "REQUEST_TIMEOUT_S", 0.3, raising=False)
    config = kubernetes.client.Configuration(host=f"http://127.0.0.1:{listener.getsockname()[1]}")
    config.retries = 0
    store = FlowPolicyConfigMap(namespace="ns", api_client=kubernetes.client.ApiClient(config))
    outcomes: list[BaseException | None] = []

    def call(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
            outcomes.append(None)
        except BaseException as e:  # noqa: BLE001 - the outcome is the test's
            outcomes.append(e)

    for fn, args in ((store._read, ()), (store._put, ("sparsegate-flow-policy", {KEY: "{}"}, {}))):
        worker = threading.Thread(target=call, args=(fn, *args), daemon=True)
        worker.start()
        worker.join(timeout=10)
        assert not worker.is_alive(), f"{fn.__name__} still waiting for an answer"
    assert len(outcomes) == 2 and all(isinstance(e, Exception) for e in outcomes)
    listener.close()
    for conn in accepted:
        conn.close()
