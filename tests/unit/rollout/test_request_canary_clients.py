"""The operator's clients under the request-level canary, against a real model server process:
PodAdmin pushes a stable + canary set over the TLS admin channel and reads its set key back from
/healthz; the direct scrape splits the same pod's requests by gate_version into the canary and
stable groups the builtin analysis compares. The PromQL of the Prometheus provider is checked as
text (and against a real Prometheus by tests/e2e/rollout/test_prometheus_provider.py)."""

from __future__ import annotations

import asyncio
import datetime
import time
import uuid
from collections.abc import Iterable, Iterator

import aiohttp
import pytest
from admin_model_server import admin_model_server
from sparsegate_contracts import names
from sparsegate_contracts.canary import routes_to_canary, set_key
from sparsegate_workload import gateparams

from sparsegate.clients.admin_credentials import client_context
from sparsegate.clients.analysis_providers import DirectScrape, MeasureRequest
from sparsegate.clients.metrics_source import PrometheusAPI
from sparsegate.clients.podadmin import AdminCredentials, PodAdmin, PodHealth, PodTarget
from sparsegate.controllers.rollout import Fleet, RolloutLoop
from sparsegate.domain import admin_tls
from sparsegate.domain.analysis_run import BUILTIN_CHECK
from sparsegate.domain.request_canary import step_target
from sparsegate.domain.rollout import GateVersion

TOKEN = "canary-clients-token"
SERVER_NAME = names.admin_server_name(model="m", namespace="ns")
STABLE = GateVersion.from_params(dict(gateparams.DEFAULT_PARAMS))
FAULTY = GateVersion.from_params({**gateparams.DEFAULT_PARAMS, "faultInjection": {"errorRate": 1.0}})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodTarget]:
    cert, key = admin_tls.issue(server_name=SERVER_NAME, now=datetime.datetime.now(datetime.timezone.utc))
    d = tmp_path_factory.mktemp("canary-admin")
    (d / "gate.json").write_text(gateparams.make_document(dict(STABLE.params)).file_text())
    with admin_model_server(d, token=TOKEN, cert=cert, key=key,
                            extra_args=("--gate-config", str(d / "gate.json"))) as (port, admin_port):
        creds = AdminCredentials(token=TOKEN, server_name=SERVER_NAME, ssl=client_context(cert), source="test")
        yield PodTarget(name="pod-a", ip="127.0.0.1", port=port, admin_port=admin_port, admin=creds)


async def test_push_set_then_scrape_splits_requests_by_version(server: PodTarget) -> None:
    admin = PodAdmin(timeout_s=5)
    target = step_target(stable=STABLE, canary=FAULTY, percent=20, sticky_header="x-session-id")
    result = (await admin.push([(server, target.document())]))["pod-a"]
    assert result.ok and result.version == set_key(STABLE.version, FAULTY.version, 0.2), result
    health = (await admin.health([server]))["pod-a"]
    assert health.version == STABLE.version and health.serving == target.version

    scrape = DirectScrape(admin)
    request = MeasureRequest(namespace="ns", now=time.time(), targets={"pod-a": server}, canary=["pod-a"],
                             stable=["pod-a"], analysing=True, window_key=(FAULTY.version, 0, 1.0),
                             canary_version=FAULTY.version, stable_version=STABLE.version)
    first = await scrape.measure(BUILTIN_CHECK, request)
    assert first.canary_metrics is None and first.window_from == request.now  # the window starts
    sessions = [f"s-{uuid.uuid4().hex}" for _ in range(150)]
    async with aiohttp.ClientSession() as session:
        async def one(sid: str) -> int:
            async with session.post(f"{server.base}/v1/infer", json={"tokens": [[1, 2, 3]]},
                                    headers={"x-session-id": sid}) as resp:
                return resp.status
        codes = await asyncio.gather(*(one(s) for s in sessions))
    on_canary = sum(routes_to_canary(s, 0.2) for s in sessions)
    assert codes.count(503) == on_canary > 0  # exactly the canary's requests failed
    window = await scrape.measure(BUILTIN_CHECK, MeasureRequest(**{**request.__dict__, "now": request.now + 5}))
    assert window.canary_metrics is not None and window.stable_metrics is not None
    assert window.canary_metrics.requests == on_canary and window.canary_metrics.error_rate == 1.0
    assert window.stable_metrics.requests == len(sessions) - on_canary and window.stable_metrics.errors == 0
    # Routing counters per version: the stable requests routed tokens, the failed canary ones none.
    assert window.stable_metrics.mean_active_experts is not None
    assert window.canary_metrics.mean_active_experts is None

    # Promotion pushes the canary alone; the pod then serves one version again.
    result = (await admin.push([(server, STABLE.document())]))["pod-a"]
    assert result.ok and (await admin.health([server]))["pod-a"].serving == STABLE.version


async def test_a_pod_keying_sessions_by_another_header_does_not_hold_the_set(server: PodTarget) -> None:
    # The same versions and weight, another sticky header: one session is routed otherwise, so the
    # pod must report a different set key (the operator then pushes it the spec's header).
    admin = PodAdmin(timeout_s=5)
    by_session = step_target(stable=STABLE, canary=FAULTY, percent=20, sticky_header="x-session-id")
    by_user = step_target(stable=STABLE, canary=FAULTY, percent=20, sticky_header="x-user")
    assert by_user.version != by_session.version
    for target in (by_session, by_user, by_session):
        result = (await admin.push([(server, target.document())]))["pod-a"]
        assert result.ok and result.version == target.version, result
        assert (await admin.health([server]))["pod-a"].serving == target.version
    result = (await admin.push([(server, STABLE.document())]))["pod-a"]
    assert result.ok and (await admin.health([server]))["pod-a"].serving == STABLE.version


async def test_the_tick_observes_which_pods_have_an_address() -> None:
    # A pod without an IP (Pending) has served nothing: it neither holds a request-level step nor a
    # rollback (domain.rollout); one with an IP that does not answer may hold the canary.
    class Health(PodAdmin):
        async def health(self, targets: Iterable[PodTarget]) -> dict[str, PodHealth]:
            return {t.name: PodHealth(name=t.name, version=None, error="timeout") if t.name == "silent"
                    else PodHealth(name=t.name, version=STABLE.version) for t in targets}

    loop = RolloutLoop(kube=None, admin=Health())  # type: ignore[arg-type]
    targets = {p: PodTarget(name=p, ip="10.0.0.1", port=8080) for p in ("ok", "silent")}
    pods = await loop._observe_pods(Fleet(targets=targets, all_pods=("ok", "pending", "silent")))
    assert [(p.name, p.reachable, p.addressed) for p in pods] == [
        ("ok", True, True), ("pending", False, False), ("silent", False, True)]


def test_prometheus_queries_select_the_serving_version() -> None:
    q = PrometheusAPI("http://prom:9090").queries(namespace="ns1", pods=["m-a", "m-b"], window_s=30,
                                                  gate_version="g-0123456789ab")
    assert q["requests"] == ('sum(increase(sparsegate_requests_total{namespace="ns1",pod=~"m-a|m-b",'
                             'gate_version="g-0123456789ab"}[30s]))')
    assert 'gate_version="g-0123456789ab"' in q["p99"] and 'gate_version="g-0123456789ab"' in q["tokens"]
    assert "gate_version" not in q["layers"]  # the per-expert series carry no version
    with pytest.raises(ValueError, match="unexpected characters"):
        PrometheusAPI("http://prom:9090").queries(namespace="ns1", pods=["m-a"], window_s=30, gate_version='x"}')


def test_the_tick_asks_the_providers_for_a_split_by_version_under_requests() -> None:
    from sparsegate.domain.request_canary import Strategy
    from sparsegate.domain.rollout import Phase, RolloutStatus
    from sparsegate.controllers.rollout import RolloutLoop, Fleet

    targets = {p: PodTarget(name=p, ip="127.0.0.1", port=1) for p in ("m-a", "m-b", "m-c")}
    fleet = Fleet(targets=targets, all_pods=tuple(targets))
    loop = RolloutLoop(kube=None)  # type: ignore[arg-type]  # _request reads no API
    status = RolloutStatus(phase=Phase.ANALYSING, stable=STABLE, canary=FAULTY, step=0, step_percent=5,
                           canary_pods=tuple(targets), strategy=Strategy.REQUESTS, analysis_started_at=5.0)
    req = loop._request(namespace="ns", fleet=fleet, status=status, now=10.0)
    assert list(req.canary) == list(req.stable) == ["m-a", "m-b", "m-c"]
    assert (req.canary_version, req.stable_version) == (FAULTY.version, STABLE.version)
    # Instances: split by pod, and each group still counts only its own version's requests (a canary
    # pod's stragglers of a rolled-back version are not the canary's).
    pods = loop._request(namespace="ns", fleet=fleet, status=RolloutStatus(
        phase=Phase.ANALYSING, stable=STABLE, canary=FAULTY, step=0, step_percent=5, canary_pods=("m-b",)), now=10.0)
    assert (list(pods.canary), sorted(pods.stable)) == (["m-b"], ["m-a", "m-c"])
    assert (pods.canary_version, pods.stable_version) == (FAULTY.version, STABLE.version)
