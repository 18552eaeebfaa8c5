"""SparseModel end to end: chart + operator (in-cluster, under the chart's RBAC) + the examples.

Given the dev stack (the chart installed with helm; the operator running in-cluster from its image
as the chart's ServiceAccount; pods' containers run from their images), when the example GateConfig
and SparseModel are applied, then the model's pods run the model-server image on GPU kwok nodes,
status reaches Ready for the current generation, re-applying changes nothing, a missing GateConfig
degrades instead of crashing, a Service the API server refuses degrades the model without holding
its Deployment back (and clears on the retry once it lands), a new stable gate re-renders the
ConfigMap, owned objects scaled or deleted by hand are put back from the watch, and deleting the
model removes everything it owned.
"""

from __future__ import annotations

import json
import re
import time

import yaml

from localcluster.health import wait_for

from operator_e2e_support import (EXAMPLES, LIVENESS_PORT, METRICS_PORT, OPERATOR, RELEASE_NS, SERVICE_ACCOUNT,
                                  get_json, http_get, lease_holder, operator_restarts)
from sparsegate.clients.kube import Kube
from sparsegate.domain import gate, render
from sparsegate_workload import gateparams

MODEL = "moe-small"
# Model-server containers import torch and build the model before they are Ready (2 cores, shared).
READY_S = 240
OWNED = [("deployment", MODEL), ("service", MODEL), ("configmap", f"{MODEL}-gate"),
         ("secret", f"{MODEL}-admin")]


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def ready_at_generation(stack, ns: str, name: str):
    def probe():
        m = get_json(stack, "sparsemodel", name, "-n", ns)
        st = m.get("status") or {}
        ok = (condition(m, "Ready").get("status") == "True"
              and st.get("observedGeneration") == m["metadata"]["generation"])
        return m if ok else None
    return probe


def resource_versions(stack, ns: str) -> dict:
    return {f"{k}/{n}": get_json(stack, k, n, "-n", ns)["metadata"]["resourceVersion"] for k, n in OWNED}


def test_example_model_runs_on_gpu_nodes_and_becomes_ready(stack, operator, stack_namespace):
    ns = stack_namespace
    stack.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "gateconfig.yaml"),
                  "-f", str(EXAMPLES / "sparsemodel.yaml"))
    model = wait_for(ready_at_generation(stack, ns, MODEL), what="SparseModel Ready", timeout_s=READY_S,
                     interval_s=0.5)

    # Pods: Running on kwok nodes that carry GPUs, as many as asked for, serving from the chart's
    # model-server image (the example names none).
    pods = get_json(stack, "pods", "-n", ns, "-l", f"sparsegate.dev/model={MODEL}")["items"]
    assert len(pods) == model["spec"]["replicas"] == 2
    nodes = {n["metadata"]["name"]: n for n in get_json(stack, "nodes")["items"]}
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        node = nodes[pod["spec"]["nodeName"]]
        assert node["metadata"]["labels"].get("nvidia.com/gpu.present") == "true"
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "sparsegate-model"
        (server,) = pod["status"]["containerStatuses"]
        assert server["image"] == stack.images["model-server"] and server["ready"]

    # Gate: GateConfig got status.stable on first sight; the model renders exactly that version.
    gc = get_json(stack, "gateconfig", "default-gate", "-n", ns)
    stable = gc["status"]["stable"]
    assert stable["version"] == gateparams.version_of(gc["spec"]["params"])
    cm = get_json(stack, "configmap", f"{MODEL}-gate", "-n", ns)
    doc = json.loads(cm["data"]["gate.json"])
    assert doc["version"] == stable["version"] == model["status"]["gateVersion"]
    assert gateparams.parse_document(doc).checksum == stable["checksum"]
    assert model["status"]["readyReplicas"] == 2
    assert condition(model, "Degraded")["status"] == "False"
    secret = get_json(stack, "secret", f"{MODEL}-admin", "-n", ns)
    assert secret["data"]["token"]

    # Events on transitions, and the operator's own metrics and liveness (on its pod IP).
    events = get_json(stack, "events", "-n", ns, "--field-selector",
                      f"involvedObject.name={MODEL},involvedObject.kind=SparseModel")["items"]
    assert "ReadyTrue" in {e["reason"] for e in events}
    status, body = http_get(operator, METRICS_PORT, "/metrics")
    assert status == 200
    assert 'sparsegate_operator_reconciles_total{kind="SparseModel",outcome="success"}' in body
    # The new Deployment's states before all its pods were ready were deferred (refreshed a moment
    # later from the newest watched state), not written one by one.
    deferred = re.search(r'sparsegate_operator_reconciles_total\{kind="Deployment",outcome="deferred"\} (\S+)', body)
    assert deferred and float(deferred.group(1)) >= 1, body
    assert http_get(operator, LIVENESS_PORT, "/healthz")[0] == 200

    # No drift: server-side applying the same rendered objects again changes nothing ...
    before = resource_versions(stack, ns)
    kube = Kube.from_kubeconfig(str(stack.cluster.kubeconfig))
    resolution = gate.resolve(gc, referenced=True, num_experts=model["spec"]["model"]["experts"])
    # The operator renders pods with the chart's modelServer.image (its env): render with the same.
    default_image = render.DefaultImage(image=stack.images["model-server"], pull_policy="Never")
    rendered = render.render_applied(model, resolution.document, default_image=default_image)
    for obj in rendered:
        kube.apply(obj)
        kube.apply(obj)
    assert resource_versions(stack, ns) == before
    # ... and kubectl sees no difference between them and the live objects.
    manifest = "\n---\n".join(yaml.safe_dump(o) for o in rendered)
    diff = stack.kubectl("diff", "--server-side", "--field-manager=sparsegate", "--force-conflicts",
                         "-f", "-", input=manifest, check=False)
    assert diff.returncode == 0, diff.stdout + diff.stderr
    # Re-applying the example through kubectl is a no-op for the operator's objects as well.
    stack.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "sparsemodel.yaml"))
    assert resource_versions(stack, ns) == before

    # A spec change is reconciled: new generation observed, only the Deployment changes.
    stack.kubectl("patch", "sparsemodel", MODEL, "-n", ns, "--type=merge", "-p",
                  '{"spec": {"replicas": 3}}')
    model = wait_for(ready_at_generation(stack, ns, MODEL), what="3 replicas Ready", timeout_s=READY_S,
                     interval_s=0.5)
    assert model["metadata"]["generation"] == 2 and model["status"]["readyReplicas"] == 3
    after = resource_versions(stack, ns)
    assert {k for k in before if before[k] != after[k]} == {f"deployment/{MODEL}"}
    # Kopf keeps the last handled spec in the operator's process (handlers.diffbase): it wrote no
    # annotation of its own on the model, at creation or at the change.
    assert "sparsegate.dev/last-handled-configuration" not in (model["metadata"].get("annotations") or {})

    # Self-healing: a Deployment deleted behind the operator's back comes back.
    uid = get_json(stack, "deployment", MODEL, "-n", ns)["metadata"]["uid"]
    stack.kubectl("delete", "deployment", MODEL, "-n", ns, "--wait=true", timeout=60)

    def recreated():
        proc = stack.kubectl("get", "deployment", MODEL, "-n", ns, "-o", "json", check=False)
        return proc.returncode == 0 and json.loads(proc.stdout)["metadata"]["uid"] != uid
    wait_for(recreated, what="the deleted Deployment to be re-created", timeout_s=90)
    wait_for(ready_at_generation(stack, ns, MODEL), what="Ready again", timeout_s=READY_S, interval_s=0.5)

    # Delete cascades through ownerReferences (the garbage collector, no finalizer).
    assert not get_json(stack, "sparsemodel", MODEL, "-n", ns)["metadata"].get("finalizers")
    stack.kubectl("delete", "sparsemodel", MODEL, "-n", ns, "--wait=true", timeout=60)

    def all_gone():
        return all(stack.kubectl("get", k, n, "-n", ns, check=False).returncode != 0 for k, n in OWNED)
    wait_for(all_gone, what="owned objects to be garbage-collected", timeout_s=60)


def test_missing_gateconfig_degrades_then_recovers(stack, operator, stack_namespace):
    ns = stack_namespace
    restarts = operator_restarts(stack)
    model = yaml.safe_load((EXAMPLES / "sparsemodel.yaml").read_text())
    model["metadata"]["name"] = "waiting"
    model["spec"]["gateConfigRef"] = {"name": "not-yet"}
    model["spec"]["resources"] = {"gpus": 0}
    stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(model))

    def degraded():
        m = get_json(stack, "sparsemodel", "waiting", "-n", ns)
        return m if condition(m, "Degraded").get("reason") == "GateConfigNotFound" else None
    m = wait_for(degraded, what="Degraded=GateConfigNotFound", timeout_s=90)
    assert condition(m, "Degraded")["status"] == "True" and condition(m, "Ready")["status"] == "False"
    assert m["status"]["observedGeneration"] == m["metadata"]["generation"]
    assert stack.kubectl("get", "deployment", "waiting", "-n", ns, check=False).returncode != 0
    # No crash: the same operator container, never restarted, still holds the Lease.
    assert operator_restarts(stack) == restarts
    assert lease_holder(stack) == operator["metadata"]["name"]

    gc = yaml.safe_load((EXAMPLES / "gateconfig.yaml").read_text())
    gc["metadata"]["name"] = "not-yet"
    stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(gc))
    m = wait_for(ready_at_generation(stack, ns, "waiting"), what="Ready once the GateConfig exists",
                 timeout_s=READY_S, interval_s=0.5)
    assert condition(m, "Degraded")["status"] == "False"
    pods = get_json(stack, "pods", "-n", ns, "-l", "sparsegate.dev/model=waiting")["items"]
    assert pods and all(p["status"]["phase"] == "Running" for p in pods)


def test_new_stable_gate_rerenders_the_configmap(stack, operator, stack_namespace):
    ns = stack_namespace
    stack.kubectl("apply", "-n", ns, "-f", str(EXAMPLES / "gateconfig.yaml"),
                  "-f", str(EXAMPLES / "sparsemodel-cpu.yaml"))
    cpu = yaml.safe_load((EXAMPLES / "sparsemodel-cpu.yaml").read_text())
    name = cpu["metadata"]["name"]
    # sparsemodel-cpu.yaml uses the built-in default gate; point it at the GateConfig.
    stack.kubectl("patch", "sparsemodel", name, "-n", ns, "--type=merge", "-p",
                  json.dumps({"spec": {"gateConfigRef": {"name": "default-gate"}}}))
    m = wait_for(ready_at_generation(stack, ns, name), what="cpu model Ready", timeout_s=READY_S, interval_s=0.5)
    pods = get_json(stack, "pods", "-n", ns, "-l", f"sparsegate.dev/model={name}")["items"]
    assert all("nvidia.com/gpu" not in (p["spec"]["containers"][0].get("resources") or {}).get("limits", {})
               for p in pods)
    pod_uids = {p["metadata"]["uid"] for p in pods}

    # What the rollout controller does on promotion: write a new status.stable.
    params = {**gateparams.DEFAULT_PARAMS, "maxExpertsPerToken": 2, "toolGateThreshold": 0.9}
    new_stable = gate.stable_from_params(params)
    assert new_stable["version"] != m["status"]["gateVersion"]
    stack.kubectl("patch", "gateconfig", "default-gate", "-n", ns, "--subresource=status",
                  "--type=merge", "-p", json.dumps({"status": {"stable": new_stable}}))

    def rerendered():
        cm = get_json(stack, "configmap", f"{name}-gate", "-n", ns)
        model = get_json(stack, "sparsemodel", name, "-n", ns)
        doc = json.loads(cm["data"]["gate.json"])
        return doc["version"] == new_stable["version"] == model["status"].get("gateVersion")
    wait_for(rerendered, what="ConfigMap and status to carry the new stable gate", timeout_s=90)
    # New pods will start with it; running pods were not restarted by the change.
    pods = get_json(stack, "pods", "-n", ns, "-l", f"sparsegate.dev/model={name}")["items"]
    assert {p["metadata"]["uid"] for p in pods} == pod_uids


def test_operator_cannot_do_more_than_its_role(stack, operator):
    """The operator runs as the chart's ServiceAccount (its only credential is that account's
    token, mounted by the pod runner), and that account is narrow."""
    assert operator["spec"]["serviceAccountName"] == SERVICE_ACCOUNT
    # It reached the API server with that token: it holds (and so could write) the Lease.
    assert lease_holder(stack) == operator["metadata"]["name"]
    sa = f"system:serviceaccount:{RELEASE_NS}:{SERVICE_ACCOUNT}"

    def can(*args: str) -> bool:
        out = stack.kubectl("auth", "can-i", *args, f"--as={sa}", check=False).stdout.strip()
        return out == "yes"
    assert can("patch", "sparsemodels.sparsegate.dev", "-A")
    assert can("create", "deployments.apps", "-n", "default")
    assert not can("list", "secrets", "-n", "default")
    assert not can("delete", "deployments.apps", "-n", "default")
    assert not can("list", "customresourcedefinitions.apiextensions.k8s.io")
    assert can("update", "leases.coordination.k8s.io/sparsegate-operator", "-n", RELEASE_NS)
    assert not can("update", "leases.coordination.k8s.io/other", "-n", RELEASE_NS)


def test_chart_objects_are_live(stack, operator):
    """helm's manifests were accepted by the real API server and run: the operator Deployment
    rolls out (its pod runs the operator image as the chart's ServiceAccount) and its metrics
    Service exists."""
    stack.kubectl("rollout", "status", f"deployment/{OPERATOR}", "-n", RELEASE_NS, "--timeout=90s", timeout=120)
    dep = get_json(stack, "deployment", OPERATOR, "-n", RELEASE_NS)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == SERVICE_ACCOUNT
    statuses = {c["name"]: c for c in operator["status"]["containerStatuses"]}
    assert statuses["operator"]["image"] == stack.images["operator"] and statuses["operator"]["ready"]
    svc = get_json(stack, "service", f"{OPERATOR}-metrics", "-n", RELEASE_NS)
    assert svc["spec"]["ports"][0]["name"] == "metrics"


def test_headless_service_is_chosen_at_creation(stack, operator, stack_namespace):
    ns = stack_namespace
    base = yaml.safe_load((EXAMPLES / "sparsemodel.yaml").read_text())
    base["spec"].update(replicas=0, resources={"gpus": 0})
    base["spec"].pop("gateConfigRef", None)  # the built-in gate: nothing else to wait for
    models = {"svc-headless": {"headless": True}, "svc-default": None}
    for name, service in models.items():
        model = {**base, "metadata": {**base["metadata"], "name": name}, "spec": dict(base["spec"])}
        if service is not None:
            model["spec"]["service"] = service
        stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(model))

    def service(name: str):
        def probe():
            proc = stack.kubectl("get", "service", name, "-n", ns, "-o", "json", check=False)
            return json.loads(proc.stdout) if proc.returncode == 0 else None
        return probe
    headless = wait_for(service("svc-headless"), what="the headless model's Service", timeout_s=90)
    assert headless["spec"]["clusterIP"] == render.HEADLESS == "None"
    assert headless["spec"]["selector"] == render.selector_labels("svc-headless")
    default = wait_for(service("svc-default"), what="the default model's Service", timeout_s=90)
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", default["spec"]["clusterIP"])  # allocated
    # The schema defaults the field, so an update always carries it and the rule below applies.
    assert get_json(stack, "sparsemodel", "svc-default", "-n", ns)["spec"]["service"] == {"headless": False}

    # Immutable, as the Service's clusterIP is: the API server refuses the change, naming the field,
    # and nothing is replaced.
    for name, patch in (("svc-headless", '{"spec": {"service": {"headless": false}}}'),
                        ("svc-default", '{"spec": {"service": {"headless": true}}}')):
        proc = stack.kubectl("patch", "sparsemodel", name, "-n", ns, "--type=merge", "-p", patch, check=False)
        assert proc.returncode != 0 and "spec.service.headless is immutable" in proc.stderr, proc.stderr
    proc = stack.kubectl("patch", "sparsemodel", "svc-headless", "-n", ns, "--type=json", "-p",
                         '[{"op": "remove", "path": "/spec/service"}]', check=False)
    assert proc.returncode != 0 and "spec.service.headless" in proc.stderr, proc.stderr
    assert service("svc-headless")()["metadata"]["uid"] == headless["metadata"]["uid"]
    assert service("svc-default")()["metadata"]["uid"] == default["metadata"]["uid"]


def test_a_failed_service_apply_degrades_the_model_without_holding_its_deployment(stack, operator, stack_namespace):
    """The Service is applied beside the reconcile (``modelsync.PendingService``): when it fails, the
    Deployment is applied anyway, status says why (and the model is not Ready), and the handler's
    retry clears it once it lands."""
    ns = stack_namespace
    name = "svc-taken"
    restarts = operator_restarts(stack)
    # Someone else's ClusterIP Service already has the model's name: the operator refuses to take it
    # over (``modelsync.check_not_foreign``; a forced apply would take its selector, and the model's
    # deletion would delete it).
    taken = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
             "spec": {"selector": {"app": "elsewhere"}, "ports": [{"port": 80}]}}
    stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(taken))
    model = yaml.safe_load((EXAMPLES / "sparsemodel.yaml").read_text())
    model["metadata"]["name"] = name
    model["spec"].update(replicas=0, resources={"gpus": 0}, service={"headless": True})
    model["spec"].pop("gateConfigRef", None)  # the built-in gate: nothing else to wait for
    stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(model))

    def degraded():
        m = get_json(stack, "sparsemodel", name, "-n", ns)
        # Zero replicas: the Deployment is done at once, so only the Service keeps the model from Ready.
        return m if condition(m, "Degraded").get("reason") == "ApplyFailed" and \
            condition(m, "Ready").get("reason") == "ServiceNotApplied" else None
    m = wait_for(degraded, what="Degraded=ApplyFailed and Ready=False for the Service", timeout_s=90)
    assert condition(m, "Ready")["status"] == "False"
    message = condition(m, "Degraded")["message"]
    assert f"Service {name} already exists and is not this SparseModel's" in message, message
    assert get_json(stack, "service", name, "-n", ns)["spec"]["selector"] == {"app": "elsewhere"}
    assert m["status"]["observedGeneration"] == m["metadata"]["generation"]
    assert get_json(stack, "deployment", name, "-n", ns)["metadata"]["labels"][render.MODEL_LABEL] == name
    assert operator_restarts(stack) == restarts

    # Once the name is free, Kopf's retry of the handler creates the headless Service and status clears.
    stack.kubectl("delete", "service", name, "-n", ns)

    def recovered():
        m = get_json(stack, "sparsemodel", name, "-n", ns)
        return m if condition(m, "Degraded").get("status") == "False" else None
    m = wait_for(recovered, what="Degraded=False after the retry", timeout_s=150, interval_s=1)
    assert (condition(m, "Ready")["status"], condition(m, "Ready")["reason"]) == ("True", "ScaledToZero")
    assert get_json(stack, "service", name, "-n", ns)["spec"]["clusterIP"] == render.HEADLESS


def test_touching_a_model_puts_back_owned_objects_deleted_by_hand(stack, operator, stack_namespace):
    """The reconcile skips the ConfigMap, Service and admin-Secret check while unchanged
    (``--reapply-interval``, an hour), so the README's way to put them back at once (and to rotate
    the admin credentials: delete the Secret) is touching the SparseModel: an update with no new
    generation applies everything again."""
    ns = stack_namespace
    name = "touched"
    model = yaml.safe_load((EXAMPLES / "sparsemodel.yaml").read_text())
    model["metadata"]["name"] = name
    model["spec"].update(replicas=0, resources={"gpus": 0})
    model["spec"].pop("gateConfigRef", None)  # the built-in gate: nothing else to wait for
    stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(model))
    wait_for(ready_at_generation(stack, ns, name), what="SparseModel Ready", timeout_s=90, interval_s=0.5)
    token = get_json(stack, "secret", f"{name}-admin", "-n", ns)["data"]["token"]
    gone = [("secret", f"{name}-admin"), ("configmap", f"{name}-gate"), ("service", name)]
    for kind, obj in gone:
        stack.kubectl("delete", kind, obj, "-n", ns, "--wait=true", timeout=60)
    stack.kubectl("annotate", "sparsemodel", name, "-n", ns, "example.com/touched=1")

    def back():
        return all(stack.kubectl("get", kind, obj, "-n", ns, check=False).returncode == 0 for kind, obj in gone)
    wait_for(back, what="the deleted Secret, ConfigMap and Service to be put back", timeout_s=60, interval_s=0.5)
    assert get_json(stack, "secret", f"{name}-admin", "-n", ns)["data"]["token"] != token
    assert get_json(stack, "sparsemodel", name, "-n", ns)["metadata"]["generation"] == 1


def test_owned_objects_edited_or_deleted_by_hand_are_put_back(stack, operator, stack_namespace):
    """Nothing reconciles a model periodically and its reconciles skip the ConfigMap and Service
    while unchanged (``--reapply-interval``): what the operator owns is put back from its watch
    instead, without touching the model. A Deployment scaled by hand (its spec generation moves
    past what the operator's apply returned) is applied again with the SparseModel's replicas; a
    deleted Service or gate ConfigMap is re-created, and one edited by hand (its resourceVersion past
    what the operator's apply returned) applied again. A ``kubectl rollout restart`` annotation, or a
    label someone adds, is no field of the operator's: a later put-back keeps it (the pods are not
    restarted again), and a no-op put-back writes nothing."""
    ns = stack_namespace
    name = "drifted"
    model = yaml.safe_load((EXAMPLES / "sparsemodel.yaml").read_text())
    model["metadata"]["name"] = name
    model["spec"].update(replicas=0, resources={"gpus": 0})
    model["spec"].pop("gateConfigRef", None)  # the built-in gate: nothing else to wait for
    stack.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(model))
    wait_for(ready_at_generation(stack, ns, name), what="SparseModel Ready", timeout_s=90, interval_s=0.5)

    def replicas() -> int:
        return get_json(stack, "deployment", name, "-n", ns)["spec"]["replicas"]

    stack.kubectl("scale", "deployment", name, "-n", ns, "--replicas=2")
    wait_for(lambda: replicas() == 0, what="the Deployment scaled by hand back to the model's 0 replicas",
             timeout_s=60, interval_s=0.5)

    gone = [("configmap", f"{name}-gate"), ("service", name)]
    uids = {kind: get_json(stack, kind, obj, "-n", ns)["metadata"]["uid"] for kind, obj in gone}
    for kind, obj in gone:
        stack.kubectl("delete", kind, obj, "-n", ns, "--wait=true", timeout=60)

    def back():
        found = [stack.kubectl("get", kind, obj, "-n", ns, "-o", "json", check=False) for kind, obj in gone]
        return all(p.returncode == 0 for p in found) and \
            all(json.loads(p.stdout)["metadata"]["uid"] != uids[kind] for p, (kind, _) in zip(found, gone))
    wait_for(back, what="the deleted ConfigMap and Service to be put back", timeout_s=60, interval_s=0.5)

    stack.kubectl("rollout", "restart", f"deployment/{name}", "-n", ns)
    stack.kubectl("scale", "deployment", name, "-n", ns, "--replicas=3")
    wait_for(lambda: replicas() == 0, what="the Deployment scaled by hand again back to 0", timeout_s=60,
             interval_s=0.5)
    template = get_json(stack, "deployment", name, "-n", ns)["spec"]["template"]["metadata"]
    assert "kubectl.kubernetes.io/restartedAt" in (template.get("annotations") or {}), template

    # Edited by hand: the Service's selector (traffic goes elsewhere), the ConfigMap's gate (new
    # pods would start with it). They have no generation: their resourceVersion past the one the
    # operator's last apply returned says so, and they are applied again at the event.
    service = get_json(stack, "service", name, "-n", ns)
    configmap = get_json(stack, "configmap", f"{name}-gate", "-n", ns)
    stack.kubectl("patch", "service", name, "-n", ns, "--type=merge",
                  "-p", json.dumps({"spec": {"selector": {render.MODEL_LABEL: "elsewhere"}}}))
    stack.kubectl("patch", "configmap", f"{name}-gate", "-n", ns, "--type=merge",
                  "-p", json.dumps({"data": {render.GATE_KEY: "{}"}}))
    wait_for(lambda: get_json(stack, "service", name, "-n", ns)["spec"]["selector"] == service["spec"]["selector"]
             and get_json(stack, "configmap", f"{name}-gate", "-n", ns)["data"] == configmap["data"],
             what="the Service selector and gate ConfigMap edited by hand to be put back", timeout_s=60, interval_s=0.5)
    # A label someone else adds is theirs: it stays, and the put-back, a no-op apply, writes nothing
    # (no apply storm: the resourceVersion stays where the label put it).
    stack.kubectl("label", "service", name, "-n", ns, "team=serving")
    labelled = get_json(stack, "service", name, "-n", ns)["metadata"]
    time.sleep(3)
    now = get_json(stack, "service", name, "-n", ns)["metadata"]
    assert now["labels"].get("team") == "serving" and now["resourceVersion"] == labelled["resourceVersion"], now
    assert get_json(stack, "sparsemodel", name, "-n", ns)["metadata"]["generation"] == 1  # never touched
