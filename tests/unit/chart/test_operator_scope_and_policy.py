"""The operator's scope (Roles per served namespace by default, cluster-wide only when asked) and
the ValidatingAdmissionPolicy that limits its writes, rendered by the real helm binary.

The policy's CEL runs in the API server; tests/e2e/install/test_rbac_scope.py exercises it there.
Here: what the chart renders, and that it agrees with the names and objects the operator writes.
"""

from __future__ import annotations

import ast
import subprocess

import pytest
from test_helm_chart import BIN, CHART, containers, render

from sparsegate import cli
from sparsegate.clients import kube
from sparsegate.domain import render as model_render
from sparsegate_contracts import names
from sparsegate_workload import gateparams

RELEASE_NS = "sg-system"  # what test_helm_chart.render installs into
OPERATOR_SA = "rel-sparsegate-operator"
CLUSTER_WIDE = ("--set", "operator.clusterWide=true")
# The one cluster-scoped grant in every scope: read nodes (TelemetryProbe nodeSelectors match their labels).
NODES_ROLE = "rel-sparsegate-operator-nodes"
# Model servers that enforce callers: create tokenreviews, bound to sparsegate-model-server per served namespace.
TOKENREVIEW_ROLE = "rel-sparsegate-model-tokenreview"


def helm_error(*args: str) -> str:
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    proc = subprocess.run([str(exe), "template", "rel", str(CHART), "--namespace", RELEASE_NS, *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, f"helm template {args} rendered"
    return proc.stderr


def of_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [d for d in docs if d["kind"] in kinds]


def without_nodes_role(docs: list[dict]) -> list[dict]:
    nodes = [d for d in docs if d["metadata"]["name"] == NODES_ROLE]
    assert [d["kind"] for d in nodes] == ["ClusterRole", "ClusterRoleBinding"]
    assert nodes[0]["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    return without_tokenreview_role([d for d in docs if d["metadata"]["name"] != NODES_ROLE])


def without_tokenreview_role(docs: list[dict]) -> list[dict]:
    """Drop the model servers' ClusterRole (only create tokenreviews) and its binding, checked here."""
    grant = [d for d in docs if d["metadata"]["name"] == TOKENREVIEW_ROLE]
    assert [d["kind"] for d in grant] == ["ClusterRole", "ClusterRoleBinding"]
    assert grant[0]["rules"] == [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                                  "verbs": ["create"]}]
    assert {s["name"] for s in grant[1]["subjects"]} == {names.MODEL_SERVICE_ACCOUNT}
    return [d for d in docs if d["metadata"]["name"] != TOKENREVIEW_ROLE]


def operator_args(docs: list[dict]):
    return cli._parser().parse_args(containers(docs, "Deployment")["operator"]["args"])


def workload_rules(docs: list[dict]) -> list[dict]:
    """The rules of the Role(s)/ClusterRole that serve models (not the release-namespace Role)."""
    (rules, *others) = [d["rules"] for d in of_kind(docs, "Role", "ClusterRole")
                        if d["metadata"]["name"] == "rel-sparsegate-operator"]
    assert all(o == rules for o in others)  # one set of rules, whatever the namespace
    return rules


# --- scope ------------------------------------------------------------------------------------

def test_default_serves_only_the_release_namespace_with_a_role():
    docs = without_nodes_role(render())
    assert not of_kind(docs, "ClusterRole", "ClusterRoleBinding")  # nothing else cluster-scoped grants
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in of_kind(docs, "Role")}
    assert roles == {(RELEASE_NS, "rel-sparsegate-operator"), (RELEASE_NS, "rel-sparsegate-operator-release")}
    for binding in of_kind(docs, "RoleBinding"):
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": binding["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": RELEASE_NS}]
    args = operator_args(docs)
    assert args.namespace == [RELEASE_NS] and not args.all_namespaces


def test_watch_namespaces_get_a_role_each_and_a_namespace_flag_each():
    docs = render("namespaced-values.yaml")
    served = sorted(d["metadata"]["namespace"] for d in of_kind(docs, "Role")
                    if d["metadata"]["name"] == "rel-sparsegate-operator")
    assert served == ["ml", "staging"]
    assert operator_args(docs).namespace == ["ml", "staging"]
    # The release namespace keeps its own Role (flow-policy ConfigMap; no Lease without election).
    (release,) = [d for d in of_kind(docs, "Role") if d["metadata"]["name"] == "rel-sparsegate-operator-release"]
    assert release["metadata"]["namespace"] == RELEASE_NS
    assert {r for rule in release["rules"] for r in rule["resources"]} == {"configmaps"}


def test_serving_the_release_namespace_too_renders_no_duplicate_objects():
    docs = render(None, "--set", f"operator.watchNamespaces={{ml,{RELEASE_NS}}}")
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), keys
    assert operator_args(docs).namespace == ["ml", RELEASE_NS]


def test_cluster_wide_is_an_explicit_value_with_the_same_rules():
    docs = without_nodes_role(render(None, *CLUSTER_WIDE))
    (role,) = of_kind(docs, "ClusterRole")
    (binding,) = of_kind(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": RELEASE_NS}]
    assert role["rules"] == workload_rules(render())  # what a served namespace gets, everywhere
    args = operator_args(docs)
    assert args.all_namespaces and args.namespace == []
    # No workload Role alongside it; the release-namespace Role stays.
    assert [d["metadata"]["name"] for d in of_kind(docs, "Role")] == ["rel-sparsegate-operator-release"]


def test_contradictory_scope_fails_to_render():
    err = helm_error(*CLUSTER_WIDE, "--set", "operator.watchNamespaces={ml}")
    assert "operator.watchNamespaces" in err and "operator.clusterWide" in err
    # A namespace listed twice would render its Role twice: the schema refuses it.
    err = helm_error("--set", "operator.watchNamespaces={ml,ml}")
    assert "/operator/watchNamespaces" in err and "are equal" in err


def test_owner_checks_can_read_replicasets_in_served_namespaces():
    rules = workload_rules(render())
    (rs,) = [r for r in rules if "replicasets" in r["resources"]]
    assert rs["apiGroups"] == ["apps"] and sorted(rs["verbs"]) == ["get", "list", "watch"]


def test_a_models_first_apply_can_read_the_service_and_configmap_of_its_name():
    """``modelsync.check_not_foreign`` reads them before the first apply (a user's is refused, not
    taken over): without get every new model's reconcile failed with 403 Forbidden."""
    rules = workload_rules(render())
    (rule,) = [r for r in rules if "services" in r["resources"]]
    assert set(rule["resources"]) == {"services", "configmaps"} and "get" in rule["verbs"]


def test_rbac_off_renders_no_rbac_but_keeps_the_scope_flags():
    docs = render(None, "--set", "operator.rbac.create=false")
    assert not of_kind(docs, "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    assert operator_args(docs).namespace == [RELEASE_NS]


# --- the admission policy ---------------------------------------------------------------------

def policy_and_binding(docs: list[dict]) -> tuple[dict, dict]:
    (policy,) = of_kind(docs, "ValidatingAdmissionPolicy")
    (binding,) = of_kind(docs, "ValidatingAdmissionPolicyBinding")
    return policy, binding


def variable(policy: dict, name: str) -> str:
    (expr,) = [v["expression"] for v in policy["spec"]["variables"] if v["name"] == name]
    return expr


@pytest.mark.parametrize("scope", [(), CLUSTER_WIDE], ids=["namespaced", "cluster-wide"])
def test_policy_is_on_by_default_and_matches_only_the_operators_service_account(scope):
    docs = render(None, *scope)
    policy, binding = policy_and_binding(docs)
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    (dep,) = of_kind(docs, "Deployment")  # the pod's ServiceAccount is the one the policy names
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == OPERATOR_SA
    (cond,) = policy["spec"]["matchConditions"]
    assert cond["expression"] == f"request.userInfo.username == 'system:serviceaccount:{RELEASE_NS}:{OPERATOR_SA}'"


def test_policy_covers_exactly_the_core_kinds_the_operator_writes():
    policy, _ = policy_and_binding(render())
    matched = {(g, r) for rule in policy["spec"]["matchConstraints"]["resourceRules"]
               for g in rule["apiGroups"] for r in rule["resources"]}
    for rule in policy["spec"]["matchConstraints"]["resourceRules"]:
        assert rule["operations"] == ["CREATE", "UPDATE", "DELETE"] and rule["apiVersions"] == ["*"]
    # The kinds the operator's client writes, less its own API group (Kopf's annotations, status)
    # and the Lease: every one of them is covered, and nothing else is.
    written = {("" if gv == "v1" else gv.split("/")[0], plural) for kind, (gv, plural) in kube.WRITTEN_KINDS.items()
               if not gv.startswith(names.GROUP) and kind != "Lease"}
    assert matched == written == {("", "configmaps"), ("", "services"), ("", "secrets"), ("apps", "deployments")}


def test_policy_speaks_the_operators_label_and_admin_secret_shape():
    policy, _ = policy_and_binding(render())
    text = str(policy["spec"]["validations"])
    assert f"'{names.MANAGED_BY_LABEL}'" in text and f"== '{names.MANAGED_BY}'" in text
    admin_keys = ast.literal_eval(variable(policy, "adminKeys"))
    assert set(admin_keys) == {"token", "tls.crt", "tls.key"}
    assert model_render.ADMIN_TOKEN_KEY in admin_keys
    suffix = model_render.admin_secret_name("m").removeprefix("m")
    assert f"endsWith('{suffix}')" in text
    assert "object.type == 'Opaque'" in text


def test_every_rule_has_a_message_naming_its_field():
    policy, _ = policy_and_binding(render())
    for v in policy["spec"]["validations"]:
        assert v["reason"] == "Forbidden"
        field, _, rule = v["messageExpression"].strip("'").partition(": ")
        assert field.split("[")[0].split("/")[0] in {"metadata.labels", "type", "metadata.name", "data",
                                                     "spec.template.spec.serviceAccountName",
                                                     "spec.template.spec.volumes",
                                                     "spec.template.spec.hostNetwork",
                                                     "spec.template.spec.securityContext.runAsNonRoot",
                                                     "spec.template.spec.containers"}, v
        assert rule.startswith("the sparsegate operator may"), v


def test_what_the_operator_renders_passes_the_deployment_rules():
    """The policy forbids only what render.py never produces: checked on a GPU and a CPU model."""
    doc = gateparams.make_document(gateparams.DEFAULT_PARAMS)
    for gpus in (0, 2):
        model = {"metadata": {"name": "m", "namespace": "ml", "uid": "u"},
                 "spec": {"model": {"dModel": 64, "experts": 4}, "resources": {"gpus": gpus}}}
        for obj in model_render.render_applied(model, doc):
            assert obj["metadata"]["labels"][names.MANAGED_BY_LABEL] == names.MANAGED_BY
            if obj["kind"] != "Deployment":
                continue
            pod = obj["spec"]["template"]["spec"]
            # Empty: the namespace's default ServiceAccount (render.py sets both fields empty).
            assert pod.get("serviceAccountName", "") in ("", "default") and pod.get("serviceAccount", "") == ""
            enforcing = model_render.render_deployment({**model, "spec": {**model["spec"], "access": {
                "requestAuth": names.REQUEST_AUTH_ENFORCE}}}, doc)["spec"]["template"]["spec"]
            assert enforcing["serviceAccountName"] == names.MODEL_SERVICE_ACCOUNT
            assert not [v for v in pod.get("volumes", []) if "hostPath" in v]
            assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
            assert not any((c.get("securityContext") or {}).get("privileged")
                           for c in pod["containers"] + pod.get("initContainers", []))
            # Never root, no capability added, no privilege escalation, no port on the node.
            assert pod["securityContext"]["runAsNonRoot"] is True
            for c in pod["containers"] + pod.get("initContainers", []):
                sc = c.get("securityContext") or {}
                assert sc.get("runAsNonRoot", True) and sc.get("runAsUser", 1) != 0
                assert sc.get("allowPrivilegeEscalation") is False and not (sc.get("capabilities") or {}).get("add")
                assert not any(p.get("hostPort") for p in c.get("ports", []))


def test_policy_can_be_turned_off_or_only_audit():
    assert not of_kind(render(None, "--set", "operator.admissionPolicy.enabled=false"),
                       "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    _, binding = policy_and_binding(render(None, "--set", "operator.admissionPolicy.validationActions={Audit}"))
    assert binding["spec"]["validationActions"] == ["Audit"]
    assert "Deny and Warn" in helm_error("--set", "operator.admissionPolicy.validationActions={Deny,Warn}")
    assert "validationActions" in helm_error("--set", "operator.admissionPolicy.validationActions={Block}")


# --- model servers' TokenReview grant -------------------------------------------------------------

def test_model_service_account_in_each_served_namespace_may_only_create_tokenreviews():
    docs = render(None, "--set", "operator.watchNamespaces={ml,team-b}")
    accounts = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in of_kind(docs, "ServiceAccount")
                if d["metadata"]["name"] == names.MODEL_SERVICE_ACCOUNT}
    assert accounts == {("ml", names.MODEL_SERVICE_ACCOUNT), ("team-b", names.MODEL_SERVICE_ACCOUNT)}
    (binding,) = [d for d in of_kind(docs, "ClusterRoleBinding") if d["metadata"]["name"] == TOKENREVIEW_ROLE]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": TOKENREVIEW_ROLE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": names.MODEL_SERVICE_ACCOUNT, "namespace": ns}
                                   for ns in ("ml", "team-b")]
    without_tokenreview_role(docs)  # its rules: create tokenreviews, nothing else


def test_policy_admits_only_the_two_service_accounts_the_operator_renders():
    policy, _ = policy_and_binding(render())
    (rule,) = [v["expression"] for v in policy["spec"]["validations"] if "serviceAccountName" in v["expression"]]
    assert f"'{names.MODEL_SERVICE_ACCOUNT}'" in rule and "['', 'default', 'sparsegate-model-server']" in rule


def test_model_tokenreview_rbac_can_be_turned_off():
    docs = render(None, "--set", "modelServer.requestAuth.rbac=false")
    assert not [d for d in docs if d["metadata"]["name"] in (TOKENREVIEW_ROLE, names.MODEL_SERVICE_ACCOUNT)]
