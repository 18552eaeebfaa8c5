"""Model-server pods meet Pod Security ``restricted`` (a namespace enforcing it used to refuse every
pod: the ReplicaSet got FailedCreate), with a read-only root and /tmp the one writable path, and
list the operator's image pull secrets. The dev cluster's pod runner still runs them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from localcluster.podplan import plan_pod
from podsecurity import restricted_violations

from sparsegate.domain import render
from sparsegate_workload import gateparams

ROOT = Path(__file__).resolve().parents[3]
DOC = gateparams.make_document(gateparams.DEFAULT_PARAMS)


def _model(**spec: Any) -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "examples" / "sparsemodel.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="0b7c1f6e-1111-2222-3333-444455556666", generation=1)
    body["spec"].update(spec)
    return body


def _checkpoint_model() -> dict[str, Any]:
    m = _model(resources={"gpus": 1})
    m["spec"]["model"].update(source="/models/ckpt",
                              persistentVolumeClaim={"claimName": "weights", "mountPath": "/models"})
    return m


def _pod(model: dict[str, Any], **default: Any) -> dict[str, Any]:
    return render.render_deployment(model, DOC, default_image=render.DefaultImage(**default))[
        "spec"]["template"]["spec"]


MODELS = {
    "builtin": _model(),
    "checkpoint on a PVC, GPU": _checkpoint_model(),
    "requestAuth Enforce": _model(access={"requestAuth": "Enforce"}),
    "tools": _model(tools=[{"name": "search", "url": "http://search.ml:8080/q"}]),
    "servingPort 80": _model(servingPort=80),
}


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
def test_model_pods_meet_the_restricted_pod_security_profile(model: dict[str, Any]) -> None:
    assert restricted_violations(_pod(model)) == []


def test_the_root_filesystem_is_read_only_and_tmp_an_empty_dir_holding_the_caches() -> None:
    pod = _pod(_checkpoint_model())
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    writable = [m for m in c["volumeMounts"] if not m.get("readOnly")]
    assert [(m["mountPath"], volumes[m["name"]]) for m in writable] == [("/tmp", {"name": "tmp", "emptyDir": {}})]
    env = {e["name"]: e.get("value") for e in c["env"]}
    for var in ("XDG_CACHE_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH"):
        assert env[var].startswith("/tmp/"), var


def test_model_pods_run_as_the_model_server_images_user() -> None:
    """The uid in the pod is the image's USER: pods of the default image run as they always did."""
    (user,) = re.findall(r"^USER (\d+):(\d+)$", (ROOT / "workloads" / "Containerfile").read_text(), re.M)
    sc = _pod(_model())["securityContext"]
    assert (str(sc["runAsUser"]), str(sc["runAsGroup"])) == user and sc["runAsNonRoot"] is True


def test_pull_secrets_reach_every_model_pod() -> None:
    assert "imagePullSecrets" not in _pod(_model())
    for model in (_model(), _model(image="registry.example/moe:1")):
        pod = _pod(model, pull_secrets=("regcred", "mirror"))
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


def test_pull_secrets_from_the_operator_env() -> None:
    env = {"SPARSEGATE_MODEL_IMAGE_PULL_SECRETS": "regcred, mirror,,"}
    assert render.DefaultImage.from_env(env).pull_secrets == ("regcred", "mirror")
    assert render.DefaultImage.from_env({}).pull_secrets == ()


def test_the_dev_pod_runner_runs_the_pod_as_a_kubelet_would() -> None:
    """localcluster's runner maps the security context to podman flags (--user, --read-only,
    --cap-drop, no-new-privileges, the default seccomp profile) and mounts /tmp writable."""
    model = _model()
    pod = {"metadata": {"name": "moe-small-1", "namespace": "ml", "uid": "0123456789abcdef"},
           "spec": _pod(model), "status": {"phase": "Running", "podIP": "127.20.1.5"}}
    data = {"moe-small-gate": {"gate.json": "{}"}, "moe-small-admin": {"token": "t", "tls.crt": "C", "tls.key": "K"}}
    plan = plan_pod(pod, secrets=lambda ns, n: data.get(n), configmaps=lambda ns, n: data.get(n),
                    tokens=lambda *a: "token", service_env={})
    assert plan is not None and plan.unsupported == ()
    (c,) = plan.containers
    assert (c.user, c.read_only_root, c.no_new_privileges, c.cap_drop, c.seccomp_unconfined) == (
        "65532:65532", True, True, ("ALL",), False)
    (tmp,) = [m for m in c.mounts if not m.read_only]
    assert tmp.target == "/tmp" and {v.name: v.writable for v in plan.volumes}[tmp.volume]


@pytest.mark.parametrize("port", [1, 80, 1023])
def test_a_privileged_serving_port_is_made_bindable_for_the_non_root_server(port: int) -> None:
    """The server runs as a non-root uid with every capability dropped: a servingPort under 1024
    (which the CRD accepts) failed to bind (EACCES, a crash loop) unless the pod's network
    namespace lets unprivileged processes bind from there."""
    pod = _pod(_model(servingPort=port))
    assert pod["securityContext"]["sysctls"] == [{"name": "net.ipv4.ip_unprivileged_port_start", "value": str(port)}]
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert restricted_violations(pod) == []


@pytest.mark.parametrize("port", [1024, 8080, 65535])
def test_an_unprivileged_serving_port_needs_no_sysctl(port: int) -> None:
    assert "sysctls" not in _pod(_model(servingPort=port))["securityContext"]
