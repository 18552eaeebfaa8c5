"""Which process the pod runner wants for a pod (pure)."""

from pathlib import Path

import pytest

from localcluster import podrunner

SECRETS = {("ns", "m1-admin"): {"token": "s3cret"}}
CONFIGMAPS = {("ns", "m1-gate"): {"gate.json": '{"version": "g-1"}'}}


def secrets(ns: str, name: str) -> dict[str, str] | None:
    return SECRETS.get((ns, name))


def configmaps(ns: str, name: str) -> dict[str, str] | None:
    return CONFIGMAPS.get((ns, name))


def model_pod(**status: object) -> dict:
    return {
        "metadata": {"name": "m1-abc", "namespace": "ns", "uid": "u1",
                     "labels": {"app.kubernetes.io/name": "sparsegate-model", "sparsegate.dev/model": "m1"}},
        "spec": {
            "nodeName": "kwok-node-0",
            "containers": [{
                "name": "server",
                "ports": [{"name": "metrics", "containerPort": 9000}, {"name": "http", "containerPort": 8080}],
                "env": [
                    {"name": "SPARSEGATE_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {"name": "m1-admin", "key": "token"}}},
                    {"name": "PLAIN", "value": "x"},
                    {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                ],
                "volumeMounts": [{"name": "gate", "mountPath": "/etc/sparsegate"}],
            }],
            "volumes": [{"name": "gate", "configMap": {"name": "m1-gate"}}],
        },
        "status": {"phase": "Running", "podIP": "127.20.0.5", **status},
    }


def test_running_pod_yields_process_on_pod_ip_and_http_port() -> None:
    spec = podrunner.desired_process(model_pod(), secrets=secrets, configmaps=configmaps)
    assert spec is not None
    assert (spec.host, spec.port, spec.key) == ("127.20.0.5", 8080, "ns/m1-abc/u1")
    assert dict(spec.env) == {"SPARSEGATE_ADMIN_TOKEN": "s3cret", "PLAIN": "x", "MY_IP": "127.20.0.5"}
    assert spec.gate_json == '{"version": "g-1"}'


@pytest.mark.parametrize("status", [{"phase": "Pending"}, {"podIP": None}])
def test_nothing_runs_before_pod_is_running_with_ip(status: dict) -> None:
    assert podrunner.desired_process(model_pod(**status), secrets=secrets, configmaps=configmaps) is None


def test_nothing_runs_for_deleting_pod() -> None:
    pod = model_pod()
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert podrunner.desired_process(pod, secrets=secrets, configmaps=configmaps) is None


def test_missing_secret_or_configmap_waits() -> None:
    with pytest.raises(podrunner.NotReadyToRun, match="m1-admin"):
        podrunner.desired_process(model_pod(), secrets=lambda ns, n: None, configmaps=configmaps)
    with pytest.raises(podrunner.NotReadyToRun, match="m1-gate"):
        podrunner.desired_process(model_pod(), secrets=secrets, configmaps=lambda ns, n: None)


def test_gate_configmap_falls_back_to_model_label() -> None:
    pod = model_pod()
    pod["spec"]["volumes"] = []
    pod["spec"]["containers"][0]["volumeMounts"] = []
    assert podrunner.gate_configmap_name(pod) == "m1-gate"


def test_render_argv_fills_template_and_drops_absent_gate_flag() -> None:
    argv = podrunner.render_argv(podrunner.DEFAULT_COMMAND, host="127.20.0.5", port=8080, gate_config=Path("/g.json"), python="py")
    assert argv == ["py", "-m", "sparsegate_workload.server", "--host", "127.20.0.5", "--port", "8080", "--gate-config", "/g.json"]
    argv = podrunner.render_argv(podrunner.DEFAULT_COMMAND, host="h", port=1, gate_config=None, python="py")
    assert argv == ["py", "-m", "sparsegate_workload.server", "--host", "h", "--port", "1"]


def test_identity_ignores_gate_content() -> None:
    a = podrunner.desired_process(model_pod(), secrets=secrets, configmaps=configmaps)
    b = podrunner.desired_process(model_pod(), secrets=secrets, configmaps=lambda ns, n: {"gate.json": "{}"})
    assert a is not None and b is not None
    assert a.identity() == b.identity() and a.gate_json != b.gate_json


SERVER_ARGS = ["--host", "0.0.0.0", "--port", "8080", "--gate-config", "/etc/sparsegate/gate.json",
               "--admin-token-env", "SPARSEGATE_ADMIN_TOKEN", "--d-model", "96", "--experts", "6",
               "--min-experts-per-token", "1", "--max-experts-per-token", "3"]
SHAPE_ARGS = ["--d-model", "96", "--experts", "6", "--min-experts-per-token", "1", "--max-experts-per-token", "3"]


def test_container_args_are_part_of_the_process_and_its_identity() -> None:
    pod = model_pod()
    pod["spec"]["containers"][0]["args"] = SERVER_ARGS
    spec = podrunner.desired_process(pod, secrets=secrets, configmaps=configmaps)
    assert spec is not None and spec.args == tuple(SERVER_ARGS)
    # a changed shape is a different process (restart), as a new pod template would be
    pod["spec"]["containers"][0]["args"] = [*SERVER_ARGS[:-1], "2"]
    other = podrunner.desired_process(pod, secrets=secrets, configmaps=configmaps)
    assert other is not None and other.identity() != spec.identity()


def test_default_command_runs_the_pod_args_with_host_port_and_gate_file_overridden() -> None:
    argv = podrunner.render_argv(podrunner.DEFAULT_COMMAND, host="127.20.0.5", port=8080, gate_config=Path("/w/gate.json"),
                                 python="py", pod_args=SERVER_ARGS)
    assert argv == ["py", "-m", "sparsegate_workload.server", "--host", "127.20.0.5", "--port", "8080",
                    "--gate-config", "/w/gate.json", "--admin-token-env", "SPARSEGATE_ADMIN_TOKEN", *SHAPE_ARGS]


@pytest.mark.parametrize("args, expected", [
    (["--host=0.0.0.0", "--port=1", "--gate-config=/x", "--experts=4"], ["--experts=4"]),
    (["--experts", "4", "--host", "h"], ["--experts", "4"]),
    (["--hostname", "x", "--port"], ["--hostname", "x"]),  # only the exact flags; a trailing flag takes nothing
    ([], []),
])
def test_forwarded_args_drop_only_the_overridden_flags(args: list[str], expected: list[str]) -> None:
    assert podrunner.forwarded_args(args) == expected


def test_custom_template_without_pod_args_gets_none_and_with_it_gets_them() -> None:
    plain = "{python} -m http.server --bind {host} {port}".split()
    assert podrunner.render_argv(plain, host="h", port=1, gate_config=None, python="py", pod_args=SERVER_ARGS) == [
        "py", "-m", "http.server", "--bind", "h", "1"]
    shell = ["sh", "-c", "exec server --host {host} {pod_args}"]
    assert podrunner.render_argv(shell, host="h", port=1, gate_config=None, python="py",
                                 pod_args=["--experts", "4", "--note", "a b"]) == [
        "sh", "-c", "exec server --host h --experts 4 --note 'a b'"]


def test_args_expand_container_env_references_like_a_kubelet() -> None:
    pod = model_pod()
    pod["spec"]["containers"][0]["args"] = ["--bind-ip=$(MY_IP)", "--x", "$(UNDEFINED)", "$$(PLAIN)", "$(PLAIN)"]
    spec = podrunner.desired_process(pod, secrets=secrets, configmaps=configmaps)
    assert spec is not None
    assert spec.args == ("--bind-ip=127.20.0.5", "--x", "$(UNDEFINED)", "$(PLAIN)", "x")
