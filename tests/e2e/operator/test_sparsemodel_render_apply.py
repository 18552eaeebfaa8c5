"""What the operator renders for a SparseModel, server-side applied to a real API server as the
operator applies it (field manager sparsegate, force), without the operator or the dev stack: the
session's plain control plane is enough to see what the API server makes of a rendered change.
"""

from __future__ import annotations

import copy
import json

from sparsegate.clients.kube import Kube
from sparsegate.domain import render
from sparsegate_contracts import names
from sparsegate_workload import gateparams

DOC = gateparams.make_document(gateparams.DEFAULT_PARAMS)


def _model(namespace: str, **spec) -> dict:
    return {"metadata": {"name": "m", "namespace": namespace, "uid": "0b7c1f6e-1111-2222-3333-444455556666",
                         "generation": 1},
            "spec": {"replicas": 0, "model": {"dModel": 8, "experts": 2}, **spec}}


def _deployment(model: dict) -> dict:
    """The rendered Deployment without its owner reference: no SparseModel of that uid exists
    here, and the garbage collector would delete the Deployment from under the test."""
    dep = render.render_deployment(model, DOC)
    del dep["metadata"]["ownerReferences"]
    return dep


def _pod_spec(cluster, namespace: str) -> dict:
    dep = json.loads(cluster.kubectl("get", "deployment", "m", "-n", namespace, "-o", "json").stdout)
    return dep["spec"]["template"]["spec"]


def test_leaving_request_auth_enforce_moves_the_pods_off_the_tokenreview_service_account(cluster, namespace):
    kube = Kube.from_kubeconfig(str(cluster.kubeconfig))
    enforcing = _model(namespace, access={"requestAuth": "Enforce"})
    kube.apply(_deployment(enforcing))
    assert _pod_spec(cluster, namespace)["serviceAccountName"] == names.MODEL_SERVICE_ACCOUNT

    off = copy.deepcopy(enforcing)
    off["spec"]["access"] = {"requestAuth": "Off"}
    kube.apply(_deployment(off))
    pod = _pod_spec(cluster, namespace)
    # Neither the field nor its deprecated alias the API server filled in keeps the old name.
    assert pod.get("serviceAccountName", "") == "" and pod.get("serviceAccount", "") == "", pod
    assert "automountServiceAccountToken" not in pod

    # Applying the same rendering again writes nothing.
    before = json.loads(cluster.kubectl("get", "deployment", "m", "-n", namespace, "-o", "json").stdout)
    kube.apply(_deployment(off))
    after = json.loads(cluster.kubectl("get", "deployment", "m", "-n", namespace, "-o", "json").stdout)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_cpu_and_memory_requests_and_limits_reach_the_deployment_and_reapply_writes_nothing(cluster, namespace):
    """spec.resources requests/limits as a user may spell them (integers, millicores): the API
    server keeps them beside nvidia.com/gpu (1000m as 1), the pod they make is Burstable (so not
    evicted first), the operator's next apply of the same rendering is a no-op, and unsetting
    them removes them."""
    kube = Kube.from_kubeconfig(str(cluster.kubeconfig))
    model = _model(namespace, resources={"gpus": 1, "requests": {"cpu": "250m", "memory": 268435456},
                                         "limits": {"cpu": "1000m", "memory": "512Mi"}})
    dep = _deployment(model)
    kube.apply(dep)
    (container,) = _pod_spec(cluster, namespace)["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "250m", "memory": "268435456", "nvidia.com/gpu": "1"},
        "limits": {"cpu": "1", "memory": "512Mi", "nvidia.com/gpu": "1"}}
    before = json.loads(cluster.kubectl("get", "deployment", "m", "-n", namespace, "-o", "json").stdout)
    kube.apply(_deployment(model))
    after = json.loads(cluster.kubectl("get", "deployment", "m", "-n", namespace, "-o", "json").stdout)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m-probe", "namespace": namespace},
           "spec": dep["spec"]["template"]["spec"]}
    out = cluster.kubectl("create", "--dry-run=server", "-f", "-", "-o", "json", input=json.dumps(pod), check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"]["qosClass"] == "Burstable"

    # Unset again: the operator's apply no longer owns them, so the API server drops them.
    kube.apply(_deployment(_model(namespace, resources={"gpus": 1})))
    (container,) = _pod_spec(cluster, namespace)["containers"]
    assert container["resources"] == {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}


def test_a_privileged_serving_port_renders_a_pod_that_pod_security_restricted_admits(cluster, namespace):
    """servingPort 80: the pod's sysctl that lets the non-root server bind it is one the API
    server's PodSecurity admission allows at restricted (the level the chart documents)."""
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    kube = Kube.from_kubeconfig(str(cluster.kubeconfig))
    dep = _deployment(_model(namespace, servingPort=80))
    kube.apply(dep)
    assert _pod_spec(cluster, namespace)["securityContext"]["sysctls"] == [
        {"name": "net.ipv4.ip_unprivileged_port_start", "value": "80"}]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m-probe", "namespace": namespace,
                                                           "labels": dep["spec"]["template"]["metadata"]["labels"]},
           "spec": dep["spec"]["template"]["spec"]}
    out = cluster.kubectl("create", "--dry-run=server", "-f", "-", "-o", "json", input=json.dumps(pod), check=False)
    assert out.returncode == 0, out.stderr


def test_an_hpa_can_target_a_sparsemodel_through_its_scale_subresource(cluster, namespace):
    """The chart's SparseModel CRD on the plain control plane, status written as a reconcile writes
    it: the scale subresource serves the pods' selector, so the controller-manager's HPA gets past
    it (without one: ScalingActive False, InvalidSelector "the HPA target's scale is missing a
    selector"); here it stops at the missing metrics API instead."""
    import time
    from pathlib import Path

    from sparsegate.domain import gate, model_status

    crd = Path(__file__).resolve().parents[3] / "charts" / "sparsegate" / "crds" / "sparsemodels.yaml"
    cluster.kubectl("apply", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "crd/sparsemodels.sparsegate.dev", "--timeout=60s")
    model = {"apiVersion": f"{names.GROUP}/{names.VERSION}", "kind": "SparseModel",
             "metadata": {"name": "m", "namespace": namespace},
             "spec": {"replicas": 1, "model": {"dModel": 8, "experts": 2}}}
    model = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(model)).stdout)
    kube = Kube.from_kubeconfig(str(cluster.kubeconfig))
    resolution = gate.resolve(None, referenced=False, num_experts=2)
    kube.update_status("SparseModel", namespace=namespace, name="m", current=model,
                       mutate=lambda current: model_status.after_reconcile(
                           model=current, generation=1, gate=resolution, deployment=None, apply_error=None,
                           now="2026-01-01T00:00:00Z"))
    scale = json.loads(cluster.kubectl("get", "--raw", f"/apis/{names.GROUP}/{names.VERSION}/namespaces/"
                                       f"{namespace}/sparsemodels/m/scale").stdout)
    assert scale["status"].get("selector") == "app.kubernetes.io/name=sparsegate-model,sparsegate.dev/model=m", scale
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "m", "namespace": namespace},
           "spec": {"scaleTargetRef": {"apiVersion": f"{names.GROUP}/{names.VERSION}", "kind": "SparseModel",
                                       "name": "m"},
                    "minReplicas": 1, "maxReplicas": 3,
                    "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                        "type": "Utilization", "averageUtilization": 50}}}]}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(hpa))
    deadline, active = time.monotonic() + 90, None
    while active is None:
        assert time.monotonic() < deadline, "the HPA controller never judged the SparseModel's scale"
        got = json.loads(cluster.kubectl("get", "hpa", "m", "-n", namespace, "-o", "json").stdout)
        active = next((c for c in (got.get("status") or {}).get("conditions") or []
                       if c["type"] == "ScalingActive"), None)
        time.sleep(1)
    assert active["reason"] != "InvalidSelector", active
