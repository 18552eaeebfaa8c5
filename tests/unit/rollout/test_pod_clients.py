"""PodAdmin, the direct /metrics scrape and the load generator against a real model server.

One real ``python -m sparsegate_workload.server`` process on loopback ports (inference, and the
TLS admin listener with a certificate from the operator's own builder; starts in about a second);
nothing is mocked. The Prometheus provider's PromQL is checked as text here and
against a real Prometheus in tests/e2e/rollout/test_prometheus_provider.py.
"""

from __future__ import annotations

import asyncio

import dataclasses
import datetime
import time
from collections.abc import Iterator

import pytest
from admin_model_server import admin_model_server
from loadgen import LoadGen, check_loopback
from sparsegate_workload import gateparams

from sparsegate.clients.metrics_source import SCRAPED_SAMPLES, PrometheusAPI, group_from_snapshots, parse_pod_counters
from sparsegate.clients.admin_credentials import client_context
from sparsegate.clients.podadmin import AdminCredentials, PodAdmin, PodTarget
from sparsegate.domain import admin_tls
from sparsegate_contracts import names
from sparsegate_contracts.gate import version_matches_checksum as consistent
from localcluster.ports import free_port

TOKEN = "test-admin-token"
SERVER_NAME = names.admin_server_name(model="m", namespace="ns")
NOW = datetime.datetime.now(datetime.timezone.utc)


def credentials(cert_pem: str, *, token: str = TOKEN, server_name: str = SERVER_NAME) -> AdminCredentials:
    return AdminCredentials(token=token, server_name=server_name, ssl=client_context(cert_pem), source="test")


@pytest.fixture(scope="module")
def cert_pem(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return admin_tls.issue(server_name=SERVER_NAME, now=NOW)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, cert_pem: tuple[str, str]) -> Iterator[PodTarget]:
    d = tmp_path_factory.mktemp("admin")
    with admin_model_server(d, token=TOKEN, cert=cert_pem[0], key=cert_pem[1]) as (port, admin_port):
        yield PodTarget(name="pod-a", ip="127.0.0.1", port=port, admin_port=admin_port,
                        admin=credentials(cert_pem[0]))


def test_consistent_version_checksum() -> None:
    doc = gateparams.DEFAULT_DOCUMENT
    assert consistent(doc.version, doc.checksum)
    assert not consistent(doc.version, "sha256:" + "0" * 64)
    assert not consistent("g-", doc.checksum) and not consistent(None, doc.checksum)


async def test_health_push_and_verify(server: PodTarget, cert_pem: tuple[str, str]) -> None:
    admin = PodAdmin(timeout_s=5)
    health = (await admin.health([server]))["pod-a"]
    assert health.reachable and health.version == gateparams.DEFAULT_DOCUMENT.version
    new = gateparams.make_document({"toolGateThreshold": 0.7}).to_json()
    result = (await admin.push([(server, new)]))["pod-a"]
    assert result.ok, result.error
    assert (await admin.health([server]))["pod-a"].version == new["version"]
    # Wrong token: refused, version unchanged.
    bad = dataclasses.replace(server, admin=credentials(cert_pem[0], token="wrong"))
    back = gateparams.DEFAULT_DOCUMENT.to_json()
    refused = (await admin.push([(bad, back)]))["pod-a"]
    assert not refused.ok and "403" in refused.error
    assert (await admin.health([server]))["pod-a"].version == new["version"]
    assert (await admin.push([(server, back)]))["pod-a"].ok


async def test_a_server_without_the_models_key_never_gets_the_token(server: PodTarget,
                                                                   cert_pem: tuple[str, str]) -> None:
    """Credentials pinning another model's certificate (the server holds m's key, not other's):
    the handshake fails, so no request, no token, and the gate is unchanged."""
    other_name = names.admin_server_name(model="other", namespace="ns")
    other_cert, _ = admin_tls.issue(server_name=other_name, now=NOW)
    admin = PodAdmin(timeout_s=5)
    before = (await admin.health([server]))["pod-a"].version
    doc = gateparams.make_document({"toolGateThreshold": 0.71}).to_json()
    for creds in (credentials(other_cert, server_name=other_name),
                  credentials(cert_pem[0], server_name=other_name)):  # right cert, wrong name
        result = (await admin.push([(dataclasses.replace(server, admin=creds), doc)]))["pod-a"]
        assert not result.ok and result.certificate_refused, result
        assert "certificate is not" in result.error
    assert (await admin.health([server]))["pod-a"].version == before
    # Mid-rotation: current credentials refused by this pod's (older) certificate, the previous
    # ones accepted: the push lands, with the previous token, on the holder of the previous key.
    rotating = dataclasses.replace(server, admin=credentials(other_cert, server_name=other_name, token="new"),
                                   previous_admin=server.admin)
    assert (await admin.push([(rotating, doc)]))["pod-a"].ok
    assert (await admin.push([(server, gateparams.DEFAULT_DOCUMENT.to_json())]))["pod-a"].ok


async def test_a_document_the_pod_refuses_is_reported_as_refused_with_its_answer(server: PodTarget) -> None:
    """A gate document whose params no longer hash to its version and checksum (a status.stable
    edited by hand) is refused by the pod (422, the server's own message): the result carries the
    answer's code and message and reads ``refused`` (the rollout backs off and sets a condition
    from it); a pod that cannot be reached is not ``refused``."""
    admin = PodAdmin(timeout_s=5)
    before = (await admin.health([server]))["pod-a"].version
    doc = gateparams.make_document({"toolGateThreshold": 0.73}).to_json()
    doc["params"] = {"toolGateThreshold": 0.5}
    result = (await admin.push([(server, doc)]))["pod-a"]
    assert not result.ok and result.refused and result.status == 422, result
    assert result.detail is not None and result.detail.startswith("checksum mismatch"), result.detail
    assert (await admin.health([server]))["pod-a"].version == before
    gone = dataclasses.replace(server, admin_port=free_port())
    unreachable = (await admin.push([(gone, gateparams.DEFAULT_DOCUMENT.to_json())]))["pod-a"]
    assert not unreachable.ok and not unreachable.refused and unreachable.status is None


async def test_no_credentials_or_no_admin_port_sends_nothing(server: PodTarget) -> None:
    admin = PodAdmin(timeout_s=5)
    doc = gateparams.make_document({"toolGateThreshold": 0.72}).to_json()
    withheld = dataclasses.replace(server, admin=None, refusal="Secret of model m not found")
    result = (await admin.push([(withheld, doc)]))["pod-a"]
    assert not result.ok and "Secret of model m not found" in result.error
    old_pod = dataclasses.replace(server, admin_port=None)
    result = (await admin.push([(old_pod, doc)]))["pod-a"]
    assert not result.ok and "no admin port" in result.error
    assert (await admin.health([server]))["pod-a"].version != doc["version"]


async def test_unreachable_pod_is_reported_not_raised() -> None:
    dead = PodTarget(name="dead", ip="127.0.0.1", port=free_port(), admin_port=free_port(),
                     admin=credentials(admin_tls.issue(server_name=SERVER_NAME, now=NOW)[0]))
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
    at = time.time()
    full = (await admin.scrape([server]))["pod-a"]
    end = {"pod-a": parse_pod_counters(full, at=at)}
    # What the analysis asks for (name[]): only its samples, read into the same counters.
    narrow = (await admin.scrape([server], names=SCRAPED_SAMPLES))["pod-a"]
    assert len(narrow) < len(full) / 2 and "sparsegate_expert_cost" not in narrow
    assert parse_pod_counters(narrow, at=at) == end["pod-a"]
    costs = (await admin.scrape([server], names=["sparsegate_expert_cost"]))["pod-a"]
    assert "sparsegate_expert_cost{" in costs and "sparsegate_requests_total" not in costs
    g = group_from_snapshots(start=start, end=end, pods=["pod-a"])
    assert g is not None
    sent = sum(v for k, v in stats.items() if k.isdigit())
    assert g.requests == sent and g.errors == stats["503"]
    assert 0.2 < g.error_rate < 0.8  # 50 % injected, ~80 requests
    assert g.p99_ms is not None and g.p99_ms < 5000
    assert g.mean_active_experts is not None and 1.0 <= g.mean_active_experts <= 4.0
    # Every served request is one per-request observation of its experts (drift's noise).
    assert g.request_experts_count == sent - stats["503"]
    assert 1.0 <= g.request_experts_sum / g.request_experts_count <= 4.0
    assert g.experts_standard_error is not None and 0 <= g.experts_standard_error < 1


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
    # Drift's noise: the per-request spread of mean active experts, windowed like the rest.
    assert q["request_experts_squares"] == ('sum(increase(sparsegate_request_experts_per_token_squares_total'
                                            '{namespace="ns1",pod=~"m-a|m-b"}[30s]))')
    assert q["request_experts_count"].startswith("sum(increase(sparsegate_request_experts_per_token_count{")
    # A dot in a pod name is literal in the regex (PromQL string "a\\.b" is the regex a\.b).
    assert prom.selector(namespace="ns1", pods=["m.a"]) == 'namespace="ns1",pod=~"m\\\\.a"'
    with pytest.raises(ValueError):
        prom.selector(namespace="ns1", pods=['x"}) or vector(1'])


async def test_a_group_s_queries_are_evaluated_at_one_instant() -> None:
    """The group's ratios divide two queries' answers (errors / requests, assignments / tokens);
    increase() extrapolates by the samples in its window, so each query must see the same ones."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    seen: list[dict[str, str]] = []

    async def query(request: web.Request) -> web.Response:
        seen.append(dict(await request.post()))
        await asyncio.sleep(0.01)  # time passes between the queries, as it does against a real server
        return web.json_response({"status": "success", "data": {
            "resultType": "vector", "result": [{"metric": {}, "value": [0, "2"]}]}})

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    async with TestServer(app, host="127.0.0.1") as srv:
        group = await PrometheusAPI(f"http://127.0.0.1:{srv.port}").group(
            namespace="ns", pods=["m-a", "m-b"], window_s=30)
    assert group is not None and group.error_rate == 1.0
    assert len(seen) == len(PrometheusAPI("http://x").queries(namespace="ns", pods=["m-a"], window_s=30))
    assert len({q.get("time") for q in seen}) == 1 and seen[0].get("time") is not None


async def test_a_group_s_queries_are_asked_at_once_not_one_after_another() -> None:
    """A group is 13 queries, each under its own timeout: asked one after another, a Prometheus taking
    0.4 s a query (a loaded one) took 5.2 s a group (up to 13 x 5 s), which the builtin check waited
    for; at once, one query's time."""
    import time

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def query(request: web.Request) -> web.Response:
        await asyncio.sleep(0.4)
        return web.json_response({"status": "success", "data": {
            "resultType": "vector", "result": [{"metric": {}, "value": [0, "2"]}]}})

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    async with TestServer(app, host="127.0.0.1") as srv:
        started = time.monotonic()
        group = await PrometheusAPI(f"http://127.0.0.1:{srv.port}").group(
            namespace="ns", pods=["m-a", "m-b"], window_s=30)
        took = time.monotonic() - started
    assert group is not None and group.requests == 2.0
    assert took < 2.0, took


async def test_a_p99_beyond_the_largest_bucket_through_prometheus_is_never_within_the_sla() -> None:
    """histogram_quantile answers the largest finite bound (10 s) when the p99 lies in the +Inf
    bucket; the share of observations beyond that bucket tells the analysis it is a lower bound,
    so an SLA of 15 s is not met by a canary half of whose requests took longer than 10 s."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from sparsegate.domain.analysis import Verdict, analyse
    from sparsegate.domain.calibration import Thresholds

    beyond = {"share": "0.5"}

    async def query(request: web.Request) -> web.Response:
        q = (await request.post())["query"]
        value = ("10" if q.startswith("histogram_quantile(0.99,") else beyond["share"] if 'le="+Inf"' in q
                 else "100" if q.startswith("sum(increase(sparsegate_requests_total{") and "code=" not in q else "0")
        return web.json_response({"status": "success", "data": {
            "resultType": "vector", "result": [{"metric": {}, "value": [0, value]}]}})

    def verdict(g):
        thr = Thresholds(qps_threshold=1.0, error_rate_cap=0.02, baseline_qps=None, baseline_error_rate=None)
        return analyse(canary=g, stable=None, thresholds=thr, canary_share=1.0, sla_p99_ms=15_000.0,
                       max_drift=0.1, min_requests=20).verdict

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    async with TestServer(app, host="127.0.0.1") as srv:
        api = PrometheusAPI(f"http://127.0.0.1:{srv.port}")
        group = await api.group(namespace="ns", pods=["m-a"], window_s=30)
        assert group is not None and group.requests == 100 and group.p99_ms == 10_000
        assert verdict(group) == Verdict.FAIL
        beyond["share"] = "0.01"  # exactly 1 % beyond: the p99 is the bound itself, within the SLA
        group = await api.group(namespace="ns", pods=["m-a"], window_s=30)
        assert group is not None and verdict(group) == Verdict.PASS


async def test_a_nan_live_quality_sum_through_prometheus_is_no_quality_not_a_perfect_one() -> None:
    """A counter a broken server made NaN reads as no data (None): with the token count beside it,
    `or 0.0` made the canary's live mean NLL 0, a perfect score that passed qualityDrop."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def query(request: web.Request) -> web.Response:
        q = (await request.post())["query"]
        value = ("NaN" if "sparsegate_quality_nll" in q else "5000" if "sparsegate_quality_tokens" in q
                 else "100" if q.startswith("sum(increase(sparsegate_requests_total{") and "code=" not in q else "0")
        return web.json_response({"status": "success", "data": {
            "resultType": "vector", "result": [{"metric": {}, "value": [0, value]}]}})

    app = web.Application()
    app.router.add_post("/api/v1/query", query)
    async with TestServer(app, host="127.0.0.1") as srv:
        group = await PrometheusAPI(f"http://127.0.0.1:{srv.port}").group(namespace="ns", pods=["m-a"], window_s=30)
    assert group is not None and group.requests == 100
    assert group.live_mean_nll is None


async def test_oversized_or_odd_answers_are_pod_errors_not_operator_memory(
        tmp_path, cert_pem: tuple[str, str]) -> None:
    """A pod (or whatever holds its IP) answering megabytes or non-objects costs the operator a
    bounded read and an error for that pod, never an exception or an unbounded buffer. The admin
    answer comes over TLS with the model's certificate (it is a pod holding the model's key that
    misbehaves)."""
    import ssl

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
    admin_app = web.Application()
    admin_app.router.add_put("/admin/gate", answer(web.json_response([1, 2])))
    (tmp_path / "c").write_text(cert_pem[0])
    (tmp_path / "k").write_text(cert_pem[1])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "c", tmp_path / "k")
    admin_srv = TestServer(admin_app, host="127.0.0.1")
    await admin_srv.start_server(ssl=tls)
    try:
        async with TestServer(app, host="127.0.0.1") as srv:
            target = PodTarget(name="odd", ip="127.0.0.1", port=srv.port, admin_port=admin_srv.port,
                               admin=credentials(cert_pem[0]))
            health = (await PodAdmin().health([target]))["odd"]
            assert health.version is None and "exceeds" in health.error
            assert await PodAdmin().scrape([target]) == {}
            pushed = (await PodAdmin().push([(target, dict(gateparams.DEFAULT_DOCUMENT.to_json()))]))["odd"]
            assert not pushed.ok and not pushed.certificate_refused
            assert "answered version None" in pushed.error
    finally:
        await admin_srv.close()

    small = web.Application()
    small.router.add_get("/healthz", answer(web.json_response(["not", "an", "object"])))
    async with TestServer(small, host="127.0.0.1") as srv:
        target = PodTarget(name="odd", ip="127.0.0.1", port=srv.port)
        health = (await PodAdmin().health([target]))["odd"]
        assert health.version is None and "not an object" in health.error
