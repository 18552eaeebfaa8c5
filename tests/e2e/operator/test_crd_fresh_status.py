"""A custom resource the operator has not seen yet reads InProgress to kstatus, not Current.

Given a bare control plane with the chart's CRDs and no operator (nothing ever writes a status),
when each kind is created from its example, then what the API server returns (the create's answer,
a get, a list) carries ``status.observedGeneration: 0`` (the CRDs' structural default for status),
so kstatus (``kstatus_port.compute``: what Flux's health checks and ``kpt live apply`` wait on)
reads InProgress (``LatestGenerationNotObserved``) instead of "Resource is current": Flux no longer
reports a just-applied SparseModel healthy before the operator has reconciled it. A status the
operator writes (its own observedGeneration) replaces the default.
"""

from __future__ import annotations

import importlib.util
import json

import yaml

from operator_e2e_support import EXAMPLES, REPO

CRDS = REPO / "charts" / "sparsegate" / "crds"
_spec = importlib.util.spec_from_file_location("kstatus_port", REPO / "tests" / "unit" / "rollout" / "kstatus_port.py")
kstatus_port = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kstatus_port)

KINDS = {"SparseModel": "sparsemodel.yaml", "GateConfig": "gateconfig.yaml", "RoutingPolicy": "routingpolicy.yaml",
         "TelemetryProbe": "telemetryprobe.yaml"}


def test_fresh_objects_are_in_progress_to_kstatus_without_the_operator(cluster, namespace):
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    for kind, example in KINDS.items():
        obj = yaml.safe_load((EXAMPLES / example).read_text())
        assert obj["kind"] == kind
        obj["metadata"]["namespace"] = namespace
        name, resource = obj["metadata"]["name"], f"{kind.lower()}.sparsegate.dev"
        created = json.loads(cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(obj)).stdout)
        got = json.loads(cluster.kubectl("get", resource, name, "-n", namespace, "-o", "json").stdout)
        listed = json.loads(cluster.kubectl("get", resource, "-n", namespace, "-o", "json").stdout)["items"]
        for seen in (created, got, *listed):
            assert seen["metadata"]["generation"] == 1 and seen.get("status") == {"observedGeneration": 0}, (kind, seen)
            assert kstatus_port.compute(seen) == (
                kstatus_port.IN_PROGRESS, f"{kind} generation is 1, but latest observed generation is 0"), (kind, seen)
        # The operator's first status write (merge patch on the status subresource) replaces the default.
        written = json.loads(cluster.kubectl(
            "patch", resource, name, "-n", namespace, "--subresource=status", "--type=merge", "-o", "json",
            "-p", json.dumps({"status": {"observedGeneration": 1}})).stdout)
        assert written["status"] == {"observedGeneration": 1}, (kind, written)
        assert kstatus_port.compute(written)[0] == kstatus_port.CURRENT, (kind, written)
