"""The chart through the real helm binary: lint, render every scenario, least-privilege RBAC.

Fails (never skips) when helm is missing: build it with dev/setup/binaries.sh helm.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from podsecurity import restricted_violations

from sparsegate import cli
from sparsegate.domain.render import DefaultImage

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "sparsegate"
BIN = Path(os.environ.get("SPARSEGATE_BIN", Path.home() / ".cache" / "sparsegate" / "bin"))
SCENARIOS = [None, *sorted(p.name for p in (CHART / "ci").glob("*.yaml"))]


def helm(*args: str) -> str:
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}: run dev/setup/binaries.sh helm"
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def render(values: str | None = None, *extra: str) -> list[dict]:
    args = ["template", "rel", str(CHART), "--namespace", "sg-system", *extra]
    if values:
        args += ["-f", str(CHART / "ci" / values)]
    return [d for d in yaml.safe_load_all(helm(*args)) if d]


@pytest.mark.parametrize("values", SCENARIOS)
def test_lint(values):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(CHART / "ci" / values)] if values else [])
    assert "0 chart(s) failed" in helm(*args)


def containers(docs: list[dict], kind: str) -> dict[str, dict]:
    """The containers of the one object of ``kind`` (Deployment, DaemonSet), by name, in order."""
    (obj,) = [d for d in docs if d["kind"] == kind]
    return {c["name"]: c for c in obj["spec"]["template"]["spec"]["containers"]}


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("values", SCENARIOS)
def test_operator_args_are_accepted_by_the_cli(values):
    container = containers(render(values), "Deployment")["operator"]
    assert container["command"] == ["sparsegate"]
    args = cli._parser().parse_args(container["args"])  # the chart and the CLI agree
    assert args.command == "run" and args.standalone
    assert args.liveness.endswith(f":{container['ports'][0]['containerPort']}/healthz")
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_agent_is_off_by_default_and_follows_the_contract_when_on():
    assert not [d for d in render() if d["kind"] == "DaemonSet"]
    (ds,) = [d for d in render("agent-values.yaml") if d["kind"] == "DaemonSet"]
    cmd = ds["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:3] == ["python", "-m", "sparsegate_ebpf.agent"]
    assert "--interfaces=eth0,eth1" in cmd and "--metrics-port=9102" in cmd
    assert "--policy-configmap=sg-system/sparsegate-flow-policy" in cmd


@pytest.mark.parametrize("scope", [(), ("--set", "operator.clusterWide=true")], ids=["namespaced", "cluster-wide"])
def test_rbac_is_least_privilege(scope):
    docs = render(None, *scope)
    roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"])
            if "secrets" in rule["resources"]:
                assert not {"list", "watch", "patch"} & set(rule["verbs"])  # never enumerated
    resources = {r for role in roles for rule in role["rules"] for r in rule["resources"]}
    assert "customresourcedefinitions" not in resources and "namespaces" not in resources


def test_namespaced_mode_binds_per_namespace():
    docs = render("namespaced-values.yaml")
    bindings = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "rel-sparsegate-operator"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "staging"]
    assert {b["roleRef"]["kind"] for b in bindings} == {"Role"}
    # Nothing cluster-wide but reading nodes (cluster-scoped: TelemetryProbe nodeSelectors are matched
    # against their labels) and the model servers' create tokenreviews (cluster-scoped too).
    cluster = [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    assert {d["metadata"]["name"] for d in cluster} == {"rel-sparsegate-operator-nodes",
                                                        "rel-sparsegate-model-tokenreview"}
    roles = {d["metadata"]["name"]: d["rules"] for d in cluster if d["kind"] == "ClusterRole"}
    assert roles == {
        "rel-sparsegate-operator-nodes": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}],
        "rel-sparsegate-model-tokenreview": [{"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
                                              "verbs": ["create"]}]}
    (tokenreview,) = [d for d in cluster if d["kind"] == "ClusterRoleBinding"
                      and d["metadata"]["name"] == "rel-sparsegate-model-tokenreview"]
    assert [(s["namespace"], s["name"]) for s in tokenreview["subjects"]] == [
        ("ml", "sparsegate-model-server"), ("staging", "sparsegate-model-server")]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # no Lease: never two at once


def test_schema_rejects_bad_values():
    exe = BIN / "helm"
    assert exe.exists(), f"helm not found at {exe}"
    bad = subprocess.run([str(exe), "template", "rel", str(CHART), "--set", "operator.replicas=-1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "replicas" in bad.stderr


def test_every_value_is_documented():
    """argo-helm style: a `# --` comment documents every value in values.yaml.

    A documented key is one value even if it is a map (e.g. resources); an undocumented map
    is only a grouping, and then each of its children needs its own comment.
    """
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented, inside_value = [], None
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w-]*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        if inside_value is not None and indent > inside_value:
            continue  # part of a documented map value
        inside_value = None
        documented = i > 0 and lines[i - 1].strip().startswith("#") and any(
            lines[j].strip().startswith("# --")
            for j in range(i - 1, -1, -1)
            if lines[j].strip().startswith("#") and all(lines[k].strip().startswith("#")
                                                       for k in range(j, i)))
        if documented:
            inside_value = indent
            continue
        nxt = next((x for x in lines[i + 1:] if x.strip() and not x.strip().startswith("#")), "")
        if not rest and len(nxt) - len(nxt.lstrip()) > indent:
            continue  # a grouping: its children are checked one by one
        undocumented.append(key)
    assert undocumented == []


# --- listeners bind the pod IP (pods may share one network namespace) ------------------------

VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@pytest.mark.parametrize("values", SCENARIOS)
def test_every_listener_binds_the_pod_ip(values):
    docs = render(values)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    for obj in workloads:
        for c in obj["spec"]["template"]["spec"]["containers"]:
            argv = [*c.get("command", []), *c.get("args", [])]
            assert not [a for a in argv if "0.0.0.0" in a or "127.0.0.1" in a], (c["name"], argv)
            assert any("$(POD_IP)" in a for a in argv), (c["name"], argv)  # every container listens
            assert env_of(c)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            # Kubernetes expands $(VAR) only from the container's own env, and in an env value only
            # from variables defined before it.
            names = [e["name"] for e in c.get("env", [])]
            for a in argv:
                assert set(VAR_REF.findall(a)) <= set(names), (c["name"], a)
            for i, e in enumerate(c.get("env", [])):
                assert set(VAR_REF.findall(str(e.get("value", "")))) <= set(names[:i]), e
    op = containers(docs, "Deployment")["operator"]
    assert "--liveness=http://$(POD_IP):8081/healthz" in op["args"]
    assert "--metrics-address=$(POD_IP)" in op["args"] and "--metrics-port=9090" in op["args"]
    assert cli._parser().parse_args(op["args"]).metrics_address == "$(POD_IP)"


# --- OPA sidecar and the bearer token -------------------------------------------------------


def opa_token_secret(docs: list[dict]) -> dict:
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-opa-token")]
    return secret


def test_opa_is_a_sidecar_by_default_listening_on_the_pod_ip_with_token_auth():
    docs = render()
    pod = [d for d in docs if d["kind"] == "Deployment"][0]["spec"]["template"]["spec"]
    byname = containers(docs, "Deployment")
    assert list(byname) == ["opa", "operator"]  # OPA first
    opa, op = byname["opa"], byname["operator"]
    assert opa["image"] == "ghcr.io/sparsegate/opa:1.22.4" and "command" not in opa  # entrypoint opa
    assert opa["args"][:2] == ["run", "--server"]
    for flag in ("--addr=$(POD_IP):8181", "--authentication=token", "--authorization=basic"):
        assert flag in opa["args"]
    assert opa["args"][-1] == "/policies/opa-authz.rego"
    (mount,) = opa["volumeMounts"]
    assert (mount["mountPath"], mount["readOnly"]) == ("/policies", True)
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == vol["configMap"]["name"]]
    assert cm["data"] == {"opa-authz.rego": (CHART / "files" / "opa-authz.rego").read_text()}
    # probes: /health is the one path system.authz leaves open
    assert [p["containerPort"] for p in opa["ports"] if p["name"] == "opa"] == [8181]
    for probe in ("readinessProbe", "livenessProbe"):
        assert opa[probe]["httpGet"] == {"path": "/health", "port": "opa"}
    sc = opa["securityContext"]
    assert (sc["runAsUser"], sc["runAsNonRoot"], sc["readOnlyRootFilesystem"]) == (65532, True, True)
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
    # the token: one Secret, read by both containers under the name the authz policy reads
    secret = opa_token_secret(docs)
    ref = {"name": secret["metadata"]["name"], "key": "token"}
    assert env_of(opa)["SPARSEGATE_OPA_TOKEN"]["valueFrom"] == {"secretKeyRef": ref}
    assert env_of(op)["SPARSEGATE_OPA_TOKEN"]["valueFrom"] == {"secretKeyRef": ref}
    assert "opa.runtime().env.SPARSEGATE_OPA_TOKEN" in cm["data"]["opa-authz.rego"]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    assert env_of(op)["SPARSEGATE_OPA_URL"]["value"] == "http://$(POD_IP):8181"
    # a changed authz policy rolls the pod (OPA reads it at start only)
    assert [d for d in docs if d["kind"] == "Deployment"][0]["spec"]["template"]["metadata"][
        "annotations"]["checksum/opa-authz"]


def test_opa_gets_its_go_collector_settings_and_they_can_be_removed():
    """GOGC / GOMEMLIMIT for the OPA sidecar (bench_opa starts OPA with the same values), under the
    container's memory limit; empty values render nothing; malformed ones are refused."""
    opa = containers(render(), "Deployment")["opa"]
    env = env_of(opa)
    assert (env["GOGC"]["value"], env["GOMEMLIMIT"]["value"]) == ("400", "230MiB")
    assert opa["resources"]["limits"]["memory"] == "256Mi"  # the soft limit stays ~10 % under it
    bare = env_of(containers(render(None, "--set", "opa.gogc=", "--set", "opa.goMemLimit="), "Deployment")["opa"])
    assert "GOGC" not in bare and "GOMEMLIMIT" not in bare
    for bad in ("opa.gogc=fast", "opa.goMemLimit=lots"):
        proc = subprocess.run([str(BIN / "helm"), "template", "rel", str(CHART), "--set", bad],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and bad.split("=")[0].split(".")[1] in proc.stderr, proc.stderr


def test_opa_token_is_random_per_install_and_an_existing_secret_replaces_it():
    assert opa_token_secret(render())["data"] != opa_token_secret(render())["data"]  # no lookup here
    docs = render(None, "--set", "opa.auth.existingSecret=mine", "--set", "opa.auth.existingSecretKey=k")
    assert not [d for d in docs if d["kind"] == "Secret"]
    for c in containers(docs, "Deployment").values():
        assert env_of(c)["SPARSEGATE_OPA_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "mine", "key": "k"}}


def test_external_opa_has_no_sidecar():
    docs = render("external-opa-values.yaml")
    assert list(containers(docs, "Deployment")) == ["operator"]
    assert not [d for d in docs if d["kind"] in ("Secret", "ConfigMap")]
    env = env_of(containers(docs, "Deployment")["operator"])
    assert env["SPARSEGATE_OPA_URL"]["value"] == "https://opa.policy-system.svc:8181"
    assert env["SPARSEGATE_OPA_TOKEN"]["valueFrom"] == {
        "secretKeyRef": {"name": "opa-client-token", "key": "bearer"}}
    # without a token Secret nothing is sent
    docs = render(None, "--set", "opa.enabled=false")
    assert "SPARSEGATE_OPA_TOKEN" not in env_of(containers(docs, "Deployment")["operator"])
    assert env_of(containers(docs, "Deployment")["operator"])["SPARSEGATE_OPA_URL"]["value"] == "http://127.0.0.1:8181"


# --- images -------------------------------------------------------------------------------------


def test_default_images_and_the_model_server_default_passed_to_the_operator():
    byname = containers(render(), "Deployment")
    assert byname["operator"]["image"] == "ghcr.io/sparsegate/operator:0.1.0"
    env = env_of(byname["operator"])
    assert env["SPARSEGATE_MODEL_IMAGE"]["value"] == "ghcr.io/sparsegate/model-server:0.1.0"
    assert env["SPARSEGATE_MODEL_IMAGE_PULL_POLICY"]["value"] == "IfNotPresent"


def test_local_images_are_never_pulled():
    docs = render("local-images-values.yaml", "--set", "agent.enabled=true")
    byname = containers(docs, "Deployment")
    assert (byname["operator"]["image"], byname["operator"]["imagePullPolicy"]) == (
        "localhost/sparsegate-operator:dev", "Never")
    assert (byname["opa"]["image"], byname["opa"]["imagePullPolicy"]) == ("localhost/sparsegate-opa:dev", "Never")
    env = env_of(byname["operator"])
    assert env["SPARSEGATE_MODEL_IMAGE"]["value"] == "localhost/sparsegate-model-server:dev"
    assert env["SPARSEGATE_MODEL_IMAGE_PULL_POLICY"]["value"] == "Never"
    agent = containers(docs, "DaemonSet")["agent"]
    assert (agent["image"], agent["imagePullPolicy"]) == ("localhost/sparsegate-agent:dev", "Never")
    # the tag is a --set away
    docs = render("local-images-values.yaml", "--set", "operator.image.tag=abc123")
    assert containers(docs, "Deployment")["operator"]["image"] == "localhost/sparsegate-operator:abc123"


def test_pull_secrets_reach_the_operator_and_the_agent_pods():
    """Images pushed to a private registry (README "Install on a real cluster"): the agent pods
    had no pull secret (operator.imagePullSecrets is the operator pod's), so they stayed in
    ImagePullBackOff."""
    docs = render("agent-values.yaml", "--set", "operator.imagePullSecrets[0].name=op-pull",
                  "--set", "agent.imagePullSecrets[0].name=agent-pull")
    pods = {d["kind"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "DaemonSet")}
    assert pods["Deployment"]["imagePullSecrets"] == [{"name": "op-pull"}]
    assert pods["DaemonSet"]["imagePullSecrets"] == [{"name": "agent-pull"}]
    assert "imagePullSecrets" not in [d for d in render("agent-values.yaml") if d["kind"] == "DaemonSet"][0][
        "spec"]["template"]["spec"]


def test_model_server_pull_secrets_reach_the_operator_which_renders_them_into_model_pods():
    """modelServer.imagePullSecrets: before it, model pods had no pull secret (only a patched
    namespace ServiceAccount got them one)."""
    docs = render(None, "--set", "modelServer.imagePullSecrets[0].name=regcred",
                  "--set", "modelServer.imagePullSecrets[1].name=mirror")
    env = {k: v["value"] for k, v in env_of(containers(docs, "Deployment")["operator"]).items() if "value" in v}
    assert DefaultImage.from_env(env).pull_secrets == ("regcred", "mirror")
    assert "SPARSEGATE_MODEL_IMAGE_PULL_SECRETS" not in env_of(containers(render(), "Deployment")["operator"])


@pytest.mark.parametrize("values", SCENARIOS)
def test_operator_pod_meets_the_restricted_pod_security_profile(values):
    """What the kube-apiserver's PodSecurity admission checks for `restricted` (checked against it
    too: a server dry-run in a namespace enforcing restricted answers no warning for the
    Deployment). The agent needs `privileged` (README "Pod Security admission")."""
    (dep,) = [d for d in render(values) if d["kind"] == "Deployment"]
    assert restricted_violations(dep["spec"]["template"]["spec"]) == []


# --- agent least privilege ----------------------------------------------------------------------


def test_agent_is_not_privileged_and_gets_only_the_bpf_capabilities():
    docs = render("agent-values.yaml")
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    agent = containers(docs, "DaemonSet")["agent"]
    sc = agent["securityContext"]
    assert "privileged" not in sc and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "NET_ADMIN", "PERFMON"]}
    assert "--metrics-addr=$(POD_IP)" in agent["command"]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts["/lib/modules"]["readOnly"] and mounts["/usr/src"]["readOnly"]
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"/lib/modules", "/usr/src", "/sys/fs/bpf"}  # no debugfs
    assert not mounts["/sys/fs/bpf"].get("readOnly") and "--bpffs-dir=/sys/fs/bpf/sparsegate" in agent["command"]
    docs = render("agent-values.yaml", "--set", "agent.bpffs=")
    agent = containers(docs, "DaemonSet")["agent"]
    assert not any(a.startswith("--bpffs-dir") for a in agent["command"])
    assert "/sys/fs/bpf" not in {m["mountPath"] for m in agent["volumeMounts"]}
    docs = render("agent-values.yaml", "--set", "agent.capabilities={BPF,NET_ADMIN,PERFMON,SYS_RESOURCE}")
    assert containers(docs, "DaemonSet")["agent"]["securityContext"]["capabilities"]["add"][-1] == "SYS_RESOURCE"


@pytest.mark.parametrize(("release", "values", "words"), [
    ("production-inference-platform-eu-west-1", (), "must fit in 63"),
    ("r" * 35, (), "at most 34 characters"),
    ("rel", ("--set", "fullnameOverride=Sparse_Gate"), "/fullnameOverride"),
    ("rel", ("--set", "nameOverride=" + "b" * 50), "/nameOverride"),
    ("rel", ("--set", "operator.leaderElection.leaseDuration=5"), "must be shorter than leaseDuration"),
    ("rel", ("--set", "operator.leaderElection.retryPeriod=9"), "1.2 x retryPeriod"),
    ("rel", ("--set", "operator.metrics.port=8181"), "must differ"),
    ("rel", ("--set", "operator.liveness.port=9090"), "must differ"),
])
def test_values_the_operator_pod_could_not_run_with_are_refused_at_install(release: str, values: tuple[str, ...],
                                                                           words: str) -> None:
    """Names Kubernetes would refuse (over 63 characters, not a DNS label), Lease timings the
    operator refuses at start (it would crash-loop), and two of the pod's servers on one port fail
    the render with the reason, instead of an install that cannot run."""
    exe = BIN / "helm"
    proc = subprocess.run([str(exe), "template", release, str(CHART), "--namespace", "sg", *values],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr


@pytest.mark.parametrize("values", SCENARIOS)
def test_the_longest_accepted_release_name_renders_names_kubernetes_accepts(values: str | None) -> None:
    args = ["template", "r" * 34, str(CHART), "--namespace", "sg"] + (["-f", str(CHART / "ci" / values)] if values else [])
    docs = [d for d in yaml.safe_load_all(helm(*args)) if d]
    assert max(len(d["metadata"]["name"]) for d in docs) <= 63
    # The Lease timings the chart lets through are ones the operator starts with.
    from sparsegate.domain.lease import Timing

    for lease, renew, retry in ((15, 10, 2), (60, 59, 49)):
        helm("template", "rel", str(CHART), "--namespace", "sg", "--set", f"operator.leaderElection.leaseDuration={lease}",
             "--set", f"operator.leaderElection.renewDeadline={renew}",
             "--set", f"operator.leaderElection.retryPeriod={retry}")
        Timing(lease_duration_s=lease, renew_deadline_s=renew, retry_period_s=retry)


def test_large_integers_from_a_values_file_render_as_integers(tmp_path):
    """YAML numbers in a values file reach the templates as float64: a lease of 1,000,000 s once
    rendered as --lease-duration=1e+06, which the CLI refuses."""
    values = tmp_path / "big.yaml"
    values.write_text("operator:\n  leaderElection:\n    leaseDuration: 1000000\n")
    (container,) = [c for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "-f", str(values))) if d
                    and d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "operator"]
    assert "--lease-duration=1000000" in container["args"]
    assert cli._parser().parse_args(container["args"]).lease_duration == 1000000


# --- values the schema used to accept that render objects the API server cannot read ------------


@pytest.mark.parametrize(("values", "field"), [
    # `prometheus.io/scrape: true` unquoted: the API server cannot decode the Service
    # ("cannot unmarshal bool into ... metadata.annotations of type string").
    ("operator:\n  metrics:\n    service:\n      annotations:\n        prometheus.io/scrape: true\n",
     "/operator/metrics/service/annotations/prometheus.io~1scrape"),
    ("operator:\n  serviceAccount:\n    annotations:\n        example.com/port: 9090\n",
     "/operator/serviceAccount/annotations/example.com~1port"),
    ("operator:\n  extraEnv:\n    - {name: SPARSEGATE_ROLLOUT_TICK_S, value: 1}\n", "/operator/extraEnv/0/value"),
    # A misspelt key: the API server drops it with a warning and the pod pulls without a secret.
    ("operator:\n  imagePullSecrets:\n    - {nmae: regcred}\n", "/operator/imagePullSecrets/0"),
    ("agent:\n  imagePullSecrets:\n    - {name: regcred, nmae: mirror}\n", "/agent/imagePullSecrets/0"),
    # The API server refuses such a Lease: every replica stood by forever, answering liveness.
    ("operator:\n  leaderElection:\n    leaseName: Sparsegate_Operator\n", "/operator/leaderElection/leaseName"),
], ids=["service-annotation-bool", "sa-annotation-number", "env-value-number", "pull-secret-typo",
        "agent-pull-secret-typo", "lease-name"])
def test_schema_refuses_values_that_would_render_an_object_kubernetes_refuses_or_drops(tmp_path, values, field):
    path = tmp_path / "values.yaml"
    path.write_text(values)
    proc = subprocess.run([str(BIN / "helm"), "template", "rel", str(CHART), "-f", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and field in proc.stderr, proc.stderr


def test_string_annotations_env_and_pull_secrets_still_render(tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text('operator:\n  metrics:\n    service:\n      annotations: {prometheus.io/scrape: "true"}\n'
                    '  imagePullSecrets: [{name: regcred}]\n'
                    '  extraEnv: [{name: A, value: "1"}, {name: NODE, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}]\n'
                    '  leaderElection: {leaseName: sparsegate.example.com}\n')
    docs = [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), "-f", str(path))) if d]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    assert svc["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    op = containers(docs, "Deployment")["operator"]
    assert env_of(op)["A"]["value"] == "1" and "--lease-name=sparsegate.example.com" in op["args"]


@pytest.mark.parametrize("component", ["operator", "agent"])
def test_an_existing_service_account_must_be_named(component: str):
    """serviceAccount.create=false with no name used to fall back to the namespace's `default`
    ServiceAccount (values.yaml said the default was <fullname>-<component>): the chart bound its
    Roles to it, so every pod in the release namespace that names no ServiceAccount got them."""
    base = ["template", "rel", str(CHART), "--namespace", "sg-system", "--set", "agent.enabled=true",
            "--set", f"{component}.serviceAccount.create=false"]
    proc = subprocess.run([str(BIN / "helm"), *base], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and f"{component}.serviceAccount.create=false needs {component}.serviceAccount.name" \
        in proc.stderr, proc.stderr
    docs = [d for d in yaml.safe_load_all(helm(*base, "--set", f"{component}.serviceAccount.name=own-sa")) if d]
    kind = "Deployment" if component == "operator" else "DaemonSet"
    (pod,) = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == kind]
    assert pod["serviceAccountName"] == "own-sa"
    assert not [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "own-sa"]
    subjects = [s for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding") for s in d["subjects"]]
    assert {"kind": "ServiceAccount", "name": "own-sa", "namespace": "sg-system"} in subjects
    assert not [s for s in subjects if s["name"] == "default"]


def test_an_agent_metrics_port_it_cannot_bind_is_refused():
    """The agent drops every capability but agent.capabilities (no NET_BIND_SERVICE) and runs on the
    host network, where binding below net.ipv4.ip_unprivileged_port_start (1024) needs it: the schema
    accepted agent.metricsPort=80 and the agent crash-looped on its metrics server's bind."""
    exe = BIN / "helm"
    proc = subprocess.run([str(exe), "template", "rel", str(CHART), "-f", str(CHART / "ci" / "agent-values.yaml"),
                           "--set", "agent.metricsPort=80"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "agent.metricsPort 80 is below 1024" in proc.stderr, proc.stderr
    for extra in (("--set", "agent.metricsPort=1024"),
                  ("--set", "agent.metricsPort=80", "--set", "agent.capabilities={BPF,NET_ADMIN,PERFMON,NET_BIND_SERVICE}"),
                  ("--set", "agent.metricsPort=80", "--set", "agent.enabled=false")):
        render("agent-values.yaml", *extra)


def test_a_release_name_with_dots_renders_names_kubernetes_accepts():
    """Helm accepts release names with dots (`helm install sg.v2 ...`), and they went into the name
    prefix as they were: the API server refused Service `sg.v2-sparsegate-operator-metrics` ("must
    not contain dots") after the ServiceAccounts, RBAC and Deployment were created, leaving a failed
    release behind."""
    args = ["template", "sg.v2", str(CHART), "--namespace", "sg", "-f", str(CHART / "ci" / "agent-values.yaml"),
            "-f", str(CHART / "ci" / "monitoring-values.yaml")]
    docs = [d for d in yaml.safe_load_all(helm(*args)) if d]
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    assert services == ["sg-v2-sparsegate-operator-metrics"]
    assert all(re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name) for name in services), services
    # The agent follows its own DaemonSet by the name the DaemonSet got.
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    assert f"--daemonset=sg/{ds['metadata']['name']}" in containers(docs, "DaemonSet")["agent"]["command"]
    # Label values may hold dots: the instance label stays the release name.
    assert ds["metadata"]["labels"]["app.kubernetes.io/instance"] == "sg.v2"
