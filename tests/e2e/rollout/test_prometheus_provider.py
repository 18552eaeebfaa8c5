"""PrometheusAPI (the rollout analysis's Prometheus provider) against a real Prometheus server.

Three real model servers on loopback ports (``m-a``, ``m-b`` healthy, ``m-c`` with an injected
50 % error rate) are scraped every second by a real ``prometheus`` (built by
``dev/setup/binaries.sh prometheus``) whose static targets carry the ``namespace``/``pod`` labels
PrometheusAPI selects on. Bounded load runs between two direct ``/metrics`` snapshots; then
PrometheusAPI's windowed group metrics must agree with the direct-scrape provider's.

Why the counts are bounds, not equalities: both edges of the window are quiet (Prometheus has
caught up with the direct counters before the start snapshot and after the load), so the raw
counter delta Prometheus sees equals the direct one exactly; ``increase()`` then extrapolates
that delta from the first/last sample in the window out to the window's edges (at most ~1.1
scrape intervals per side). So Prometheus's count is ≥ the direct count and ≤ it times
window / (window − 2·1.1 intervals) (with a little slack for scrape jitter on a busy machine).
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from loadgen import LoadGen
from sparsegate_workload import gateparams

from localcluster.ports import free_port
from sparsegate.clients.admin_credentials import client_context
from sparsegate.clients.metrics_source import PrometheusAPI, group_from_snapshots, parse_pod_counters
from sparsegate.clients.podadmin import AdminCredentials, PodAdmin, PodTarget
from sparsegate.domain import admin_tls
from sparsegate.domain.analysis import GroupMetrics, PodCounters, window_delta
from sparsegate_contracts import names

TOKEN = "prom-test-admin-token"
SERVER_NAME = names.admin_server_name(model="prom", namespace="test")
NAMESPACE = "prom-e2e"
HEALTHY = ("m-a", "m-b")
FAULTY = ("m-c",)
SCRAPE_INTERVAL_S = 1.0
ERROR_RATE = 0.5
WARM_COUNT = 20  # errors and successes m-c has counted before the window (see the warm-up)
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _wait_http_ok(url: str, *, proc: subprocess.Popen[bytes], what: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"{what} exited {proc.returncode}: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{what} not ready within {timeout_s:.0f}s: {log.read_text()[-2000:]}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PodTarget]]:
    work = tmp_path_factory.mktemp("prom-servers")
    # The admin channel as in a pod: token and the model's certificate as files, TLS on its own port.
    cert_pem, key_pem = admin_tls.issue(server_name=SERVER_NAME, now=datetime.datetime.now(datetime.timezone.utc))
    for key, text in (("token", TOKEN), ("tls.crt", cert_pem), ("tls.key", key_pem)):
        (work / key).write_text(text)
    creds = AdminCredentials(token=TOKEN, server_name=SERVER_NAME, ssl=client_context(cert_pem), source="test")
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    targets: dict[str, PodTarget] = {}
    try:
        for name in (*HEALTHY, *FAULTY):  # all start at once; each imports torch (~seconds)
            port, admin_port, log = free_port(), free_port(), work / f"{name}.log"
            with log.open("wb") as out:
                procs[name] = (subprocess.Popen(
                    [sys.executable, "-m", "sparsegate_workload.server", "--host", "127.0.0.1",
                     "--port", str(port), "--admin-port", str(admin_port),
                     "--admin-token-file", str(work / "token"), "--admin-tls-cert", str(work / "tls.crt"),
                     "--admin-tls-key", str(work / "tls.key")], stdout=out, stderr=subprocess.STDOUT), log)
            targets[name] = PodTarget(name=name, ip="127.0.0.1", port=port, admin_port=admin_port, admin=creds)
        for name, (proc, log) in procs.items():
            _wait_http_ok(f"{targets[name].base}/readyz", proc=proc, what=f"model server {name}", log=log,
                          timeout_s=60)
        yield targets
    finally:
        for proc, _ in procs.values():
            _stop(proc)


@pytest.fixture(scope="module")
def prometheus(servers: dict[str, PodTarget], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = BIN / "prometheus"
    if not binary.is_file():
        pytest.fail(f"the real prometheus binary is required at {binary}; run: "
                    "source dev/env.sh && bash dev/setup/binaries.sh prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    # Static targets labelled the way kubernetes_sd relabelling would (what PrometheusAPI selects on).
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S:g}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S:g}s"},
        "scrape_configs": [{
            "job_name": "sparsegate-model",
            "static_configs": [{"targets": [f"{t.ip}:{t.port}"], "labels": {"namespace": NAMESPACE, "pod": name}}
                               for name, t in servers.items()],
        }],
    }
    (work / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
    port, log = free_port(), work / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(binary), f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http_ok(f"{url}/-/ready", proc=proc, what="prometheus", log=log, timeout_s=30)
        yield url
    finally:
        _stop(proc)


async def _instant(session: aiohttp.ClientSession, url: str, query: str) -> dict[str, float]:
    """An instant vector query → {pod label: value}."""
    async with session.get(f"{url}/api/v1/query", params={"query": query}) as resp:
        body = await resp.json()
    assert body["status"] == "success", body
    return {r["metric"].get("pod", ""): float(r["value"][1]) for r in body["data"]["result"]}


async def _snapshot(admin: PodAdmin, servers: dict[str, PodTarget]) -> dict[str, PodCounters]:
    texts = await admin.scrape(servers.values())
    assert set(texts) == set(servers), f"unreachable: {set(servers) - set(texts)}"
    now = time.time()
    return {name: parse_pod_counters(text, at=now) for name, text in texts.items()}


async def _caught_up(url: str, admin: PodAdmin, servers: dict[str, PodTarget], *, timeout_s: float = 15) -> None:
    """Wait until Prometheus's latest samples equal every server's current counters (all quiet)."""
    sel = f'{{namespace="{NAMESPACE}"}}'
    errors_sel = f'{{namespace="{NAMESPACE}",code=~"5.."}}'
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            direct = await _snapshot(admin, servers)
            prom_req = await _instant(session, url, f"sum by (pod) (sparsegate_requests_total{sel})")
            # A server's error series exist at 0 before its first error (ServerMetrics.serving).
            prom_err = {pod: v for pod, v in (await _instant(
                session, url, f"sum by (pod) (sparsegate_requests_total{errors_sel})")).items() if v}
            want_req = {n: c.requests for n, c in direct.items()}
            want_err = {n: c.errors for n, c in direct.items() if c.errors}
            if prom_req == want_req and prom_err == want_err:
                return
            assert time.monotonic() < deadline, (
                f"prometheus did not catch up: prometheus {prom_req} / {prom_err}, direct {want_req} / {want_err}")
            await asyncio.sleep(0.5)


def _weighted_bounds(deltas: list[PodCounters], *, bound: float) -> tuple[float, float]:
    """The least and greatest Σ fᵢ·sumᵢ / Σ fᵢ·countᵢ over extrapolation factors fᵢ in [1, bound]
    (a ratio of sums is monotone in each fᵢ, so the extremes are at corners)."""
    means = []
    for corner in itertools.product((1.0, bound), repeat=len(deltas)):
        num = sum(f * c.experts_sum for f, c in zip(corner, deltas))
        den = sum(f * c.experts_count for f, c in zip(corner, deltas))
        means.append(num / den)
    return min(means), max(means)


def _check_count(*, what: str, prom: float, direct: float, bound: float) -> None:
    assert direct - 1e-6 <= prom <= direct * bound + 1e-6, (
        f"{what}: prometheus {prom:.3f} vs direct {direct:.0f} (allowed up to ×{bound:.3f})")


async def test_prometheus_group_metrics_agree_with_direct_scrape(
        servers: dict[str, PodTarget], prometheus: str) -> None:
    admin = PodAdmin(timeout_s=5)
    faulty_doc = gateparams.make_document({"faultInjection": {"errorRate": ERROR_RATE}}).to_json()
    pushed = await admin.push([(servers[n], faulty_doc) for n in FAULTY])
    assert all(r.ok for r in pushed.values()), pushed
    everyone = lambda: [f"{t.ip}:{t.port}" for t in servers.values()]  # noqa: E731

    # Warm-up: every series the window needs (incl. m-c's code="503") exists before the window,
    # so increase() sees it from a sample inside the window rather than from its first value; and
    # each of m-c's series already counts WARM_COUNT, so that increase() extrapolates both by the
    # same factor and the error rate is not skewed. Prometheus stops a counter's extrapolation
    # toward the window start where the counter would reach zero (sampled interval × first value /
    # increase): with the 503 series warmed by a single error that cut shortened the errors'
    # extrapolation only (CI: error rate off by 0.024). Here first / increase ≥ 20/~60 leaves it
    # beyond the at most ~1.1 intervals / ~6 s sampled that extrapolation covers.
    deadline = time.monotonic() + 30
    while not all(min(c.errors, c.requests - c.errors) >= WARM_COUNT
                  for n, c in (await _snapshot(admin, servers)).items() if n in FAULTY):
        assert time.monotonic() < deadline, f"fewer than {WARM_COUNT} errors and successes on the faulty server"
        await LoadGen(targets=everyone, qps=30).run(duration_s=0.5)
    await _caught_up(prometheus, admin, servers)
    await asyncio.sleep(1.5 * SCRAPE_INTERVAL_S)  # samples just before the window start are quiet too

    start = await _snapshot(admin, servers)
    t0 = time.time()
    await asyncio.sleep(SCRAPE_INTERVAL_S)
    gen = LoadGen(targets=everyone, qps=45, seed=7)
    stats = await gen.run(duration_s=6.0)
    await _caught_up(prometheus, admin, servers)
    await asyncio.sleep(1.5 * SCRAPE_INTERVAL_S)
    end = await _snapshot(admin, servers)

    window_s = time.time() - t0 + 0.5  # covers the whole load, edges quiet (see module docstring)
    prom = PrometheusAPI(prometheus)
    prom_healthy = await prom.group(namespace=NAMESPACE, pods=list(HEALTHY), window_s=window_s)
    prom_faulty = await prom.group(namespace=NAMESPACE, pods=list(FAULTY), window_s=window_s)
    direct_healthy = group_from_snapshots(start=start, end=end, pods=HEALTHY)
    direct_faulty = group_from_snapshots(start=start, end=end, pods=FAULTY)
    assert prom_healthy and prom_faulty and direct_healthy and direct_faulty
    sys.stderr.write(f"\n[prom] load {dict(stats)} window {window_s:.1f}s\n")
    for label, p, d in (("healthy", prom_healthy, direct_healthy), ("faulty", prom_faulty, direct_faulty)):
        sys.stderr.write(f"[prom] {label}: prometheus req={p.requests:.2f} err={p.errors:.2f} p99={p.p99_ms}ms "
                         f"experts={p.mean_active_experts} | direct req={d.requests:.0f} err={d.errors:.0f} "
                         f"p99={d.p99_ms}ms experts={d.mean_active_experts}\n")

    sent = sum(v for k, v in stats.items() if k.isdigit())
    assert direct_healthy.requests + direct_faulty.requests == sent > 50
    window = max(1, math.ceil(window_s))  # what PrometheusAPI asks for
    bound = window / (window - 2 * 1.1 * SCRAPE_INTERVAL_S - 0.5)
    _check_count(what="healthy requests", prom=prom_healthy.requests, direct=direct_healthy.requests, bound=bound)
    _check_count(what="faulty requests", prom=prom_faulty.requests, direct=direct_faulty.requests, bound=bound)
    _check_count(what="faulty errors", prom=prom_faulty.errors, direct=direct_faulty.errors, bound=bound)

    # Errors: only where injected, at the injected rate (one target: both series share scrape times,
    # so extrapolation scales requests and errors alike and the rates agree closely).
    assert direct_healthy.errors == 0 and prom_healthy.errors == 0 and prom_healthy.error_rate == 0
    assert direct_faulty.error_rate is not None and prom_faulty.error_rate is not None
    assert 0.25 < direct_faulty.error_rate < 0.75
    assert abs(prom_faulty.error_rate - direct_faulty.error_rate) < 0.02

    # p99 from histogram_quantile over the same buckets: finite, plausible, close to the direct one.
    for p, d in ((prom_healthy, direct_healthy), (prom_faulty, direct_faulty)):
        assert p.p99_ms is not None and d.p99_ms is not None and math.isfinite(p.p99_ms)
        assert 0 < p.p99_ms < 5000 and 0.5 < p.p99_ms / d.p99_ms < 2.0
    # Mean active experts: ratio of two counters summed over the group's targets; the default gate
    # routes 1..4. Both queries are evaluated at one instant (PrometheusAPI pins it), so increase()
    # scales a target's two counters by that target's own extrapolation factor (its scrape times):
    # one target's ratio is exact, and a group's is its targets' ratios weighted by tokens x factor,
    # within what factors in [1, bound] can make of them.
    for pods, p, d in ((HEALTHY, prom_healthy, direct_healthy), (FAULTY, prom_faulty, direct_faulty)):
        assert p.mean_active_experts is not None and d.mean_active_experts is not None
        assert 1.0 <= p.mean_active_experts <= 4.0
        low, high = _weighted_bounds([window_delta(start=start[n], end=end[n]) for n in pods], bound=bound)
        sys.stderr.write(f"[prom] experts of {pods}: prometheus {p.mean_active_experts:.4f}, "
                         f"extrapolation bounds [{low:.4f}, {high:.4f}]\n")
        assert low - 1e-9 <= p.mean_active_experts <= high + 1e-9
    # Its noise (drift's standard error): per-request spread from the same counters on both sides.
    for p, d in ((prom_healthy, direct_healthy), (prom_faulty, direct_faulty)):
        assert d.request_experts_count > 10 and d.experts_standard_error is not None
        assert p.experts_standard_error is not None
        _check_count(what="per-request expert observations", prom=p.request_experts_count,
                     direct=d.request_experts_count, bound=bound)
        assert 0 < d.experts_standard_error < 1 and 0.5 < p.experts_standard_error / d.experts_standard_error < 2

    # A group with no such pods answers None, like the direct provider.
    assert await prom.group(namespace=NAMESPACE, pods=["m-none"], window_s=window_s) is None
    assert group_from_snapshots(start=start, end=end, pods=["m-none"]) is None
    assert isinstance(prom_healthy, GroupMetrics) and prom_healthy.pods == len(HEALTHY)


# ---------------------------------------------------------------- declared checks (PrometheusQuery)

ERROR_RATIO = ('(sum(increase(sparsegate_requests_total{namespace="{{args.namespace}}",pod=~"{{args.canaryPods}}",'
               'code=~"5.."}[{{args.window}}])) or vector(0)) / sum(increase(sparsegate_requests_total{'
               'namespace="{{args.namespace}}",pod=~"{{args.canaryPods}}"}[{{args.window}}]))')


def _query_check(query: str, *, address: str | None = None, **fields: object):
    from sparsegate.domain.analysis_run import parse_checks

    provider = {"query": query, **({"address": address} if address else {})}
    (check,) = parse_checks({"checks": [{"name": "q", "provider": {"prometheus": provider},
                                         "successCondition": "result < 0.05", **fields}]})
    return check


def _args(canary: list[str], window_s: float) -> dict[str, str]:
    from sparsegate.domain.analysis_run import measure_args

    return measure_args(namespace=NAMESPACE, gate_config="gate", models=["prom"], canary_pods=canary,
                        stable_pods=[n for n in (*HEALTHY, *FAULTY) if n not in canary], canary_version="g-new",
                        stable_version="g-old", step=1, percent=5, window_s=window_s)


async def test_declared_prometheus_query_check(servers: dict[str, PodTarget], prometheus: str) -> None:
    """A declared ``prometheus`` check's query, placeholders filled, answers the error ratio of the
    'canary' pods from the real Prometheus; the conditions judge it; bad queries are errors."""
    from sparsegate.clients.analysis_providers import MeasureRequest, PrometheusQuery, measure_safely
    from sparsegate.domain.analysis_run import MeasurementPhase, judge

    admin = PodAdmin(timeout_s=5)
    faulty_doc = gateparams.make_document({"faultInjection": {"errorRate": ERROR_RATE}}).to_json()
    assert all(r.ok for r in (await admin.push([(servers[n], faulty_doc) for n in FAULTY])).values())
    everyone = lambda: [f"{t.ip}:{t.port}" for t in servers.values()]  # noqa: E731
    await LoadGen(targets=everyone, qps=40, seed=3).run(duration_s=4.0)
    await _caught_up(prometheus, admin, servers)

    provider = PrometheusQuery(default_address=prometheus)
    window = 30.0

    async def measure(query: str, canary: list[str], **kw: object):
        check = _query_check(query, **kw)
        request = MeasureRequest(namespace=NAMESPACE, now=time.time(), args=_args(canary, window))
        return check, await measure_safely(provider, check, request)

    check, bad = await measure(ERROR_RATIO, list(FAULTY))
    check_ok, good = await measure(ERROR_RATIO, list(HEALTHY))
    sys.stderr.write(f"\n[prom] declared error ratio: faulty {bad.value} healthy {good.value}\n")
    assert bad.error is None and 0.25 < bad.value < 0.75
    assert good.error is None and good.value == 0.0
    assert judge(check, bad, now=time.time()).phase == MeasurementPhase.FAILED
    assert judge(check_ok, good, now=time.time()).phase == MeasurementPhase.SUCCESSFUL

    _, scalar = await measure("scalar(vector(3)) + 0 * {{args.step}}", list(FAULTY))
    assert scalar.value == 3.0
    _, empty = await measure('sum(sparsegate_requests_total{namespace="{{args.namespace}}",pod="absent"})',
                             list(FAULTY))
    assert empty.value is None and empty.error is None  # no data: judged inconclusive
    _, many = await measure('sum by (pod) (sparsegate_requests_total{namespace="{{args.namespace}}"})', list(FAULTY))
    assert many.error is not None and "3 series" in many.error
    _, broken = await measure("sum(", list(FAULTY))
    assert broken.error is not None and "bad_data" in broken.error
    # The check's own address wins over the operator's; none at all is an error, not a crash.
    _, own = await measure("scalar(vector(1))", list(FAULTY), address=prometheus)
    assert own.value == 1.0
    nowhere = await measure_safely(PrometheusQuery(default_address=None), _query_check("vector(1)"),
                                   MeasureRequest(namespace=NAMESPACE, now=time.time()))
    assert nowhere.error is not None and "no Prometheus address" in nowhere.error


async def test_direct_scrape_window_restarts_with_a_new_process(servers: dict[str, PodTarget]) -> None:
    """The builtin direct scrape owns its window: a new provider (an operator restart) has no start
    snapshot, so it begins a new window and says where (window_from), with no data until its next scrape."""
    from sparsegate.clients.analysis_providers import DirectScrape, MeasureRequest
    from sparsegate.domain.analysis_run import BUILTIN_CHECK

    key = ("g-new", 0, 1000.0)

    def request(now: float) -> MeasureRequest:
        return MeasureRequest(namespace=NAMESPACE, now=now, targets=servers, canary=list(FAULTY),
                              stable=list(HEALTHY), analysing=True, window_key=key, analysis_started_at=1000.0)

    everyone = lambda: [f"{t.ip}:{t.port}" for t in servers.values()]  # noqa: E731
    first = DirectScrape(PodAdmin(timeout_s=5))
    t0 = time.time()
    start = await first.measure(BUILTIN_CHECK, request(t0))
    assert start.window_from == t0 and start.canary_metrics is None
    await LoadGen(targets=everyone, qps=30, seed=5).run(duration_s=1.0)
    later = await first.measure(BUILTIN_CHECK, request(time.time()))
    assert later.window_from == t0 and later.canary_metrics is not None and later.canary_metrics.requests > 0
    restarted = DirectScrape(PodAdmin(timeout_s=5))
    t1 = time.time()
    fresh = await restarted.measure(BUILTIN_CHECK, request(t1))
    assert fresh.window_from == t1 > t0 and fresh.canary_metrics is None


# ---------------------------------------------------------------- request-level canary (split by gate_version)


async def test_request_level_canary_groups_split_by_gate_version(
        servers: dict[str, PodTarget], prometheus: str) -> None:
    """One server holding its stable version and a canary that fails every request, at weight 0.5
    (strategy requests): PrometheusAPI's groups for each ``gate_version`` of the same pod agree with
    the direct scrape's split — the canary's requests all errors, the stable's none."""
    from sparsegate_contracts.canary import gate_set_document

    admin = PodAdmin(timeout_s=5)
    name, target = "m-a", servers["m-a"]
    health = (await admin.health([target]))[name]
    stable = {"version": health.version, "checksum": health.checksum,
              "params": dict(gateparams.DEFAULT_PARAMS)}
    assert stable["version"] == gateparams.DEFAULT_DOCUMENT.version, health  # m-a serves the default gate
    canary = gateparams.make_document({"faultInjection": {"errorRate": 1.0}})
    assert (await admin.push([(target, gate_set_document(stable, canary.to_json(), weight=0.5))]))[name].ok
    only_a = lambda: [f"{target.ip}:{target.port}"]  # noqa: E731

    async def snapshot(version: str) -> PodCounters:
        text = (await admin.scrape([target]))[name]
        return parse_pod_counters(text, at=time.time(), gate_version=version)

    try:
        deadline = time.monotonic() + 15  # warm-up: both versions' series exist before the window
        while (await snapshot(canary.version)).errors == 0 or (await snapshot(stable["version"])).requests == 0:
            assert time.monotonic() < deadline, "no requests of both versions during warm-up"
            await LoadGen(targets=only_a, qps=30).run(duration_s=0.5)
        await _caught_up(prometheus, admin, servers)
        await asyncio.sleep(1.5 * SCRAPE_INTERVAL_S)
        start = {v: await snapshot(v) for v in (canary.version, stable["version"])}
        t0 = time.time()
        await asyncio.sleep(SCRAPE_INTERVAL_S)
        await LoadGen(targets=only_a, qps=40, seed=11).run(duration_s=5.0)
        await _caught_up(prometheus, admin, servers)
        await asyncio.sleep(1.5 * SCRAPE_INTERVAL_S)
        end = {v: await snapshot(v) for v in (canary.version, stable["version"])}
        window_s = time.time() - t0 + 0.5
        prom = PrometheusAPI(prometheus)
        window = max(1, math.ceil(window_s))
        bound = window / (window - 2 * 1.1 * SCRAPE_INTERVAL_S - 0.5)
        groups = {}
        for v in (canary.version, stable["version"]):
            p = await prom.group(namespace=NAMESPACE, pods=[name], window_s=window_s, gate_version=v)
            d = group_from_snapshots(start={name: start[v]}, end={name: end[v]}, pods=[name])
            assert p is not None and d is not None and d.requests > 20, (v, p, d)
            _check_count(what=f"{v} requests", prom=p.requests, direct=d.requests, bound=bound)
            groups[v] = (p, d)
            sys.stderr.write(f"[prom] {v}: prometheus req={p.requests:.2f} err={p.errors:.2f} | "
                             f"direct req={d.requests:.0f} err={d.errors:.0f}\n")
        (pc, dc), (ps, ds) = groups[canary.version], groups[stable["version"]]
        # increase() extrapolates the error and request counters separately: equal to a hair.
        assert dc.error_rate == 1.0 and pc.error_rate is not None and abs(pc.error_rate - 1.0) < 1e-3
        assert ds.errors == 0 and ps.errors == 0
        assert ps.mean_active_experts is not None and 1.0 <= ps.mean_active_experts <= 4.0
    finally:
        assert (await admin.push([(target, stable)]))[name].ok


async def test_a_canary_s_first_few_errors_in_the_window_are_all_counted(
        servers: dict[str, PodTarget], prometheus: str) -> None:
    """A version's request series exist at 0 from the moment it starts serving
    (``ServerMetrics.serving``), so ``increase()`` over a step's window counts a new canary's very
    first requests and errors. A series born inside the window is counted from its first sample:
    a short burst of errors that one scrape sees whole would leave every sample equal and count 0."""
    from sparsegate_contracts.canary import gate_set_document

    admin, target = PodAdmin(timeout_s=5), servers["m-a"]
    stable = gateparams.make_document({}).to_json()
    # A version no server has served yet (the request-canary test above served errorRate 1.0).
    canary = gateparams.make_document({"faultInjection": {"errorRate": 1.0, "addedLatencyMs": 1}}).to_json()
    pushed = await admin.push([(target, gate_set_document(stable, canary, weight=0.5))])
    assert all(r.ok for r in pushed.values()), pushed
    try:
        born = (f'sparsegate_requests_total{{namespace="{NAMESPACE}",pod="m-a",'
                f'gate_version="{canary["version"]}",code="503"}}')
        deadline = time.monotonic() + 15
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while (await _instant(session, prometheus, born)) != {"m-a": 0.0}:
                assert time.monotonic() < deadline, (
                    "the canary's 503 series was not scraped at 0 before its first error: "
                    + "\n".join(line for line in (await admin.scrape([target]))["m-a"].splitlines()
                                 if line.startswith("sparsegate_requests_total")))
                await asyncio.sleep(0.2)
        await asyncio.sleep(1.5 * SCRAPE_INTERVAL_S)

        t0 = time.time()
        await asyncio.sleep(SCRAPE_INTERVAL_S)
        # A burst shorter than a scrape interval, then quiet: the canary's first and only errors.
        stats = await LoadGen(targets=lambda: [f"{target.ip}:{target.port}"], qps=40, seed=11).run(duration_s=0.3)
        await _caught_up(prometheus, admin, servers)
        await asyncio.sleep(1.5 * SCRAPE_INTERVAL_S)
        window_s = time.time() - t0 + 0.5
        prom = await PrometheusAPI(prometheus).group(namespace=NAMESPACE, pods=["m-a"], window_s=window_s,
                                                     gate_version=canary["version"])
        sys.stderr.write(f"\n[prom] canary: load {dict(stats)}, prometheus req={prom and prom.requests} "
                         f"err={prom and prom.errors}\n")
        served_by_canary = stats.get("503", 0)  # every canary request fails; the stable's succeed
        assert served_by_canary >= 2, stats
        # ≈1: increase() extrapolates the two sums separately (error_rate clamps at 1).
        assert prom is not None and prom.error_rate is not None and abs(prom.error_rate - 1.0) < 0.01
        window = max(1, math.ceil(window_s))
        bound = window / (window - 2 * 1.1 * SCRAPE_INTERVAL_S - 0.5)
        _check_count(what="canary errors", prom=prom.errors, direct=served_by_canary, bound=bound)
        _check_count(what="canary requests", prom=prom.requests, direct=served_by_canary, bound=bound)
    finally:
        assert all(r.ok for r in (await admin.push([(target, stable)])).values())
