"""The chart's Argo CD health checks (charts/sparsegate/health/<group>/<Kind>/health.lua), run with
lupa the way Argo CD runs them: the resource as the global ``obj``, a table with ``status`` and
``message`` returned. Each kind's ``health_test.yaml`` (Argo CD's own test format) lists the
expected result per testdata object; the GateConfig, SparseModel and RoutingPolicy testdata
statuses were produced by the operator's pure status functions (rollout state machine,
model_status, policy_status), the TelemetryProbe ones are written by hand in its status shape. The rollout's phases are
also checked live in tests/unit/rollout/test_rollout_argocd_health.py, and on a real cluster in
tests/e2e/operator/test_kubectl_plugin.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa
import pytest
import yaml
from sparsegate_contracts import names

HEALTH = Path(__file__).resolve().parents[3] / "charts" / "sparsegate" / "health" / names.GROUP
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def run_health(kind: str, obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) the kind's health.lua returns for ``obj``."""
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute((HEALTH / kind / "health.lua").read_text())
    return hs["status"], hs["message"]


def cases() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for kind in sorted(names.PLURALS):
        for case in yaml.safe_load((HEALTH / kind / "health_test.yaml").read_text())["tests"]:
            out.append((kind, case))
    return out


def test_every_kind_has_a_health_check_and_every_testdata_file_a_case() -> None:
    assert sorted(p.name for p in HEALTH.iterdir()) == sorted(names.PLURALS)
    for kind in names.PLURALS:
        listed = {c["inputPath"] for k, c in cases() if k == kind}
        files = {f"testdata/{p.name}" for p in (HEALTH / kind / "testdata").glob("*.yaml")}
        assert listed == files and files, kind


@pytest.mark.parametrize(("kind", "case"), cases(), ids=lambda x: x if isinstance(x, str) else x["inputPath"])
def test_health_lua_on_testdata(kind: str, case: dict[str, Any]) -> None:
    obj = yaml.safe_load((HEALTH / kind / case["inputPath"]).read_text())
    assert obj["kind"] == kind
    status, message = run_health(kind, obj)
    assert status in ARGO_STATUSES
    assert (status, message) == (case["healthStatus"]["status"], case["healthStatus"]["message"])


def test_the_cases_cover_what_argo_users_ask_for() -> None:
    expected = {
        ("GateConfig", "testdata/paused.yaml"): "Suspended",
        ("GateConfig", "testdata/analysing.yaml"): "Progressing",
        ("GateConfig", "testdata/rolled-back.yaml"): "Degraded",
        ("GateConfig", "testdata/aborted.yaml"): "Degraded",
        ("GateConfig", "testdata/rolled-back-spec-reverted.yaml"): "Healthy",
        ("GateConfig", "testdata/succeeded.yaml"): "Healthy",
        ("SparseModel", "testdata/gateconfig-not-found.yaml"): "Degraded",
        ("SparseModel", "testdata/image-pull-backoff.yaml"): "Degraded",
        ("SparseModel", "testdata/crash-loop-rollout.yaml"): "Degraded",
        ("SparseModel", "testdata/progress-deadline-exceeded.yaml"): "Degraded",
        ("SparseModel", "testdata/apply-retrying.yaml"): "Progressing",  # 5xx/429/conflict: the operator retries
        ("SparseModel", "testdata/apply-refused.yaml"): "Degraded",
        ("RoutingPolicy", "testdata/opa-rejected.yaml"): "Degraded",
        ("TelemetryProbe", "testdata/no-status.yaml"): "Progressing",
        ("TelemetryProbe", "testdata/stalled.yaml"): "Degraded",
    }
    got = {(k, c["inputPath"]): c["healthStatus"]["status"] for k, c in cases()}
    assert {key: got.get(key) for key in expected} == expected


def test_a_spec_edit_not_yet_observed_is_progressing_whatever_the_conditions_say() -> None:
    for kind in ("GateConfig", "SparseModel", "RoutingPolicy"):
        obj = yaml.safe_load((HEALTH / kind / "testdata" / "generation-not-observed.yaml").read_text())
        assert obj["metadata"]["generation"] > obj["status"]["observedGeneration"]
        assert run_health(kind, obj)[0] == "Progressing"


def test_a_new_object_with_the_crd_status_default_is_progressing_and_in_progress_to_kstatus() -> None:
    """Before the operator writes status, the API server returns each kind with the CRD's structural
    default for status (observedGeneration 0, tests/e2e/operator/test_crd_fresh_status.py): Argo CD
    shows it Progressing and kstatus (Flux) InProgress, not Healthy / Current."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kstatus_port", Path(__file__).resolve().parents[1] / "rollout"
                                                  / "kstatus_port.py")
    kstatus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kstatus)
    crds = HEALTH.parents[1] / "crds"
    for kind, plural in names.PLURALS.items():
        crd = yaml.safe_load((crds / f"{plural}.yaml").read_text())
        default = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"].get("default")
        assert default == {"observedGeneration": 0}, kind
        obj = {"apiVersion": f"{names.GROUP}/v1alpha1", "kind": kind, "metadata": {"name": "new", "generation": 1},
               "spec": {}, "status": default}
        assert run_health(kind, obj)[0] == "Progressing", kind
        assert kstatus.compute(obj)[0] == kstatus.IN_PROGRESS, kind
        assert kstatus.compute({**obj, "status": {}})[0] == kstatus.CURRENT  # what it read without the default
