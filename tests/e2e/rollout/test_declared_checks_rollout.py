"""Declared analysis checks end to end: a Prometheus query and a web check decide a live rollout.

Given the rollout stack of conftest.py (the operator in-cluster from its image, host network), a
fleet of 3 real model-server containers under load, a real ``prometheus`` (built by
``dev/setup/binaries.sh prometheus``) scraping every pod's ``/metrics`` at its pod IP with
``namespace``/``pod`` labels, and a tiny HTTP "judge" this test runs on loopback (its score is set
by the test), when the GateConfig declares:

- ``error-ratio``: a ``prometheus`` query of the canary pods' 5xx share (``{{args.canaryPods}}``,
  ``{{args.window}}``), success ``result < 0.05``, 2 measurements;
- ``quality``: a ``web`` GET of the judge (``{{args.canaryVersion}}`` in the URL), success
  ``result >= 0.9``, failure ``result < 0.5`` (in between: inconclusive);
- ``shadow``: a dry-run ``web`` check whose answer always fails it;

then a good version is promoted step by step with a Successful AnalysisRun per step (the failing
dry-run check recorded, not deciding); a version with injected errors is rolled back because
``error-ratio`` failed; a judge score between the two conditions pauses the rollout as
inconclusive (a condition says why) until it is aborted. ``kubectl sparsegate status`` shows the
AnalysisRun. The tests share one fleet and run in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from devstack import Stack
from loadgen import BackgroundLoad
from localcluster.health import wait_for
from localcluster.ports import free_port

from rollout_e2e_support import BASE_PARAMS, GATE, MODEL, NAMESPACE, Fleet, Operator

pytestmark = pytest.mark.slow

REPLICAS = 3  # step 30 % → 1 canary pod, 100 % → 3
QPS = 30.0
SCRAPE_INTERVAL_S = 1.0
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))
ERROR_RATIO = ('(sum(increase(sparsegate_requests_total{namespace="{{args.namespace}}",pod=~"{{args.canaryPods}}",'
               'code=~"5.."}[{{args.window}}])) or vector(0)) / sum(increase(sparsegate_requests_total{'
               'namespace="{{args.namespace}}",pod=~"{{args.canaryPods}}"}[{{args.window}}]))')


class Judge:
    """The web check's target: answers {"score": <score>} on /score and a failing 0.1 on /shadow,
    and records the versions asked about."""

    def __init__(self) -> None:
        self.score = 0.95
        self.asked: list[str] = []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlparse(self.path)
                judge.asked.append(parse_qs(url.query).get("version", [""])[0])
                body = json.dumps({"data": {"score": judge.score if url.path == "/score" else 0.1}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="judge", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def checks(*, prometheus: str, judge: Judge) -> list[dict]:
    web = "{{args.canaryVersion}}"
    return [
        {"name": "error-ratio", "provider": {"prometheus": {"address": prometheus, "query": ERROR_RATIO}},
         "successCondition": "result < 0.05", "count": 2, "interval": "4s"},
        {"name": "quality", "provider": {"web": {"url": f"{judge.url}/score?version={web}",
                                                  "jsonPath": "$.data.score", "timeout": "2s"}},
         "successCondition": "result >= 0.9", "failureCondition": "result < 0.5", "interval": "4s"},
        {"name": "shadow", "provider": {"web": {"url": f"{judge.url}/shadow?version={web}",
                                                 "jsonPath": "$.data.score"}},
         "successCondition": "result >= 0.9", "interval": "4s", "dryRun": True},
    ]


def _start_prometheus(work: Path, targets: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    binary = BIN / "prometheus"
    if not binary.is_file():
        pytest.fail(f"the real prometheus binary is required at {binary}; run: "
                    "source dev/env.sh && bash dev/setup/binaries.sh prometheus")
    config = {"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S:g}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S:g}s"},
              "scrape_configs": [{"job_name": "sparsegate-model", "static_configs": [
                  {"targets": [address], "labels": {"namespace": NAMESPACE, "pod": pod}}
                  for pod, address in sorted(targets.items())]}]}
    (work / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
    port, log = free_port(), work / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(binary), f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, f"prometheus exited {proc.returncode}: {log.read_text()[-2000:]}"
        query = "count(up{job=\"sparsegate-model\"} == 1)"
        try:
            import urllib.parse
            import urllib.request
            with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': query})}",
                                        timeout=2) as resp:
                result = json.loads(resp.read())["data"]["result"]
            return bool(result) and int(float(result[0]["value"][1])) == len(targets)
        except OSError:
            return False

    wait_for(up, what="prometheus scraping every model pod", timeout_s=60, interval_s=0.5)
    return proc, url


@pytest.fixture(scope="module")
def setup(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Judge, str]]:
    ns = NAMESPACE
    wait_for(lambda: stack.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
             what="default ServiceAccount", timeout_s=60, interval_s=0.5)
    judge = Judge()
    model = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "metadata": {"name": MODEL},
             "spec": {"replicas": REPLICAS, "gateConfigRef": {"name": GATE},
                      "model": {"dModel": 128, "experts": 4, "maxExpertsPerToken": 2}}}
    # The checks need Prometheus' address, which needs the pods' IPs: the GateConfig starts with
    # the builtin check and gets the declared ones once Prometheus scrapes the pods.
    gateconfig = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig", "metadata": {"name": GATE},
                  "spec": {"params": BASE_PARAMS, "rollout": {"strategy": "instances", "steps": [30, 100], "analysisInterval": "4s",
                                                              "autoRollback": True}}}
    op = Operator(stack=stack)
    op.expected_restarts = op.restart_count()
    f = Fleet(stack=stack, namespace=ns, operator=op)
    stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                  "items": [gateconfig, model]}))
    prom: subprocess.Popen[bytes] | None = None
    try:
        f.wait_serving(REPLICAS, f"{REPLICAS} model servers Ready")
        f.check_pods_are_ours()
        f.watch("the GateConfig to be initialised", lambda ro: ro.get("phase") == "Succeeded", timeout=60)
        targets = {p["metadata"]["name"]: f"{p['status']['podIP']}:8080" for p in f.pods()}
        prom, prom_url = _start_prometheus(tmp_path_factory.mktemp("checks-prometheus"), targets)
        f.cluster.kubectl("patch", "gateconfig", GATE, "-n", ns, "--type=merge", "-p", json.dumps(
            {"spec": {"rollout": {"analysis": {"checks": checks(prometheus=prom_url, judge=judge)}}}}))
        f.load = BackgroundLoad(f.targets, qps=QPS).start()
        time.sleep(3)  # every pod's request series exists in Prometheus before the first window
        yield f, judge, prom_url
    finally:
        if f.load is not None:
            f.load.stop()
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=10)
        judge.close()
        sys.stderr.write(f"[e2e] checks operator log tail:\n{op.tail(60)}\n")


def runs(fleet: Fleet) -> list[dict]:
    return fleet.gateconfig()["status"].get("analysisRuns") or []


def by_name(run: dict) -> dict[str, dict]:
    return {c["name"]: c for c in run["checks"]}


def test_good_version_promoted_with_an_analysis_run_per_step(setup: tuple[Fleet, Judge, str]) -> None:
    fleet, judge, _ = setup
    judge.score = 0.95
    new = fleet.set_params(toolGateThreshold=0.8)
    fleet.watch("promotion", lambda ro: ro.get("phase") == "Succeeded" and ro.get("reason") == "Promoted"
                and fleet.stable_version() == new, timeout=180)
    mine = [r for r in runs(fleet) if r["canaryVersion"] == new]
    assert [r["step"] for r in mine] == [1, 2] and all(r["phase"] == "Successful" for r in mine), mine
    for run in mine:
        checks_ = by_name(run)
        ratio = checks_["error-ratio"]
        assert ratio["provider"] == "prometheus" and ratio["phase"] == "Successful" and ratio["successful"] == 2
        assert all(m["phase"] == "Successful" and 0 <= m["value"] < 0.05 for m in ratio["measurements"])
        assert checks_["quality"]["phase"] == "Successful" and checks_["quality"]["measurements"][-1]["value"] == 0.95
        # The dry-run check failed every time and decided nothing.
        shadow = checks_["shadow"]
        assert shadow["dryRun"] is True and shadow["phase"] == "Failed" and shadow["measurements"][-1]["value"] == 0.1
    assert new in judge.asked  # {{args.canaryVersion}} reached the web check
    assert set(fleet.pod_versions().values()) == {new}


def test_failed_query_check_rolls_back(setup: tuple[Fleet, Judge, str]) -> None:
    fleet, judge, _ = setup
    judge.score = 0.95
    stable = fleet.stable_version()
    bad = fleet.set_params(toolGateThreshold=0.75, faultInjection={"errorRate": 0.6})
    fleet.watch("rollback", lambda ro: ro.get("phase") == "RolledBack" and ro.get("rejectedVersion") == bad,
                timeout=180)
    ro = fleet.rollout()
    assert ro["reason"] == "AnalysisFailed" and "check error-ratio failed" in ro["message"], ro["message"]
    run = [r for r in runs(fleet) if r["canaryVersion"] == bad][-1]
    assert run["step"] == 1 and run["phase"] == "Failed"
    ratio = by_name(run)["error-ratio"]
    assert ratio["phase"] == "Failed" and ratio["measurements"][-1]["value"] > 0.3
    assert fleet.stable_version() == stable and set(fleet.pod_versions().values()) == {stable}


def test_inconclusive_check_pauses_until_aborted(setup: tuple[Fleet, Judge, str]) -> None:
    fleet, judge, _ = setup
    judge.score = 0.7  # neither >= 0.9 nor < 0.5
    stable = fleet.stable_version()
    new = fleet.set_params(toolGateThreshold=0.7)
    fleet.watch("paused as inconclusive", lambda ro: ro.get("phase") == "Paused"
                and ro.get("reason") == "AnalysisInconclusive" and ro.get("canaryVersion") == new, timeout=180)
    obj = fleet.gateconfig()
    assert obj["status"]["rollout"]["analysisPaused"] is True
    conditions = {c["type"]: c for c in obj["status"]["conditions"]}
    assert conditions["Progressing"]["reason"] == "AnalysisInconclusive"
    assert "check quality inconclusive" in conditions["Ready"]["message"]
    held = fleet.pod_versions()
    time.sleep(6)  # longer than a measurement interval: nothing moves while paused
    assert fleet.rollout()["phase"] == "Paused" and fleet.pod_versions() == held
    assert list(held.values()).count(new) == 1
    run = [r for r in runs(fleet) if r["canaryVersion"] == new][-1]
    assert run["phase"] == "Inconclusive" and by_name(run)["quality"]["measurements"][-1]["value"] == 0.7

    # kubectl sparsegate shows the run, and refuses `resume` (the spec switch does not hold it).
    env = {**os.environ, "KUBECONFIG": str(fleet.cluster.kubeconfig)}
    base = [sys.executable, "-m", "sparsegate.kubectl_plugin", "-n", NAMESPACE]
    status = subprocess.run([*base, "status", GATE], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert f"AnalysisRun: step 1 (30%) of {new}: Inconclusive" in status.stdout and "quality" in status.stdout
    resume = subprocess.run([*base, "resume", GATE], env=env, capture_output=True, text=True, timeout=60)
    assert resume.returncode == 1 and "inconclusive" in resume.stderr

    fleet.annotate("sparsegate.dev/abort")
    fleet.watch("aborted", lambda ro: ro.get("phase") == "Aborted" and ro.get("rejectedVersion") == new)
    assert set(fleet.pod_versions().values()) == {stable}
