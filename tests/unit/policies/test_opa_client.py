"""The OPA client wrapper's contract that needs no server: addresses and fail-closed errors."""

from __future__ import annotations

import socket

import pytest

from sparsegate.clients.opa import OpaUnavailable, RoutingOpa, address


def test_address_from_url() -> None:
    assert address("http://127.0.0.1:8181") == ("127.0.0.1", 8181, False)
    assert address("https://opa.sparsegate-system.svc:9443") == ("opa.sparsegate-system.svc", 9443, True)
    assert address("127.0.0.1") == ("127.0.0.1", 8181, False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when we return: nothing listens there


@pytest.mark.parametrize("call", ["check", "revision", "loaded_policies"])
async def test_unreachable_opa_raises_opa_unavailable(call: str) -> None:
    opa = RoutingOpa(url=f"http://127.0.0.1:{_closed_port()}", timeout=0.5, retries=0)
    try:
        with pytest.raises(OpaUnavailable):
            await getattr(opa, call)()
        with pytest.raises(OpaUnavailable):
            await opa.push(rego="package x", data={})
        with pytest.raises(OpaUnavailable):
            await opa.decide_many([{"source": {}, "target": {}}])
    finally:
        opa.close()


async def test_decide_many_of_nothing_asks_nothing() -> None:
    opa = RoutingOpa(url=f"http://127.0.0.1:{_closed_port()}")
    try:
        assert await opa.decide_many([]) == []
    finally:
        opa.close()
