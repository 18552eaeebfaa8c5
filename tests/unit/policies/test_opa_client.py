"""The OPA client wrapper's contract that needs no server: addresses and fail-closed errors."""

from __future__ import annotations

import socket

import pytest

from sparsegate.clients.opa import OpaRejected, OpaUnavailable, RoutingOpa, address


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
        with pytest.raises(OpaUnavailable):
            await opa.flow_decisions({"one": [], "classes": [], "models": [], "many": []})
    finally:
        opa.close()


async def test_decide_many_of_nothing_asks_nothing() -> None:
    opa = RoutingOpa(url=f"http://127.0.0.1:{_closed_port()}")
    try:
        assert await opa.decide_many([]) == []
    finally:
        opa.close()


class _RecordingOpa:
    """A stand-in OPA on loopback that records each request's Authorization header and answers
    like OPA: 401 `{"code": "unauthorized"}` (OPA's answer when system.authz denies) unless the
    bearer token matches, else minimal well-formed bodies."""

    def __init__(self, *, token: str, flow_body: dict | None = None, server_error: int | None = None) -> None:
        import http.server
        import json
        import threading

        seen = self.seen = []
        encodings = self.encodings = []  # Accept-Encoding of each request

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if self.command == "POST" else None  # PUTs: Rego or data
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                encodings.append(self.headers.get("Accept-Encoding"))
                if server_error is not None:  # OPA's own error body, e.g. a storage failure
                    status, reply = server_error, {"code": "internal_error", "message": "storage: write failed"}
                elif self.headers.get("Authorization") != f"Bearer {token}":
                    status, reply = 401, {"code": "unauthorized",
                                          "message": "request rejected by administrative policy"}
                elif self.command == "PUT" and "/data/" in self.path:
                    status, reply = 204, None
                elif self.command == "POST" and isinstance(body, dict) and "batch" in body["input"]:
                    status, reply = 200, {"result": [{"allow": False}] * len(body["input"]["batch"])}
                elif self.command == "POST" and self.path.endswith("/flow_decisions"):
                    status, reply = 200, {"result": {"one": [], "many": []}} if flow_body is None else flow_body
                else:
                    status, reply = 200, {"result": "rev-1" if self.path.endswith("data_revision") else {}}
                data = b"" if reply is None else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = _answer

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_every_call_carries_the_bearer_token() -> None:
    fake = _RecordingOpa(token="s3cret")
    opa = RoutingOpa(url=fake.url, token="s3cret", retries=0)
    try:
        await opa.check()
        assert await opa.revision() == "rev-1"
        await opa.push(rego="package sparsegate.routing", data={"revision": "rev-1"})
        assert await opa.loaded_policies() == {}
        assert await opa.decide_many([{"source": {}, "target": {}}] * 3) == [{"allow": False}] * 3
        assert await opa.flow_decisions({"one": [], "classes": [], "models": [], "many": []}) == {"one": [], "many": []}
    finally:
        opa.close()
        fake.close()
    methods = {m for m, _, _ in fake.seen}
    assert methods == {"GET", "PUT", "POST"} and len(fake.seen) == 7
    assert {auth for _, _, auth in fake.seen} == {"Bearer s3cret"}
    # No gzip asked for: OPA would compress large answers, which costs more than it saves on loopback.
    assert set(fake.encodings) == {"identity"}


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_a_refused_token_is_opa_unavailable_not_a_rejected_policy(token: str | None) -> None:
    """401 means "fail closed and retry" (the token comes right with the Secret), and a refused
    read is never mistaken for an empty OPA (which would trigger a push)."""
    fake = _RecordingOpa(token="s3cret")
    opa = RoutingOpa(url=fake.url, token=token, retries=0)
    try:
        for call in (opa.check, opa.revision, opa.loaded_policies):
            with pytest.raises(OpaUnavailable, match="token"):
                await call()
        with pytest.raises(OpaUnavailable, match="token"):
            await opa.push(rego="package sparsegate.routing", data={})
        with pytest.raises(OpaUnavailable, match="token"):
            await opa.decide_many([{"source": {}, "target": {}}])
    finally:
        opa.close()
        fake.close()
    assert {auth for _, _, auth in fake.seen} == {None if token is None else f"Bearer {token}"}


@pytest.mark.parametrize(("body", "said"), [
    ({}, "flow_decisions undefined"),  # the policy is gone (OPA restarted between push and query)
    ({"result": [[], []]}, "malformed flow_decisions answer: expected {'one': [...], 'many': [...]}, got [[], []]"),
    ({"result": {"one": [], "many": {}}}, "malformed flow_decisions answer"),
])
async def test_flow_decisions_undefined_or_malformed_is_opa_unavailable(body: dict, said: str) -> None:
    """Either way nothing is decided: fail closed and retry; the message says which it was."""
    fake = _RecordingOpa(token="s3cret", flow_body=body)
    opa = RoutingOpa(url=fake.url, token="s3cret", retries=0)
    try:
        with pytest.raises(OpaUnavailable) as raised:
            await opa.flow_decisions({"one": [], "classes": [], "models": [], "many": []})
    finally:
        opa.close()
        fake.close()
    assert said in str(raised.value)


def test_settings_read_the_token_from_env_and_never_print_it(monkeypatch) -> None:
    from sparsegate.handlers.routingpolicy import Settings

    monkeypatch.setenv("SPARSEGATE_OPA_TOKEN", "s3cret")
    settings = Settings.from_env()
    assert settings.opa_token == "s3cret" and "s3cret" not in repr(settings)
    monkeypatch.setenv("SPARSEGATE_OPA_TOKEN", "")
    assert Settings.from_env().opa_token is None


@pytest.mark.parametrize("status", [500, 503])
async def test_a_server_error_is_opa_unavailable_never_nothing_loaded_or_a_rejected_policy(status: int) -> None:
    """A 5xx means "fail closed and retry": a read is not an empty OPA (which triggers a push) and a
    push is not a policy OPA refused (Stalled: "retrying cannot help")."""
    fake = _RecordingOpa(token="s3cret", server_error=status)
    opa = RoutingOpa(url=fake.url, token="s3cret", retries=0)
    try:
        for call in (opa.revision, opa.loaded_policies):
            with pytest.raises(OpaUnavailable, match=f"HTTP {status}"):
                await call()
        with pytest.raises(OpaUnavailable, match=f"HTTP {status}"):
            await opa.push(rego="package sparsegate.routing", data={})
    finally:
        opa.close()
        fake.close()


def _sample(name: str, **labels: str) -> float | None:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, labels)


async def test_calls_are_counted_timed_and_mark_opa_available_or_not() -> None:
    """`sparsegate_opa_available` follows the latest call (the chart's SparsegateOpaUnavailable
    alert reads it); results by kind, an undefined answer counted unavailable like a dead OPA,
    and an empty decide_many, which asks nothing, counts nothing."""
    def count(operation: str, result: str) -> float:
        return _sample("sparsegate_opa_requests_total", operation=operation, result=result) or 0.0

    timed = _sample("sparsegate_opa_request_duration_seconds_count", operation="check") or 0.0
    before = {k: count(*k) for k in [("check", "ok"), ("check", "unavailable"), ("flow_decisions", "unavailable"),
                                     ("decide_many", "ok"), ("push", "rejected")]}
    fake = _RecordingOpa(token="s3cret")
    opa = RoutingOpa(url=fake.url, token="s3cret", retries=0)
    dead = RoutingOpa(url=f"http://127.0.0.1:{_closed_port()}", timeout=0.5, retries=0)
    undefined = _RecordingOpa(token="s3cret", flow_body={})
    opa_undefined = RoutingOpa(url=undefined.url, token="s3cret", retries=0)
    try:
        await opa.check()
        assert _sample("sparsegate_opa_available") == 1.0
        with pytest.raises(OpaUnavailable):
            await dead.check()
        assert _sample("sparsegate_opa_available") == 0.0
        await opa.decide_many([{"source": {}, "target": {}}])
        assert _sample("sparsegate_opa_available") == 1.0
        with pytest.raises(OpaUnavailable):
            await opa_undefined.flow_decisions({"one": [], "classes": [], "models": [], "many": []})
        assert _sample("sparsegate_opa_available") == 0.0
        assert await dead.decide_many([]) == []  # no call: availability unchanged, nothing counted
        assert _sample("sparsegate_opa_available") == 0.0
    finally:
        for o in (opa, dead, opa_undefined):
            o.close()
        fake.close()
        undefined.close()
    assert count("check", "ok") - before[("check", "ok")] == 1
    assert count("check", "unavailable") - before[("check", "unavailable")] == 1
    assert count("flow_decisions", "unavailable") - before[("flow_decisions", "unavailable")] == 1
    assert count("decide_many", "ok") - before[("decide_many", "ok")] == 1
    assert (_sample("sparsegate_opa_request_duration_seconds_count", operation="check") or 0.0) - timed == 2


async def test_a_rejected_push_counts_rejected_and_opa_as_reached() -> None:
    fake = _RecordingOpa(token="s3cret", server_error=400)
    opa = RoutingOpa(url=fake.url, token="s3cret", retries=0)
    before = _sample("sparsegate_opa_requests_total", operation="push", result="rejected") or 0.0
    try:
        with pytest.raises(OpaRejected):
            await opa.push(rego="package sparsegate.routing", data={})
    finally:
        opa.close()
        fake.close()
    assert (_sample("sparsegate_opa_requests_total", operation="push", result="rejected") or 0.0) - before == 1
    assert _sample("sparsegate_opa_available") == 1.0
