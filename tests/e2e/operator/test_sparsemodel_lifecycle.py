"""SparseModel end to end: chart + operator (under the chart's RBAC) + the examples.

Given the chart installed with helm and the operator running with its ServiceAccount token,
when the example GateConfig and SparseModel are applied, then the model's pods run on GPU kwok
nodes, status reaches Ready for the current generation, re-applying changes nothing, a missing
GateConfig degrades instead of crashing, a new stable gate re-renders the ConfigMap, and
deleting the model removes everything it owned.
"""

from __future__ import annotations

import json

import yaml

from operator_e2e_support import EXAMPLES, RELEASE_NS, SERVICE_ACCOUNT, get_json, wait_for
from sparsegate.clients.kube import Kube
from sparsegate.domain import gate, render
from sparsegate_workload import gateparams

MODEL = "moe-small"
OWNED = [("deployment", MODEL), ("service", MODEL), ("configmap", f"{MODEL}-gate"),
         ("secret", f"{MODEL}-admin")]


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def ready_at_generation(cluster, ns: str, name: str):
    def probe():
        m = get_json(cluster, "sparsemodel", name, "-n", ns)
        st = m.get("status") or {}
        ok = (condition(m, "Ready").get("status") == "True"
              and st.get("observedGeneration") == m["metadata"]["generation"])
        return m if ok else None
    return probe


def resource_versions(cluster, ns: str) -> dict:
    return {f"{k}/{n}": get_json(cluster, k, n, "-n", ns)["metadata"]["resourceVersion"] for k, n in OWNED}


def test_example_model_runs_on_gpu_nodes_and_becomes_ready(cluster, operator, namespace):
    ns = namespace
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "gateconfig.yaml"),
                    "-f", str(EXAMPLES / "sparsemodel.yaml"))
    model = wait_for("SparseModel Ready", ready_at_generation(cluster, ns, MODEL), op=operator)

    # Pods: Running on kwok nodes that carry GPUs, as many as asked for.
    pods = get_json(cluster, "pods", "-n", ns, "-l", f"sparsegate.dev/model={MODEL}")["items"]
    assert len(pods) == model["spec"]["replicas"] == 2
    nodes = {n["metadata"]["name"]: n for n in get_json(cluster, "nodes")["items"]}
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        node = nodes[pod["spec"]["nodeName"]]
        assert node["metadata"]["labels"].get("nvidia.com/gpu.present") == "true"
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "sparsegate-model"

    # Gate: GateConfig got status.stable on first sight; the model renders exactly that version.
    gc = get_json(cluster, "gateconfig", "default-gate", "-n", ns)
    stable = gc["status"]["stable"]
    assert stable["version"] == gateparams.version_of(gc["spec"]["params"])
    cm = get_json(cluster, "configmap", f"{MODEL}-gate", "-n", ns)
    doc = json.loads(cm["data"]["gate.json"])
    assert doc["version"] == stable["version"] == model["status"]["gateVersion"]
    assert gateparams.parse_document(doc).checksum == stable["checksum"]
    assert model["status"]["readyReplicas"] == 2
    assert condition(model, "Degraded")["status"] == "False"
    secret = get_json(cluster, "secret", f"{MODEL}-admin", "-n", ns)
    assert secret["data"]["token"]

    # Events on transitions, and the operator's own metrics and liveness.
    events = get_json(cluster, "events", "-n", ns, "--field-selector",
                      f"involvedObject.name={MODEL},involvedObject.kind=SparseModel")["items"]
    assert "ReadyTrue" in {e["reason"] for e in events}
    status, body = operator.get(operator.metrics_port, "/metrics")
    assert status == 200
    assert 'sparsegate_operator_reconciles_total{kind="SparseModel",outcome="success"}' in body
    assert operator.get(operator.liveness_port, "/healthz")[0] == 200

    # No drift: server-side applying the same rendered objects again changes nothing ...
    before = resource_versions(cluster, ns)
    kube = Kube.from_kubeconfig(str(cluster.kubeconfig))
    resolution = gate.resolve(gc, referenced=True, num_experts=model["spec"]["model"]["experts"])
    rendered = render.render_applied(model, resolution.document)
    for obj in rendered:
        kube.apply(obj)
        kube.apply(obj)
    assert resource_versions(cluster, ns) == before
    # ... and kubectl sees no difference between them and the live objects.
    manifest = "\n---\n".join(yaml.safe_dump(o) for o in rendered)
    diff = cluster.kubectl("diff", "--server-side", "--field-manager=sparsegate", "--force-conflicts",
                           "-f", "-", input=manifest, check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    # Re-applying the example through kubectl is a no-op for the operator's objects as well.
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "sparsemodel.yaml"))
    assert resource_versions(cluster, ns) == before

    # A spec change is reconciled: new generation observed, only the Deployment changes.
    cluster.kubectl("patch", "sparsemodel", MODEL, "-n", ns, "--type=merge", "-p",
                    '{"spec": {"replicas": 3}}')
    model = wait_for("3 replicas Ready", ready_at_generation(cluster, ns, MODEL), op=operator)
    assert model["metadata"]["generation"] == 2 and model["status"]["readyReplicas"] == 3
    after = resource_versions(cluster, ns)
    assert {k for k in before if before[k] != after[k]} == {f"deployment/{MODEL}"}

    # Self-healing: a Deployment deleted behind the operator's back comes back.
    uid = get_json(cluster, "deployment", MODEL, "-n", ns)["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", MODEL, "-n", ns, "--wait=true", timeout=60)

    def recreated():
        proc = cluster.kubectl("get", "deployment", MODEL, "-n", ns, "-o", "json", check=False)
        return proc.returncode == 0 and json.loads(proc.stdout)["metadata"]["uid"] != uid
    wait_for("the deleted Deployment to be re-created", recreated, op=operator)
    wait_for("Ready again", ready_at_generation(cluster, ns, MODEL), op=operator)

    # Delete cascades through ownerReferences (the garbage collector, no finalizer).
    assert not get_json(cluster, "sparsemodel", MODEL, "-n", ns)["metadata"].get("finalizers")
    cluster.kubectl("delete", "sparsemodel", MODEL, "-n", ns, "--wait=true", timeout=60)

    def all_gone():
        return all(cluster.kubectl("get", k, n, "-n", ns, check=False).returncode != 0 for k, n in OWNED)
    wait_for("owned objects to be garbage-collected", all_gone, timeout=60, op=operator)


def test_missing_gateconfig_degrades_then_recovers(cluster, operator, namespace):
    ns = namespace
    model = yaml.safe_load((EXAMPLES / "sparsemodel.yaml").read_text())
    model["metadata"]["name"] = "waiting"
    model["spec"]["gateConfigRef"] = {"name": "not-yet"}
    model["spec"]["resources"] = {"gpus": 0}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(model))

    def degraded():
        m = get_json(cluster, "sparsemodel", "waiting", "-n", ns)
        return m if condition(m, "Degraded").get("reason") == "GateConfigNotFound" else None
    m = wait_for("Degraded=GateConfigNotFound", degraded, op=operator)
    assert condition(m, "Degraded")["status"] == "True" and condition(m, "Ready")["status"] == "False"
    assert m["status"]["observedGeneration"] == m["metadata"]["generation"]
    assert cluster.kubectl("get", "deployment", "waiting", "-n", ns, check=False).returncode != 0
    assert operator.proc.poll() is None  # no crash

    gc = yaml.safe_load((EXAMPLES / "gateconfig.yaml").read_text())
    gc["metadata"]["name"] = "not-yet"
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(gc))
    m = wait_for("Ready once the GateConfig exists", ready_at_generation(cluster, ns, "waiting"),
                 op=operator)
    assert condition(m, "Degraded")["status"] == "False"
    pods = get_json(cluster, "pods", "-n", ns, "-l", "sparsegate.dev/model=waiting")["items"]
    assert pods and all(p["status"]["phase"] == "Running" for p in pods)


def test_new_stable_gate_rerenders_the_configmap(cluster, operator, namespace):
    ns = namespace
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "gateconfig.yaml"),
                    "-f", str(EXAMPLES / "sparsemodel-cpu.yaml"))
    cpu = yaml.safe_load((EXAMPLES / "sparsemodel-cpu.yaml").read_text())
    name = cpu["metadata"]["name"]
    # sparsemodel-cpu.yaml uses the built-in default gate; point it at the GateConfig.
    cluster.kubectl("patch", "sparsemodel", name, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"gateConfigRef": {"name": "default-gate"}}}))
    m = wait_for("cpu model Ready", ready_at_generation(cluster, ns, name), op=operator)
    pods = get_json(cluster, "pods", "-n", ns, "-l", f"sparsegate.dev/model={name}")["items"]
    assert all("nvidia.com/gpu" not in (p["spec"]["containers"][0].get("resources") or {}).get("limits", {})
               for p in pods)
    pod_uids = {p["metadata"]["uid"] for p in pods}

    # What the rollout controller does on promotion: write a new status.stable.
    params = {**gateparams.DEFAULT_PARAMS, "maxExpertsPerToken": 2, "toolGateThreshold": 0.9}
    new_stable = gate.stable_from_params(params)
    assert new_stable["version"] != m["status"]["gateVersion"]
    cluster.kubectl("patch", "gateconfig", "default-gate", "-n", ns, "--subresource=status",
                    "--type=merge", "-p", json.dumps({"status": {"stable": new_stable}}))

    def rerendered():
        cm = get_json(cluster, "configmap", f"{name}-gate", "-n", ns)
        model = get_json(cluster, "sparsemodel", name, "-n", ns)
        doc = json.loads(cm["data"]["gate.json"])
        return doc["version"] == new_stable["version"] == model["status"].get("gateVersion")
    wait_for("ConfigMap and status to carry the new stable gate", rerendered, op=operator)
    # New pods will start with it; running pods were not restarted by the change.
    pods = get_json(cluster, "pods", "-n", ns, "-l", f"sparsegate.dev/model={name}")["items"]
    assert {p["metadata"]["uid"] for p in pods} == pod_uids


def test_operator_cannot_do_more_than_its_role(cluster, sparsegate_release, operator):
    """The token the operator ran with is the chart's ServiceAccount, and it is narrow."""
    sa = f"system:serviceaccount:{RELEASE_NS}:{SERVICE_ACCOUNT}"

    def can(*args: str) -> bool:
        out = cluster.kubectl("auth", "can-i", *args, f"--as={sa}", check=False).stdout.strip()
        return out == "yes"
    assert can("patch", "sparsemodels.sparsegate.dev", "-A")
    assert can("create", "deployments.apps", "-n", "default")
    assert not can("list", "secrets", "-n", "default")
    assert not can("delete", "deployments.apps", "-n", "default")
    assert not can("list", "customresourcedefinitions.apiextensions.k8s.io")
    assert can("update", "leases.coordination.k8s.io/sparsegate-operator", "-n", RELEASE_NS)
    assert not can("update", "leases.coordination.k8s.io/other", "-n", RELEASE_NS)


def test_chart_objects_are_live(cluster, sparsegate_release):
    """helm's manifests were accepted by the real API server: the operator Deployment (a kwok
    pod here: nothing real runs in it, the tests run the operator as a local process) and its
    metrics Service exist, and the Deployment rolls out."""
    name = f"{sparsegate_release}-sparsegate-operator"
    cluster.kubectl("rollout", "status", f"deployment/{name}", "-n", RELEASE_NS, "--timeout=90s", timeout=120)
    dep = get_json(cluster, "deployment", name, "-n", RELEASE_NS)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == SERVICE_ACCOUNT
    svc = get_json(cluster, "service", f"{name}-metrics", "-n", RELEASE_NS)
    assert svc["spec"]["ports"][0]["name"] == "metrics"
