"""kubectl sparsegate against the in-cluster operator, with the Argo CD health check on live objects.

Given the dev stack and a GateConfig that no SparseModel uses (so each new version has no
instances to step through and is promoted as soon as it is let go), when the plugin runs as a
subprocess with the stack's kubeconfig: ``get`` lists it, ``pause`` holds the next version
(Argo CD's health check reads Suspended), ``resume`` lets it be promoted (Healthy, a second
revision in status.history), and ``undo`` writes the first revision's params back, which the
operator rolls out as a third revision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lupa
from localcluster.health import wait_for

REPO = Path(__file__).resolve().parents[3]
HEALTH_LUA = (REPO / "charts" / "sparsegate" / "health" / "sparsegate.dev" / "GateConfig" / "health.lua").read_text()
GATE = "plugin-gate"
V1 = {"toolGateThreshold": 0.85, "entropyBeta": 0.1}
V2 = {"toolGateThreshold": 0.8, "entropyBeta": 0.1}


def argo_health(obj: dict[str, Any]) -> tuple[str, str]:
    lua = lupa.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(HEALTH_LUA)
    return hs["status"], hs["message"]


def plugin(stack, *args: str) -> str:
    env = {**os.environ, "KUBECONFIG": str(stack.cluster.kubeconfig)}
    proc = subprocess.run([sys.executable, "-m", "sparsegate.kubectl_plugin", *args], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def gateconfig(stack, ns: str) -> dict[str, Any]:
    return json.loads(stack.kubectl("get", "gateconfig", GATE, "-n", ns, "-o", "json").stdout)


def wait_settled(stack, ns: str, phase: str, what: str) -> dict[str, Any]:
    """The GateConfig once the operator has seen its generation and rests in ``phase``."""
    last: dict[str, Any] = {}
    try:
        return wait_for(settled(stack, ns, phase, last), what=what, timeout_s=120, interval_s=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen: {json.dumps(last.get('obj'))[:3000]}") from None


def settled(stack, ns: str, phase: str, last: dict[str, Any]):
    def probe() -> dict[str, Any] | None:
        obj = last["obj"] = gateconfig(stack, ns)
        status = obj.get("status") or {}
        ok = (status.get("observedGeneration") == obj["metadata"]["generation"]
              and (status.get("rollout") or {}).get("phase") == phase)
        return obj if ok else None
    return probe


def test_plugin_get_pause_resume_undo(stack, operator, stack_namespace):
    ns = stack_namespace
    manifest = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig",
                "metadata": {"name": GATE, "namespace": ns}, "spec": {"params": V1}}
    stack.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    first = wait_settled(stack, ns, "Succeeded", "GateConfig initialized")
    (rev1,) = first["status"]["history"]
    assert rev1["revision"] == 1 and rev1["version"] == first["status"]["stable"]["version"]
    assert argo_health(first)[0] == "Healthy"

    # get: one row, phase and stable version.
    lines = plugin(stack, "get", "-n", ns).splitlines()
    assert lines[0].split()[:2] == ["NAME", "PHASE"]
    assert lines[1].split()[:2] == [GATE, "Succeeded"] and rev1["version"] in lines[1]

    # pause, then a new version: held at step 1, Suspended for Argo CD.
    assert "paused" in plugin(stack, "pause", GATE, "-n", ns)
    assert gateconfig(stack, ns)["spec"]["rollout"]["paused"] is True
    stack.kubectl("patch", "gateconfig", GATE, "-n", ns, "--type", "merge", "-p", json.dumps({"spec": {"params": V2}}))
    paused = wait_settled(stack, ns, "Paused", "rollout paused")
    assert paused["status"]["rollout"]["canaryVersion"] != rev1["version"]
    assert argo_health(paused) == ("Suspended", paused["status"]["rollout"]["message"])
    assert "Phase:      Paused" in plugin(stack, "status", GATE, "-n", ns)

    # resume: no instances to step through, so promoted at once; a second revision.
    assert "resumed" in plugin(stack, "resume", GATE, "-n", ns)
    promoted = wait_settled(stack, ns, "Succeeded", "rollout promoted")
    rev2 = promoted["status"]["history"][-1]
    assert rev2["revision"] == 2 and rev2["version"] == paused["status"]["rollout"]["canaryVersion"]
    assert promoted["status"]["stable"]["version"] == rev2["version"]
    assert argo_health(promoted)[0] == "Healthy"

    # undo: revision 1's params back in the spec, rolled out as revision 3.
    out = plugin(stack, "undo", GATE, "-n", ns)
    assert f"revision 1 ({rev1['version']})" in out
    assert gateconfig(stack, ns)["spec"]["params"] == rev1["params"]
    undone = wait_for(lambda: (lambda o: o if (o["status"].get("stable") or {}).get("version") == rev1["version"]
                               and o["status"]["rollout"]["phase"] == "Succeeded" else None)(gateconfig(stack, ns)),
                      what="undo rolled out", timeout_s=120, interval_s=0.5)
    assert [(r["revision"], r["version"]) for r in undone["status"]["history"]] == [
        (2, rev2["version"]), (3, rev1["version"])]
    conditions = {c["type"]: c["status"] for c in undone["status"]["conditions"]}
    assert (conditions["Ready"], conditions["Reconciling"], conditions["Stalled"]) == ("True", "False", "False")


def run_plugin(kubeconfig: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    return subprocess.run([sys.executable, "-m", "sparsegate.kubectl_plugin", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_plugin_refusals_and_errors_without_the_operator(cluster, namespace, tmp_path):
    """No operator, a bare control plane with the CRDs: a GateConfig applied server-side by a GitOps
    manager that declares sparsegate.dev/promote, with an in-flight status written as the operator
    would. `promote` is refused (exit 1, one line, annotation left as Git has it: the plugin reads
    the real managedFields); `abort` (not declared) is written; a missing name and a write RBAC
    forbids are one `error:` line each, exit 1."""
    from partition_support import CHART, token_kubeconfig

    ns = namespace
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    manifest = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig",
                "metadata": {"name": GATE, "namespace": ns, "annotations": {"sparsegate.dev/promote": "full-git-1"}},
                "spec": {"params": V2}}
    cluster.kubectl("apply", "--server-side", "--field-manager", "kustomize-controller", "-f", "-",
                    input=json.dumps(manifest))
    status = {"status": {"stable": {"version": "g-stable"}, "rollout": {
        "phase": "Analysing", "step": 1, "steps": 3, "canaryPercent": 5, "canaryVersion": "g-canary",
        "canary": {"version": "g-canary", "params": V2}, "handledRequests": {"sparsegate.dev/promote": "full-git-1"}}}}
    cluster.kubectl("patch", "gateconfig", GATE, "-n", ns, "--subresource=status", "--type", "merge",
                    "-p", json.dumps(status))
    kubeconfig = cluster.kubeconfig

    refused = run_plugin(kubeconfig, "promote", GATE, "-n", ns)
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert refused.stderr.startswith("error: sparsegate.dev/promote is declared by the applied manifest (Git) as "
                                     "'full-git-1'") and refused.stderr.count("\n") == 1, refused.stderr

    def annotations() -> dict[str, str]:
        obj = json.loads(cluster.kubectl("get", "gateconfig", GATE, "-n", ns, "-o", "json").stdout)
        return obj["metadata"]["annotations"]

    assert annotations() == {"sparsegate.dev/promote": "full-git-1"}
    aborted = run_plugin(kubeconfig, "abort", GATE, "-n", ns)
    assert aborted.returncode == 0 and "abort requested" in aborted.stdout, aborted
    assert annotations()["sparsegate.dev/abort"] == "kubectl-sparsegate"

    missing = run_plugin(kubeconfig, "status", "nope", "-n", ns)
    assert missing.returncode == 1 and missing.stderr == (
        'error: 404 Not Found: gateconfigs.sparsegate.dev "nope" not found\n'), missing

    # A user who may read GateConfigs but not write them.
    cluster.kubectl("create", "serviceaccount", "viewer", "-n", ns)
    cluster.kubectl("create", "role", "gc-viewer", "-n", ns, "--verb=get,list,watch", "--resource=gateconfigs")
    cluster.kubectl("create", "rolebinding", "gc-viewer", "-n", ns, "--role=gc-viewer",
                    f"--serviceaccount={ns}:viewer")
    viewer = token_kubeconfig(cluster, path=tmp_path / "viewer.kubeconfig", server=cluster.server, namespace=ns,
                              service_account="viewer")
    assert run_plugin(viewer, "get").returncode == 0  # the context's namespace
    forbidden = run_plugin(viewer, "pause", GATE)
    assert forbidden.returncode == 1 and forbidden.stderr.startswith("error: 403 Forbidden: ") \
        and "cannot patch resource \"gateconfigs\"" in forbidden.stderr and forbidden.stderr.count("\n") == 1, forbidden
