"""Least privilege by default: the chart installed with its defaults, on a real API server.

Given the dev stack with chart defaults (plus the local image names), the operator serves only the
release namespace: in any other namespace (kube-system included) its ServiceAccount may neither
read a Secret nor create a Deployment. In the namespace it serves, the chart's
ValidatingAdmissionPolicy refuses its server-side apply of a ConfigMap not labelled
``app.kubernetes.io/managed-by=sparsegate`` (and its attempt to take one over by adding the label),
and its creation of a ``kubernetes.io/service-account-token`` Secret, each with the policy's message,
while it lets it patch a labelled ConfigMap; and a SparseModel there still becomes Ready, so the
operator's real writes all pass the policy.

The operator's requests are made with ``kubectl --as=system:serviceaccount:<ns>:<sa>``
(impersonation from the admin kubeconfig): the API server authorizes and admits them as that user.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from devstack import RELEASE_NS, Stack
from localcluster import nodes
from localcluster.health import wait_for
from localcluster.ports import pick_unused_pod_cidr

from sparsegate.domain import render as model_render
from sparsegate_contracts import names
from sparsegate_workload import gateparams

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[3]
UNSERVED = "not-served"
MODEL, GATE = "moe-small", "default-gate"
DENIED_BY = "ValidatingAdmissionPolicy 'sparsegate-operator-writes'"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(state_dir=tmp_path_factory.mktemp("rbac-scope"), pod_cidr=pick_unused_pod_cidr(),
              node_shape=nodes.NodeShape(count=2, gpu_count=1))
    t0 = time.monotonic()
    s.build_images()
    t_images = time.monotonic()
    try:
        s.up()  # chart defaults: no watchNamespaces, no clusterWide, admission policy on
        sys.stderr.write(f"\n[e2e] rbac-scope stack: images {t_images - t0:.1f}s, cluster+helm+operator Ready "
                         f"{time.monotonic() - t_images:.1f}s\n")
        s.kubectl("create", "namespace", UNSERVED)
        yield s
    finally:
        sys.stderr.write(f"[e2e] rbac-scope stack diagnostics:\n{s.diagnose()[-6000:]}\n")
        s.down()


@pytest.fixture(scope="module")
def operator_user(stack: Stack) -> str:
    """The user name the API server sees for the operator: its pod's ServiceAccount."""
    pod = stack.wait_operator_ready()
    return f"system:serviceaccount:{RELEASE_NS}:{pod['spec']['serviceAccountName']}"


def as_operator(stack: Stack, user: str, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return stack.kubectl(*args, f"--as={user}", input=input, check=False)


def can_i(stack: Stack, user: str, verb: str, resource: str, namespace: str) -> str:
    return as_operator(stack, user, "auth", "can-i", verb, resource, "-n", namespace).stdout.strip()


def apply_as_operator(stack: Stack, user: str, obj: dict) -> subprocess.CompletedProcess[str]:
    """What the operator does to its objects (clients.kube.Kube.apply): server-side apply as field
    manager ``sparsegate``, forcing conflicts."""
    return as_operator(stack, user, "apply", "--server-side", "--force-conflicts", "--field-manager=sparsegate",
                       "-f", "-", input=json.dumps(obj))


def configmap(name: str, *, labels: dict[str, str] | None = None, data: dict[str, str] | None = None) -> dict:
    meta: dict = {"name": name, "namespace": RELEASE_NS}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data or {}}


MANAGED = {names.MANAGED_BY_LABEL: names.MANAGED_BY}


def test_outside_the_served_namespace_the_operator_can_do_nothing(stack: Stack, operator_user: str) -> None:
    for namespace in (UNSERVED, "kube-system", "default"):
        for verb, resource in (("get", "secrets"), ("create", "secrets"), ("create", "deployments"),
                               ("patch", "configmaps"), ("list", "pods")):
            assert can_i(stack, operator_user, verb, resource, namespace) == "no", (verb, resource, namespace)
    # The same questions in the served namespace say yes: the user name above is the operator's.
    assert can_i(stack, operator_user, "get", "secrets", RELEASE_NS) == "yes"
    assert can_i(stack, operator_user, "create", "deployments", RELEASE_NS) == "yes"
    # Nothing cluster-scoped names it but reading nodes (TelemetryProbe nodeSelectors match node labels).
    sa = operator_user.rsplit(":", 1)[1]
    bindings = json.loads(stack.kubectl("get", "clusterrolebindings", "-o", "json").stdout)["items"]
    (binding,) = [b for b in bindings
                  if any(s.get("kind") == "ServiceAccount" and s.get("name") == sa for s in b.get("subjects") or [])]
    role = json.loads(stack.kubectl("get", "clusterrole", binding["roleRef"]["name"], "-o", "json").stdout)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]


def test_policy_refuses_unlabelled_configmaps_and_allows_labelled_ones(stack: Stack, operator_user: str) -> None:
    stack.kubectl("create", "configmap", "not-ours", "-n", RELEASE_NS, "--from-literal=k=v")
    stack.kubectl("create", "configmap", "ours", "-n", RELEASE_NS, "--from-literal=k=v")
    stack.kubectl("label", "configmap", "ours", "-n", RELEASE_NS, f"{names.MANAGED_BY_LABEL}={names.MANAGED_BY}")
    # RBAC alone would allow both patches (configmaps: patch in the served namespace).
    assert can_i(stack, operator_user, "patch", "configmaps", RELEASE_NS) == "yes"

    refused = apply_as_operator(stack, operator_user, configmap("not-ours", data={"k": "changed"}))
    assert refused.returncode != 0
    assert DENIED_BY in refused.stderr, refused.stderr
    assert (f"metadata.labels[{names.MANAGED_BY_LABEL}]: the sparsegate operator may only write objects labelled "
            f"{names.MANAGED_BY_LABEL}={names.MANAGED_BY}; configmaps {RELEASE_NS}/not-ours is not") in refused.stderr
    # Adding the label in the same write does not make it ours: the existing object is checked too.
    takeover = apply_as_operator(stack, operator_user, configmap("not-ours", labels=MANAGED, data={"k": "changed"}))
    assert takeover.returncode != 0 and DENIED_BY in takeover.stderr
    assert f"the existing configmaps {RELEASE_NS}/not-ours is not" in takeover.stderr, takeover.stderr
    assert stack.get("configmap", "not-ours", RELEASE_NS)["data"] == {"k": "v"}
    assert names.MANAGED_BY_LABEL not in (stack.get("configmap", "not-ours", RELEASE_NS)["metadata"].get("labels") or {})

    allowed = apply_as_operator(stack, operator_user, configmap("ours", data={"k": "changed"}))
    assert allowed.returncode == 0, allowed.stderr
    assert stack.get("configmap", "ours", RELEASE_NS)["data"] == {"k": "changed"}


def test_policy_refuses_a_service_account_token_secret(stack: Stack, operator_user: str) -> None:
    # Labelled and named like an admin Secret, so only its type breaks the rules: such a Secret
    # would make the token controller mint a token for the named ServiceAccount.
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
              "metadata": {"name": "minted-admin", "namespace": RELEASE_NS, "labels": MANAGED,
                           "annotations": {"kubernetes.io/service-account.name": "default"}}}
    assert can_i(stack, operator_user, "create", "secrets", RELEASE_NS) == "yes"  # RBAC would let it
    refused = as_operator(stack, operator_user, "create", "-f", "-", input=json.dumps(secret))
    assert refused.returncode != 0 and DENIED_BY in refused.stderr, refused.stderr
    assert (f"type: the sparsegate operator may only write Secrets of type Opaque; secrets {RELEASE_NS}/minted-admin "
            "has type kubernetes.io/service-account-token") in refused.stderr
    assert stack.kubectl("get", "secret", "minted-admin", "-n", RELEASE_NS, check=False).returncode != 0


def conditions(obj: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions") or []}


def test_a_model_in_the_served_namespace_becomes_ready_under_the_policy(stack: Stack) -> None:
    # The policy and its binding are installed and enforcing (Deny).
    binding = json.loads(stack.kubectl("get", "validatingadmissionpolicybinding", "sparsegate-operator-writes",
                                       "-o", "json").stdout)
    assert binding["spec"]["validationActions"] == ["Deny"]
    gate = yaml.safe_load((REPO / "examples" / "gateconfig.yaml").read_text())
    model = yaml.safe_load((REPO / "examples" / "sparsemodel.yaml").read_text())
    model["spec"]["replicas"] = 1
    t0 = time.monotonic()
    stack.kubectl("apply", "--server-side", "-n", RELEASE_NS, "-f", "-",
                  input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [gate, model]}))
    wait_for(lambda: conditions(stack.get("sparsemodel", MODEL, RELEASE_NS)).get("Ready") == "True",
             what=f"SparseModel {MODEL} Ready under the admission policy", timeout_s=300, interval_s=1.0)
    sys.stderr.write(f"\n[e2e] rbac-scope: SparseModel Ready {time.monotonic() - t0:.1f}s after apply\n")
    # Everything it wrote went through the policy, so carries the label and the admin shape.
    for kind, name in (("configmap", f"{MODEL}-gate"), ("service", MODEL), ("deployment", MODEL),
                       ("secret", f"{MODEL}-admin")):
        assert stack.get(kind, name, RELEASE_NS)["metadata"]["labels"][names.MANAGED_BY_LABEL] == names.MANAGED_BY
    admin = stack.get("secret", f"{MODEL}-admin", RELEASE_NS)
    assert admin["type"] == "Opaque" and set(admin["data"]) <= {"token", "tls.crt", "tls.key"}
    # The flow-policy ConfigMap the operator publishes at start (replace, else create) passed too.
    flow = wait_for(lambda: json.loads(stack.kubectl("get", "configmap", "sparsegate-flow-policy", "-n", RELEASE_NS,
                                                     "-o", "json", check=False).stdout or "null"),
                    what="flow-policy ConfigMap", timeout_s=60)
    assert flow["metadata"]["labels"][names.MANAGED_BY_LABEL] == names.MANAGED_BY
    # And none of its writes was refused on the way (a refusal is logged, then retried).
    log = stack.logs(stack.wait_operator_ready(), "operator", lines=5000)
    assert "ValidatingAdmissionPolicy" not in log and "Forbidden" not in log, log[-3000:]


def test_policy_lets_model_pods_run_as_the_tokenreview_account_and_no_other(stack: Stack, operator_user: str) -> None:
    """SparseModels with spec.access.requestAuth Enforce run as sparsegate-model-server (the chart's
    ServiceAccount with only create tokenreviews); any other named ServiceAccount is refused."""

    def deployment(sa: str) -> dict:
        labels = {**MANAGED, "app": "policy-probe"}
        return {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "policy-probe", "namespace": RELEASE_NS, "labels": labels},
                "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "policy-probe"}},
                         "template": {"metadata": {"labels": labels}, "spec": {
                             "serviceAccountName": sa, "securityContext": {"runAsNonRoot": True},
                             "containers": [{"name": "c", "image": "none"}]}}}}

    def dry_run(sa: str) -> subprocess.CompletedProcess[str]:
        return as_operator(stack, operator_user, "apply", "--server-side", "--force-conflicts", "--dry-run=server",
                           "--field-manager=sparsegate", "-f", "-", input=json.dumps(deployment(sa)))

    allowed = dry_run(names.MODEL_SERVICE_ACCOUNT)
    assert allowed.returncode == 0, allowed.stderr
    refused = dry_run("cluster-admin-ish")
    assert refused.returncode != 0 and DENIED_BY in refused.stderr, refused.stderr
    assert ("may only run pods as their namespace default ServiceAccount or sparsegate-model-server; "
            f"deployments {RELEASE_NS}/policy-probe names cluster-admin-ish") in refused.stderr, refused.stderr
    # The chart created it here, with the one verb.
    user = f"system:serviceaccount:{RELEASE_NS}:{names.MODEL_SERVICE_ACCOUNT}"
    assert can_i(stack, user, "create", "tokenreviews.authentication.k8s.io", RELEASE_NS) == "yes"
    assert can_i(stack, user, "get", "secrets", RELEASE_NS) == "no"


def test_policy_refuses_pods_with_more_privilege_than_a_model_server(stack: Stack, operator_user: str) -> None:
    """What render.py produces (Pod Security restricted) passes; the same Deployment running as root,
    adding a capability, allowing privilege escalation or opening a port on the node is refused, each
    naming its field (none of it is privileged, hostPath or a host namespace, which were the only
    container rules before)."""
    model = {"metadata": {"name": "policy-privilege", "namespace": RELEASE_NS, "uid": "u"},
             "spec": {"model": {"dModel": 64, "experts": 4}, "replicas": 0, "servingPort": 80}}
    rendered = model_render.render_deployment(model, gateparams.make_document(gateparams.DEFAULT_PARAMS))
    rendered["metadata"].pop("ownerReferences", None)

    def dry_run(change: Callable[[dict, dict], object]) -> subprocess.CompletedProcess[str]:
        obj = json.loads(json.dumps(rendered))
        pod = obj["spec"]["template"]["spec"]
        change(pod, pod["containers"][0])
        return as_operator(stack, operator_user, "apply", "--server-side", "--force-conflicts", "--dry-run=server",
                           "--field-manager=sparsegate", "-f", "-", input=json.dumps(obj))

    allowed = dry_run(lambda pod, c: None)
    assert allowed.returncode == 0, allowed.stderr
    what = f"deployments {RELEASE_NS}/policy-privilege"
    container_rule = ("spec.template.spec.containers[].securityContext: the sparsegate operator may not run "
                      f"containers as root, with added capabilities or with privilege escalation; {what} does")
    for change, message in (
        (lambda pod, c: pod["securityContext"].pop("runAsNonRoot"),
         "spec.template.spec.securityContext.runAsNonRoot: the sparsegate operator may only run pods with "
         f"runAsNonRoot true; {what} does not"),
        (lambda pod, c: c["securityContext"].update(runAsNonRoot=False), container_rule),
        (lambda pod, c: c["securityContext"].update(runAsUser=0), container_rule),
        (lambda pod, c: c["securityContext"]["capabilities"].update(add=["NET_ADMIN"]), container_rule),
        (lambda pod, c: c["securityContext"].update(allowPrivilegeEscalation=True), container_rule),
        (lambda pod, c: c["ports"][0].update(hostPort=8080),
         f"spec.template.spec.containers[].ports[].hostPort: the sparsegate operator may not open ports on the "
         f"node; {what} does"),
    ):
        refused = dry_run(change)
        assert refused.returncode != 0 and DENIED_BY in refused.stderr, refused.stderr
        assert message in " ".join(refused.stderr.split()), refused.stderr
