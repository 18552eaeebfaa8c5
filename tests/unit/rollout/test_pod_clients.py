"""PodAdmin, the direct /metrics scrape and the load generator against a real model server.

One real ``python -m sparsegate_workload.server`` process on a loopback port (starts in
about a second); nothing is mocked. The Prometheus provider's PromQL is checked as text here and
against a real Prometheus in tests/e2e/rollout/test_prometheus_provider.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from loadgen import LoadGen, check_loopback
from sparsegate_workload import gateparams

from sparsegate.clients.metrics_source import PrometheusAPI, group_from_snapshots, parse_pod_counters
from sparsegate.clients.podadmin import PodAdmin, PodTarget
from sparsegate_contracts.gate import version_matches_checksum as consistent
from localcluster.ports import free_port

TOKEN = "test-admin-token"



@pytest.fixture(scope="module")
def server() -> Iterator[PodTarget]:
    port = free_port()
    env = {**os.environ, "SPARSEGATE_ADMIN_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "sparsegate_workload.server", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"model server exited: {proc.stderr.read().decode()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "model server was not ready within 60 s"
            time.sleep(0.2)
        yield PodTarget(name="pod-a", ip="127.0.0.1", port=port, token=TOKEN)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_consistent_version_checksum() -> None:
    doc = gateparams.DEFAULT_DOCUMENT
    assert consistent(doc.version, doc.checksum)
    assert not consistent(doc.version, "sha256:" + "0" * 64)
    assert not consistent("g-", doc.checksum) and not consistent(None, doc.checksum)


async def test_health_push_and_verify(server: PodTarget) -> None:
    admin = PodAdmin(timeout_s=5)
    health = (await admin.health([server]))["pod-a"]
    assert health.reachable and health.version == gateparams.DEFAULT_DOCUMENT.version
    new = gateparams.make_document({"toolGateThreshold": 0.7}).to_json()
    result = (await admin.push([(server, new)]))["pod-a"]
    assert result.ok, result.error
    assert (await admin.health([server]))["pod-a"].version == new["version"]
    # Wrong token: refused, version unchanged.
    bad = PodTarget(name="pod-a", ip=server.ip, port=server.port, token="wrong")
    back = gateparams.DEFAULT_DOCUMENT.to_json()
    refused = (await admin.push([(bad, back)]))["pod-a"]
    assert not refused.ok and "403" in refused.error
    assert (await admin.health([server]))["pod-a"].version == new["version"]
    assert (await admin.push([(server, back)]))["pod-a"].ok


async def test_unreachable_pod_is_reported_not_raised() -> None:
    dead = PodTarget(name="dead", ip="127.0.0.1", port=free_port(), token=TOKEN)
    admin = PodAdmin(timeout_s=1)
    assert not (await admin.health([dead]))["dead"].reachable
    assert not (await admin.push([(dead, gateparams.DEFAULT_DOCUMENT.to_json())]))["dead"].ok
    assert await admin.scrape([dead]) == {}


async def test_scrape_window_counts_load_and_injected_errors(server: PodTarget) -> None:
    admin = PodAdmin(timeout_s=5)
    start = {n: parse_pod_counters(t, at=time.time()) for n, t in (await admin.scrape([server])).items()}
    faulty = gateparams.make_document({"faultInjection": {"errorRate": 0.5}}).to_json()
    assert (await admin.push([(server, faulty)]))["pod-a"].ok
    gen = LoadGen(targets=lambda: [f"{server.ip}:{server.port}"], qps=40)
    stats = await gen.run(duration_s=2.0)
    assert (await admin.push([(server, gateparams.DEFAULT_DOCUMENT.to_json())]))["pod-a"].ok
    end = {n: parse_pod_counters(t, at=time.time()) for n, t in (await admin.scrape([server])).items()}
    g = group_from_snapshots(start=start, end=end, pods=["pod-a"])
    assert g is not None
    sent = sum(v for k, v in stats.items() if k.isdigit())
    assert g.requests == sent and g.errors == stats["503"]
    assert 0.2 < g.error_rate < 0.8  # 50 % injected, ~80 requests
    assert g.p99_ms is not None and g.p99_ms < 5000
    assert g.mean_active_experts is not None and 1.0 <= g.mean_active_experts <= 4.0


def test_loadgen_refuses_non_loopback_targets() -> None:
    assert check_loopback("127.20.0.5:8080") == "127.20.0.5:8080"
    for bad in ("10.0.0.1:80", "example.com:80", "127.0.0.1"):
        with pytest.raises(ValueError):
            check_loopback(bad)


def test_prometheus_queries() -> None:
    prom = PrometheusAPI("http://127.0.0.1:9090/")
    q = prom.queries(namespace="ns1", pods=["m-b", "m-a"], window_s=29.2)
    assert q["requests"] == 'sum(increase(sparsegate_requests_total{namespace="ns1",pod=~"m-a|m-b"}[30s]))'
    assert 'code=~"5.."' in q["errors"] and q["p99"].startswith("histogram_quantile(0.99, sum by (le)")
    # A dot in a pod name is literal in the regex (PromQL string "a\\.b" is the regex a\.b).
    assert prom.selector(namespace="ns1", pods=["m.a"]) == 'namespace="ns1",pod=~"m\\\\.a"'
    with pytest.raises(ValueError):
        prom.selector(namespace="ns1", pods=['x"}) or vector(1'])


async def test_oversized_or_odd_answers_are_pod_errors_not_operator_memory() -> None:
    """A pod (or whatever holds its IP) answering megabytes or non-objects costs the operator a
    bounded read and an error for that pod, never an exception or an unbounded buffer."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from sparsegate.clients import podadmin

    def answer(response: web.Response):
        async def handler(_: web.Request) -> web.Response:
            return response
        return handler

    huge = b"x" * (podadmin.METRICS_BODY_LIMIT + 1)
    app = web.Application()
    app.router.add_get("/healthz", answer(web.Response(body=b"[" + b"1," * 40_000 + b"1]",
                                                        content_type="application/json")))
    app.router.add_get("/metrics", answer(web.Response(body=huge, content_type="text/plain")))
    app.router.add_put("/admin/gate", answer(web.json_response([1, 2])))
    async with TestServer(app, host="127.0.0.1") as srv:
        target = PodTarget(name="odd", ip="127.0.0.1", port=srv.port, token=TOKEN)
        health = (await PodAdmin().health([target]))["odd"]
        assert health.version is None and "exceeds" in health.error
        assert await PodAdmin().scrape([target]) == {}
        pushed = (await PodAdmin().push([(target, dict(gateparams.DEFAULT_DOCUMENT.to_json()))]))["odd"]
        assert not pushed.ok

    small = web.Application()
    small.router.add_get("/healthz", answer(web.json_response(["not", "an", "object"])))
    async with TestServer(small, host="127.0.0.1") as srv:
        target = PodTarget(name="odd", ip="127.0.0.1", port=srv.port, token=TOKEN)
        health = (await PodAdmin().health([target]))["odd"]
        assert health.version is None and "not an object" in health.error
