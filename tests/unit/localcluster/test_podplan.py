"""The container pod runner's plan of a pod: what a kubelet would run (no cluster, no podman)."""

from __future__ import annotations

import json

import pytest
from localcluster import podman
from localcluster.containerrunner import _ProbeState, _step_probe, backoff_s
from localcluster.podplan import (
    SA_MOUNT,
    NotReadyToRun,
    Observed,
    Probe,
    plan_pod,
    pod_status,
    unsupported_fields,
)

SERVICE_ENV = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
CONFIGMAPS = {("ns", "gate"): {"gate.json": '{"v": 1}', "other": "x"},
              ("ns", "kube-root-ca.crt"): {"ca.crt": "CA PEM"},
              ("ns", "settings"): {"LEVEL": "debug", "MODE": "fast"}}
SECRETS = {("ns", "admin"): {"token": "s3cret"}}
TOKENS: list[tuple] = []


def token_source(namespace, sa, audiences, seconds, pod, uid):
    TOKENS.append((namespace, sa, audiences, seconds, pod, uid))
    return f"token-for-{sa}"


def pod(**spec_overrides):
    spec = {
        "serviceAccountName": "operator",
        "securityContext": {"runAsUser": 65532, "runAsNonRoot": True},
        "containers": [{
            "name": "server", "image": "localhost/sparsegate-model-server:abc", "imagePullPolicy": "Never",
            "command": ["python", "-m", "srv"],
            "args": ["--host=$(POD_IP)", "--port", "8080", "--token-env", "$(MISSING)", "$$(literal)"],
            "ports": [{"name": "http", "containerPort": 8080}],
            "env": [
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "admin", "key": "token"}}},
                {"name": "URL", "value": "http://$(POD_IP):8181"},
            ],
            "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "SG_"}],
            "volumeMounts": [{"name": "gate", "mountPath": "/etc/sparsegate", "readOnly": True},
                             {"name": "tmp", "mountPath": "/tmp"},
                             {"name": "kube-api-access", "mountPath": SA_MOUNT, "readOnly": True}],
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2},
            "livenessProbe": {"tcpSocket": {"port": 8080}, "failureThreshold": 5},
            "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}},
            "resources": {"limits": {"memory": "1Gi"}},
        }],
        "volumes": [
            {"name": "gate", "configMap": {"name": "gate", "items": [{"key": "gate.json", "path": "gate.json"}]}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "kube-api-access", "projected": {"defaultMode": 420, "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
            ]}},
        ],
        "nodeName": "kwok-node-0", "tolerations": [], "restartPolicy": "Always",
    }
    spec.update(spec_overrides)
    return {"metadata": {"name": "m-1", "namespace": "ns", "uid": "0123456789abcdef"}, "spec": spec,
            "status": {"phase": "Running", "podIP": "127.20.1.5"}}


def plan(p):
    return plan_pod(p, secrets=lambda ns, n: SECRETS.get((ns, n)), configmaps=lambda ns, n: CONFIGMAPS.get((ns, n)),
                    tokens=token_source, service_env=SERVICE_ENV)


def test_container_as_a_kubelet_would_run_it():
    p = plan(pod())
    (c,) = p.containers
    env = dict(c.env)
    assert env["POD_IP"] == "127.20.1.5" and env["NS"] == "ns" and env["TOKEN"] == "s3cret"
    assert env["URL"] == "http://127.20.1.5:8181"  # env values may reference earlier variables
    assert env["SG_LEVEL"] == "debug" and env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert c.entrypoint == ("python", "-m", "srv")
    # $(VAR) expanded, undefined kept as written, $$ escapes.
    assert c.args == ("--host=127.20.1.5", "--port", "8080", "--token-env", "$(MISSING)", "$(literal)")
    assert c.user == "65532" and c.read_only_root and c.no_new_privileges and c.cap_drop == ("ALL",)
    assert c.readiness.kind == "http" and c.readiness.port == 8080 and c.readiness.host == "127.20.1.5"
    assert c.readiness.period_s == 2 and c.liveness.kind == "tcp" and c.liveness.failure_threshold == 5
    assert c.pull_policy == "Never" and p.unsupported == ()
    assert c.seccomp_unconfined  # no seccompProfile: a kubelet's default is unconfined


def test_termination_grace_period_follows_the_pod():
    assert plan(pod()).grace_s == 30
    assert plan(pod(terminationGracePeriodSeconds=0)).grace_s == 0


def test_seccomp_runtime_default_keeps_the_runtime_profile():
    p = pod()
    p["spec"]["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
    (c,) = plan(p).containers
    assert not c.seccomp_unconfined
    argv = podman.run_argv(c, name="n", labels={}, hostname="h", mounts=[])
    assert "seccomp=unconfined" not in argv


def test_volumes_materialise_configmaps_emptydirs_and_the_service_account():
    TOKENS.clear()
    vols = {v.name: v for v in plan(pod()).volumes}
    assert vols["gate"].files == (("gate.json", b'{"v": 1}', 0o644),)  # items select keys
    assert vols["tmp"].writable and vols["tmp"].files == ()
    sa = {rel: (content, mode) for rel, content, mode in vols["kube-api-access"].files}
    assert sa == {"token": (b"token-for-operator", 420), "ca.crt": (b"CA PEM", 420), "namespace": (b"ns", 420)}
    # A bound token: the pod's ServiceAccount, bound to the pod by name and uid.
    assert TOKENS == [("ns", "operator", (), 3607, "m-1", "0123456789abcdef")]


def test_missing_references_wait_instead_of_running_half_configured():
    p = pod()
    p["spec"]["containers"][0]["env"].append({"name": "X", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}})
    with pytest.raises(NotReadyToRun, match="nope"):
        plan(p)
    p = pod(volumes=[{"name": "gate", "configMap": {"name": "absent"}}])
    p["spec"]["containers"][0]["volumeMounts"] = [{"name": "gate", "mountPath": "/etc/sparsegate"}]
    with pytest.raises(NotReadyToRun, match="absent"):
        plan(p)
    p["spec"]["volumes"][0]["configMap"]["optional"] = True
    assert plan(p).volumes[0].files == ()


def test_nothing_runs_before_the_pod_is_running_with_an_ip_or_while_it_is_deleted():
    for status in ({"phase": "Pending"}, {"phase": "Running"}):
        p = pod()
        p["status"] = status
        assert plan(p) is None
    p = pod()
    p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert plan(p) is None


def test_unsupported_fields_are_named():
    p = pod(initContainers=[{"name": "init", "image": "x"}])
    p["spec"]["containers"][0]["lifecycle"] = {"preStop": {}}
    p["spec"]["containers"][0]["livenessProbe"] = {"exec": {"command": ["true"]}}
    p["spec"]["volumes"].append({"name": "data", "persistentVolumeClaim": {"claimName": "c"}})
    found = unsupported_fields(p)
    assert "spec.initContainers" in found
    assert "spec.containers[0].lifecycle" in found
    assert any("livenessProbe" in f and "httpGet" in f for f in found)
    assert any("persistentVolumeClaim" in f for f in found)
    assert unsupported_fields(pod()) == []


def test_pod_status_reports_waiting_reasons_and_readiness():
    p = plan(pod())
    status = pod_status(p, {"server": Observed("waiting", "ErrImageNeverPull", "not present")}, previous=None,
                        now="T0")
    (cs,) = status["containerStatuses"]
    assert cs["state"] == {"waiting": {"reason": "ErrImageNeverPull", "message": "not present"}} and not cs["ready"]
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "ContainersNotReady"
    running = pod_status(p, {"server": Observed("running", started_at="T1", ready=True, started=True,
                                                restart_count=2, last_terminated={"exitCode": 1})},
                         previous=status, now="T2")
    (cs,) = running["containerStatuses"]
    assert cs["ready"] and cs["restartCount"] == 2 and cs["lastState"] == {"terminated": {"exitCode": 1}}
    ready = {c["type"]: c for c in running["conditions"]}["Ready"]
    assert ready["status"] == "True" and ready["lastTransitionTime"] == "T2"
    again = pod_status(p, {"server": Observed("running", started_at="T1", ready=True, started=True)},
                       previous=running, now="T3")
    assert {c["type"]: c for c in again["conditions"]}["Ready"]["lastTransitionTime"] == "T2"


def test_podman_run_arguments():
    (c,) = plan(pod()).containers
    argv = podman.run_argv(c, name="k8s_server", labels={"a": "b"}, hostname="m-1",
                           mounts=[("/host/gate", "/etc/sparsegate", True), ("/host/tmp", "/tmp", False)])
    assert argv[:6] == ["run", "-d", "--name", "k8s_server", "--network", "host"]
    assert json.loads(argv[argv.index("--entrypoint") + 1]) == ["python", "-m", "srv"]
    assert argv[argv.index("--user") + 1] == "65532" and "--read-only" in argv and "--cap-drop=ALL" in argv
    assert "/host/gate:/etc/sparsegate:ro" in argv and "/host/tmp:/tmp:rw" in argv
    assert "TOKEN=s3cret" in argv
    image_at = argv.index("localhost/sparsegate-model-server:abc")
    assert argv[image_at + 1:] == list(c.args)


def test_crash_loop_back_off_doubles_and_is_capped():
    assert [backoff_s(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff_s(50) == 20.0


def test_probe_thresholds(monkeypatch):
    from localcluster import containerrunner

    answers = iter([False, True, False, False, False])
    monkeypatch.setattr(containerrunner, "probe_once", lambda probe: next(answers))
    probe = Probe(kind="tcp", host="h", port=1, period_s=1, failure_threshold=3, initial_delay_s=5)
    state = _ProbeState()
    assert _step_probe(probe, state, started_at=0, now=1) is None and state.last_run == 0  # initial delay
    assert _step_probe(probe, state, started_at=0, now=5) is None  # one failure: below the threshold
    assert _step_probe(probe, state, started_at=0, now=6) is True and state.ok
    assert _step_probe(probe, state, started_at=0, now=6.5) is None  # not due yet
    assert [_step_probe(probe, state, started_at=0, now=t) for t in (7, 8, 9)] == [None, None, False]
    assert not state.ok


def test_binary_secret_values_are_written_byte_for_byte():
    import base64

    from localcluster.podplan import decode_secret, volume_files

    blob = bytes(range(256))
    data = decode_secret({"key.der": base64.b64encode(blob).decode()})
    vol = volume_files({"name": "tls", "secret": {"secretName": "tls"}}, pod=pod(),
                       secrets=lambda ns, n: data, configmaps=lambda ns, n: None, tokens=token_source)
    assert vol.files == (("key.der", blob, 0o644),)


def test_status_pod_ips_is_every_address_comma_separated_as_a_kubelet_gives_it():
    from localcluster.podplan import pod_fields

    p = pod()
    assert pod_fields(p)["status.podIPs"] == "127.20.1.5"  # single-stack: the one address
    p["status"]["podIPs"] = [{"ip": "127.20.1.5"}, {"ip": "fd00::5"}]
    assert pod_fields(p)["status.podIPs"] == "127.20.1.5,fd00::5"
