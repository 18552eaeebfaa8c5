"""Quality in rollout analysis, end to end: real gate-parameter changes on a trained model.

Given the trained demo checkpoint (dev/trained_model.py: `sparsegate-train`'s demo recipe,
trained once per machine) baked into an image made FROM the stack's model-server image, served
by 4 real model-server containers under load through the operator running in-cluster (the
rollout conftest's dev stack, a module of its own), with the GateConfig's default
``maxQualityDrop`` (0.02), the default strategy (``requests``: every pod holds the stable and the
canary version and scores the probe set under each) and no ``faultInjection``:

* a benign ``confidenceThreshold`` change (0.6 → 0.8; probe perplexity 4.187 → 4.186 on this
  model) passes every step and is promoted;
* a harmful one (``confidenceThreshold`` 0.05 with ``maxExpertsPerToken`` 1: top-1 routing;
  4.187 → 4.831) is rolled back at the first step **because quality dropped**: the only failed
  check is ``qualityDrop``, and the message names it with both perplexities.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from devstack import Stack
from imagebuild.checkpoint import bake_checkpoint
from loadgen import BackgroundLoad
from localcluster.health import wait_for
from trained_model import trained_checkpoint

from rollout_e2e_support import BASE_PARAMS, GATE, MODEL, NAMESPACE, Fleet, Operator

pytestmark = pytest.mark.slow

REPLICAS = 4  # every pod holds stable + canary (strategy requests, the default): 25 % of requests
QPS = 40.0
CHECKPOINT_DIR = "/models/sparsegate-demo"


def checkpoint_image(base: str, ctx: Path) -> str:
    return bake_checkpoint(base, trained_checkpoint(), ctx=ctx, target=CHECKPOINT_DIR,
                           tag="localhost/sparsegate-test-trained:e2e")


@pytest.fixture(scope="module")
def quality_fleet(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    image = checkpoint_image(stack.images["model-server"], tmp_path_factory.mktemp("trained-image"))
    ns = NAMESPACE
    wait_for(lambda: stack.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
             what="default ServiceAccount", timeout_s=60, interval_s=0.5)
    gateconfig = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig", "metadata": {"name": GATE},
                  "spec": {"params": BASE_PARAMS,
                           # This module judges quality: a loose SLA (4 CPU servers beside other work on a
                           # shared machine saw p99 ~1 s) and a loose drift bound (raising the threshold
                           # 0.6 -> 0.8 is meant to activate more experts: drift 0.74 measured) keep the
                           # other checks from deciding; maxQualityDrop is left at its default.
                           "rollout": {"steps": [25, 50, 100], "analysisInterval": "4s",
                                       "slaP99LatencyMs": 10000, "maxDrift": 2.0, "autoRollback": True}}}
    model = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel", "metadata": {"name": MODEL},
             "spec": {"replicas": REPLICAS, "image": image, "gateConfigRef": {"name": GATE},
                      "model": {"dModel": 64, "experts": 8, "maxExpertsPerToken": 4, "source": CHECKPOINT_DIR}}}
    op = Operator(stack=stack)
    op.expected_restarts = op.restart_count()
    f = Fleet(stack=stack, namespace=ns, operator=op)
    stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                  "items": [gateconfig, model]}))
    t0 = time.monotonic()
    try:
        f.wait_serving(REPLICAS, f"{REPLICAS} trained-model servers Ready")
        sys.stderr.write(f"[e2e] {REPLICAS} trained-model servers serving {time.monotonic() - t0:.1f}s after apply\n")
        f.check_pods_are_ours()
        f.watch("the GateConfig to be initialised", lambda ro: ro.get("phase") == "Succeeded", timeout=60)
        f.load = BackgroundLoad(f.targets, qps=QPS).start()
        yield f
    finally:
        if f.load is not None:
            f.load.stop()
            sys.stderr.write(f"[e2e] load: {f.load.stats}\n")
        sys.stderr.write(f"[e2e] quality rollout operator log tail:\n{op.tail(40)}\n")


def probe_perplexities(fleet: Fleet) -> dict[str, float]:
    """Each pod's probe perplexity for the gate version it serves, from its /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for p in fleet.pods():
        with urllib.request.urlopen(f"http://{p['status']['podIP']}:8080/metrics", timeout=5) as resp:
            for fam in text_string_to_metric_families(resp.read().decode()):
                for s in fam.samples:
                    if s.name == "sparsegate_probe_perplexity":
                        out[s.labels["gate_version"]] = s.value
    return out


def test_benign_threshold_change_passes_quality_and_is_promoted(quality_fleet: Fleet) -> None:
    fleet = quality_fleet
    stable = fleet.stable_version()
    new = fleet.set_params(confidenceThreshold=0.8)
    fleet.watch("promotion", lambda ro: ro.get("phase") == "Succeeded" and fleet.stable_version() == new, timeout=180)
    assert new != stable and set(fleet.pod_versions().values()) == {new}
    runs = fleet.gateconfig()["status"].get("analysisRuns") or []
    quality = [m for r in runs if r.get("canaryVersion") == new for c in r.get("checks") or []
               for m in c.get("measurements") or [] if "qualityDrop" in (m.get("values") or {})]
    assert quality, runs  # the quality check was evaluated (step 1 and 2 have a stable group)
    assert all(m["values"]["qualityDrop"] <= 0.02 for m in quality), quality
    ppl = probe_perplexities(fleet)
    assert list(ppl) == [new] and ppl[new] < 6.0, ppl  # the trained model, not a random one


def test_harmful_routing_is_rolled_back_because_quality_dropped(quality_fleet: Fleet) -> None:
    fleet = quality_fleet
    stable = fleet.stable_version()
    bad = fleet.set_params(confidenceThreshold=0.05, maxExpertsPerToken=1)
    assert "faultInjection" not in fleet.gateconfig()["spec"]["params"] or not any(
        fleet.gateconfig()["spec"]["params"]["faultInjection"].values())
    seen = fleet.watch("rollback", lambda ro: ro.get("phase") == "RolledBack" and ro.get("rejectedVersion") == bad,
                       timeout=180)
    seen = [s for s in seen if s["canaryVersion"] == bad or s["phase"] == "RolledBack"]
    assert max(s["step"] or 0 for s in seen) == 1, seen  # never past 25 %
    # Strategy requests: every pod held the canary beside stable at the step.
    assert {s["canaryInstances"] for s in seen if s["canaryVersion"] == bad and s["step"]} == {f"{REPLICAS}/{REPLICAS}"}, seen
    ro = fleet.rollout()
    assert ro["reason"] == "AnalysisFailed" and "qualityDrop" in ro["message"], ro["message"]
    assert "perplexity" in ro["message"] and "probe set" in ro["message"], ro["message"]  # both versions' probe scores
    failed = [c for c in ro["analysis"]["checks"] if c["passed"] is False]
    assert [c["name"] for c in failed] == ["qualityDrop"] and failed[0]["value"] > 0.05, failed
    assert fleet.stable_version() == stable and set(fleet.pod_versions().values()) == {stable}
    warnings = [e for e in fleet.events() if e["type"] == "Warning" and e["reason"] == "AnalysisFailed"]
    assert any(bad in e["message"] and "qualityDrop" in e["message"] for e in warnings), warnings
    sys.stderr.write(f"[e2e] rolled back: {ro['message']}\n")


def test_max_quality_drop_out_of_bounds_is_rejected_by_the_api_server(quality_fleet: Fleet) -> None:
    for bad in (-0.1, 10.5):
        proc = quality_fleet.cluster.kubectl(
            "patch", "gateconfig", GATE, "-n", quality_fleet.namespace, "--type=merge", "-p",
            json.dumps({"spec": {"rollout": {"maxQualityDrop": bad}}}), check=False)
        assert proc.returncode != 0 and "maxQualityDrop" in proc.stderr, proc.stderr
