"""Rendering a SparseModel into its owned objects (pure, no cluster)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from sparsegate.domain import render
from sparsegate.domain.admin_tls import AdminMaterial
from sparsegate_workload import gateparams

ROOT = Path(__file__).resolve().parents[3]


def model(**spec_overrides):
    body = yaml.safe_load((ROOT / "examples" / "sparsemodel.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="0b7c1f6e-1111-2222-3333-444455556666", generation=3)
    body["spec"].update(spec_overrides)
    return body


DOC = gateparams.make_document(gateparams.DEFAULT_PARAMS)


MATERIAL = AdminMaterial(token="t", cert_pem="CERT", key_pem="KEY")


def test_every_object_is_owned_by_the_model_and_labelled():
    m = model()
    objs = render.render_applied(m, DOC) + [render.render_secret(m, material=MATERIAL)]
    assert [o["kind"] for o in objs] == ["ConfigMap", "Service", "Deployment", "Secret"]
    assert [o["metadata"]["name"] for o in objs] == ["moe-small-gate", "moe-small", "moe-small",
                                                      "moe-small-admin"]
    for obj in objs:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "SparseModel",
                       "name": "moe-small", "uid": m["metadata"]["uid"], "controller": True,
                       "blockOwnerDeletion": True}
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"]["sparsegate.dev/model"] == "moe-small"


def test_pod_template_matches_the_contract():
    dep = render.render_deployment(model(), DOC)
    tmpl = dep["spec"]["template"]
    assert tmpl["metadata"]["labels"]["app.kubernetes.io/name"] == "sparsegate-model"
    assert tmpl["metadata"]["labels"]["sparsegate.dev/model"] == "moe-small"
    # the selector is a subset of the template labels (else the API server rejects it)
    assert dep["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    (c,) = tmpl["spec"]["containers"]
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                          {"name": "admin", "containerPort": 8443, "protocol": "TCP"}]
    # No secret in the environment: the admin token is a file of the Secret volume, so it rotates.
    assert c["env"][0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert all("value" in e for e in c["env"][1:])
    gate_mount, admin_mount, _tmp = c["volumeMounts"]
    gate_vol, admin_vol, _tmp = tmpl["spec"]["volumes"]
    assert gate_vol["configMap"]["name"] == "moe-small-gate" and gate_vol["name"] == gate_mount["name"]
    assert f'{gate_mount["mountPath"]}/{render.GATE_KEY}' == "/etc/sparsegate/gate.json"
    assert c["args"][c["args"].index("--gate-config") + 1] == "/etc/sparsegate/gate.json"
    # The whole Secret as a directory (no subPath: a kubelet does not update subPath mounts).
    assert admin_vol == {"name": admin_mount["name"], "secret": {"secretName": "moe-small-admin"}}
    assert "subPath" not in admin_mount and admin_mount["readOnly"]
    for flag, key in (("--admin-token-file", "token"), ("--admin-tls-cert", "tls.crt"),
                      ("--admin-tls-key", "tls.key")):
        assert c["args"][c["args"].index(flag) + 1] == f'{admin_mount["mountPath"]}/{key}'
    assert c["args"][c["args"].index("--admin-port") + 1] == "8443"
    assert dep["spec"]["replicas"] == 2


def test_admin_port_is_not_in_the_service():
    (port,) = render.render_service(model())["spec"]["ports"]
    assert port["name"] == "http"


def test_admin_secret_holds_exactly_token_and_tls_pair_as_base64_data():
    import base64

    secret = render.render_secret(model(), material=MATERIAL)
    assert secret["type"] == "Opaque" and "stringData" not in secret
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {
        "token": "t", "tls.crt": "CERT", "tls.key": "KEY"}
    assert render.admin_server_name(model()) == "moe-small.ml.admin.sparsegate.dev"


def test_serving_port_flows_to_container_service_and_args():
    m = model(servingPort=9000)
    c = render.render_deployment(m, DOC)["spec"]["template"]["spec"]["containers"][0]
    assert c["ports"][0]["containerPort"] == 9000
    assert c["args"][c["args"].index("--port") + 1] == "9000"
    (port,) = render.render_service(m)["spec"]["ports"]
    assert port == {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}


def test_gpu_models_request_gpus_and_land_on_gpu_nodes():
    pod = render.render_deployment(model(resources={"gpus": 2}), DOC)["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_cpu_models_have_no_gpu_scheduling():
    pod = render.render_deployment(model(resources={"gpus": 0}), DOC)["spec"]["template"]["spec"]
    assert "resources" not in pod["containers"][0]
    assert "nodeSelector" not in pod and "tolerations" not in pod


def test_cpu_and_memory_requests_and_limits_reach_the_container_beside_the_gpus():
    res = {"requests": {"cpu": "500m", "memory": 1073741824}, "limits": {"cpu": 2, "memory": "2Gi"}, "gpus": 1}
    (c,) = render.render_deployment(model(resources=res), DOC)["spec"]["template"]["spec"]["containers"]
    # Quantities as written, as strings (an integer is a whole number of cores or bytes).
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1073741824", "nvidia.com/gpu": "1"},
                              "limits": {"cpu": "2", "memory": "2Gi", "nvidia.com/gpu": "1"}}


@pytest.mark.parametrize(("res", "expected"), [
    ({"gpus": 0, "limits": {"cpu": "1"}}, {"limits": {"cpu": "1"}}),
    ({"gpus": 0, "requests": {"memory": "256Mi"}}, {"requests": {"memory": "256Mi"}}),
    ({"gpus": 0, "requests": {}, "limits": {}}, None),
    ({"gpus": 2, "requests": {"cpu": "250m"}},
     {"requests": {"cpu": "250m", "nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}),
])
def test_only_what_is_set_is_rendered(res, expected):
    (c,) = render.render_deployment(model(resources=res), DOC)["spec"]["template"]["spec"]["containers"]
    assert c.get("resources") == expected


def test_gate_configmap_holds_the_content_addressed_document():
    cm = render.render_configmap(model(), DOC)
    doc = json.loads(cm["data"]["gate.json"])
    assert gateparams.parse_document(doc).version == DOC.version  # round-trips and verifies
    assert doc["version"] == "g-" + doc["checksum"].removeprefix("sha256:")[:12]
    assert cm["metadata"]["annotations"]["sparsegate.dev/gate-version"] == DOC.version


def test_gate_version_is_stable_and_content_addressed():
    reordered = dict(reversed(list(gateparams.DEFAULT_PARAMS.items())))
    assert gateparams.make_document(reordered).version == DOC.version
    changed = {**gateparams.DEFAULT_PARAMS, "toolGateThreshold": 0.9}
    assert gateparams.make_document(changed).version != DOC.version
    # Same input renders byte-identical objects: server-side apply then changes nothing.
    assert render.render_applied(model(), DOC) == render.render_applied(copy.deepcopy(model()), DOC)


def test_new_gate_does_not_restart_pods():
    other = gateparams.make_document({**gateparams.DEFAULT_PARAMS, "entropyBeta": 0.2})
    a, b = (render.render_deployment(model(), d) for d in (DOC, other))
    assert a["spec"]["template"] == b["spec"]["template"]
    assert a["metadata"]["annotations"] != b["metadata"]["annotations"]


@pytest.mark.parametrize("replicas", [0, 1, 5])
def test_replicas_pass_through(replicas):
    assert render.render_deployment(model(replicas=replicas), DOC)["spec"]["replicas"] == replicas


def _args(m) -> list[str]:
    return render.render_deployment(m, DOC)["spec"]["template"]["spec"]["containers"][0]["args"]


def _flag(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, args
    return args[args.index(flag) + 1]


def test_model_shape_becomes_server_flags():
    args = _args(model(model={"dModel": 256, "experts": 8, "minExpertsPerToken": 2,
                              "maxExpertsPerToken": 4}))
    assert {f: _flag(args, f) for f in ("--d-model", "--experts", "--min-experts-per-token",
                                        "--max-experts-per-token")} == {
        "--d-model": "256", "--experts": "8", "--min-experts-per-token": "2",
        "--max-experts-per-token": "4"}


def test_absent_min_leaves_the_server_default_and_absent_max_is_at_most_4():
    """The CRD defaults min (1) but not max: an unset max is the smaller of 4 and experts, so a
    model with fewer than 4 experts is valid without one."""
    args = _args(model(model={"dModel": 128, "experts": 8}))
    assert (_flag(args, "--d-model"), _flag(args, "--experts")) == ("128", "8")
    assert "--min-experts-per-token" not in args and _flag(args, "--max-experts-per-token") == "4"
    assert _flag(_args(model(model={"dModel": 128, "experts": 2})), "--max-experts-per-token") == "2"
    assert _flag(_args(model(model={"dModel": 128, "experts": 1})), "--max-experts-per-token") == "1"


def test_shape_flags_parse_with_the_servers_own_parser():
    """The rendered args are exactly what `python -m sparsegate_workload.server` accepts (its own
    parser, so a renamed or removed server flag fails here)."""
    from sparsegate_workload import server

    m = model(model={"dModel": 96, "experts": 6, "minExpertsPerToken": 1, "maxExpertsPerToken": 3})
    c = render.render_deployment(m, DOC)["spec"]["template"]["spec"]["containers"][0]
    ns = server.build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.1") for a in c["args"]])
    assert (ns.host, ns.port, ns.admin_port) == ("10.0.0.1", 8080, 8443)
    assert ns.admin_tls_key.endswith("/tls.key")
    cfg = server.model_config_from_args(ns)
    assert (cfg.d_model, cfg.num_experts, cfg.min_experts_per_token,
            cfg.max_experts_per_token) == (96, 6, 1, 3)


def test_pod_stops_gracefully_within_its_grace_period():
    """On SIGTERM the server stays in the endpoints' way for --shutdown-delay (unready, still
    serving) and then lets requests in flight finish, each within its --request-timeout: the grace
    period holds both, so the kubelet's SIGKILL (default 30 s) does not cut them."""
    from sparsegate_workload import server

    pod = render.render_deployment(model(), DOC)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ns = server.build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.1") for a in c["args"]])
    # In the environment, not a flag: an older image (a pinned spec.image) ignores it.
    delay = server.shutdown_delay(ns.shutdown_delay, {e["name"]: e["value"] for e in c["env"] if "value" in e})
    assert delay >= 5
    assert pod["terminationGracePeriodSeconds"] >= delay + ns.request_timeout + server.DRAIN_SLACK_S + 5


def test_server_binds_the_pod_ip_never_all_interfaces():
    """Pods may share one network namespace (the local cluster's host network): each binds its own
    IP. $(POD_IP) is expanded by the kubelet from the env var it references."""
    c = render.render_deployment(model(), DOC)["spec"]["template"]["spec"]["containers"][0]
    hosts = [a for a in c["args"] if a.startswith("--host")]
    assert hosts == ["--host=$(POD_IP)"] and "0.0.0.0" not in c["args"]
    (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_spec_image_wins_and_keeps_the_default_pull_policy():
    default = render.DefaultImage(image="localhost/sparsegate-model-server:dev", pull_policy="Never")
    c = render.render_deployment(model(image="registry.example/moe:1"), DOC,
                                 default_image=default)["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "registry.example/moe:1" and "imagePullPolicy" not in c


def test_models_without_an_image_run_the_operators_default():
    m = model()
    m["spec"].pop("image", None)  # examples/ leave it out
    default = render.DefaultImage(image="localhost/sparsegate-model-server:dev", pull_policy="Never")
    (c,) = render.render_applied(m, DOC, default_image=default)[2]["spec"]["template"]["spec"]["containers"]
    assert (c["image"], c["imagePullPolicy"]) == ("localhost/sparsegate-model-server:dev", "Never")
    # without operator settings: the built-in default, Kubernetes' pull policy
    (c,) = render.render_deployment(m, DOC)["spec"]["template"]["spec"]["containers"]
    assert c["image"] == render.DEFAULT_MODEL_IMAGE and "imagePullPolicy" not in c


def test_default_image_from_the_operator_env():
    env = {"SPARSEGATE_MODEL_IMAGE": "localhost/sparsegate-model-server:dev",
           "SPARSEGATE_MODEL_IMAGE_PULL_POLICY": "Never"}
    assert render.DefaultImage.from_env(env) == render.DefaultImage(
        image="localhost/sparsegate-model-server:dev", pull_policy="Never")
    assert render.DefaultImage.from_env({}) == render.DefaultImage()
    assert render.DefaultImage.from_env({"SPARSEGATE_MODEL_IMAGE": ""}).image == render.DEFAULT_MODEL_IMAGE


def test_liveness_waits_for_a_slow_start():
    (c,) = render.render_deployment(model(), DOC)["spec"]["template"]["spec"]["containers"]
    startup = c["startupProbe"]
    # Liveness (10 s × 3) would kill a server still importing torch; the startup probe allows minutes.
    assert startup["httpGet"]["path"] == "/healthz" and startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_checkpoint_source_renders_the_path_not_the_shape_and_mounts_the_claim_read_only():
    m = model()
    m["spec"]["model"].update(source="/models/mixtral/ckpt",
                              persistentVolumeClaim={"claimName": "weights", "mountPath": "/models"})
    pod = render.render_deployment(m, DOC)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = c["args"]
    assert args[args.index("--model-path") + 1] == "/models/mixtral/ckpt"
    assert args[args.index("--served-model-name") + 1] == m["metadata"]["name"]
    assert "--d-model" not in args and "--experts" not in args  # the checkpoint carries its shape
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


@pytest.mark.parametrize("source", ["/models/$(POD_IP)/ckpt", "/models/a$$b/ckpt",
                                    "/models/o'brien;`x`|$HOME&\"q\"*?/é/ckpt"])
def test_a_checkpoint_path_with_odd_characters_reaches_the_server_verbatim(source):
    """The kubelet expands $(VAR) in container args and turns $$ into $ (no shell is involved:
    quotes, ;, `, | pass as they are); the server must still get the path the user wrote."""
    from localcluster.podplan import expand  # the pod runner's copy of the kubelet's rule

    from sparsegate_workload.server import build_parser

    m = model()
    m["spec"]["model"].update(source=source,
                              persistentVolumeClaim={"claimName": "weights", "mountPath": "/models"})
    (c,) = render.render_deployment(m, DOC)["spec"]["template"]["spec"]["containers"]
    argv = [expand(a, {"POD_IP": "10.1.2.3"}) for a in c["args"]]
    assert build_parser().parse_args(argv).model_path == source


def test_builtin_source_and_no_source_render_the_same_builtin_model():
    plain = render.render_deployment(model(), DOC)
    m = model()
    m["spec"]["model"]["source"] = "builtin:tiny"
    assert render.render_deployment(m, DOC) == plain
    args = plain["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--model-path" not in args and "--d-model" in args
    assert all(v["name"] != "model" for v in plain["spec"]["template"]["spec"]["volumes"])
