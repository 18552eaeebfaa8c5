"""The connection cap (`connections.ConnectionLimiter`): the policy at the cap, without sockets
(the entry point's behaviour under idle clients: test_model_server.py)."""

from __future__ import annotations

import asyncio

import pytest

from sparsegate_workload import connections


class FakeHandler:
    def __init__(self, *, idle: bool) -> None:
        self._manager = object()
        self._waiter = asyncio.get_running_loop().create_future() if idle else None
        self.closed = False

    def force_close(self) -> None:
        self.closed = True


class FakeServer:
    def __init__(self) -> None:
        self.connections: list[FakeHandler] = []
        self.made = 0

    def __call__(self) -> FakeHandler:
        self.made += 1
        return FakeHandler(idle=False)


def test_default_cap_leaves_headroom_under_rlimit_nofile():
    assert connections.default_max_connections(1024) == 1024 - 448 - connections.PROBE_RESERVE
    assert connections.default_max_connections(4096) == 4096 - 1024 - connections.PROBE_RESERVE
    assert connections.default_max_connections(256) == 1
    assert connections.default_max_connections(1 << 20) == connections.MAX_DEFAULT_CONNECTIONS
    with pytest.raises(ValueError, match="at least 1"):
        connections.ConnectionLimiter(0)


async def test_at_the_cap_the_oldest_idle_connection_makes_room_else_the_reserve_then_refusal():
    limiter = connections.ConnectionLimiter(3, reserve=1)
    admin, inference = FakeServer(), FakeServer()
    make_admin, make = limiter.factory(admin), limiter.factory(inference)
    busy, old_idle, new_idle = FakeHandler(idle=False), FakeHandler(idle=True), FakeHandler(idle=True)
    inference.connections = [busy, old_idle, new_idle]
    # At the cap: served, and the oldest idle connection is closed (not the busy one).
    assert isinstance(make_admin(), FakeHandler)
    assert old_idle.closed and not new_idle.closed and not busy.closed
    # A handler made but not connected yet still counts: with 2 connected the next one is at the cap.
    inference.connections = [busy, new_idle]
    assert isinstance(make(), FakeHandler) and new_idle.closed
    # None idle: within the reserve still served (a probe while every connection is busy) ...
    inference.connections = [busy, FakeHandler(idle=False), FakeHandler(idle=False)]
    limiter._pending.clear()
    assert isinstance(make(), FakeHandler)
    # ... beyond it closed at once, without a handler.
    refused = make()
    assert isinstance(refused, connections._Refused) and limiter.refused == 1
    assert inference.made == 2 and admin.made == 1
