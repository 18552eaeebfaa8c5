"""The container pod runner plays the kubelet: pods run their containers from images with podman.

A cluster of its own in container mode (kwok assigns IPs, the runner reports readiness). The image is
Debian's static busybox in a ``FROM scratch`` image built here with buildah: small enough to build
per session, and its ``httpd`` lets a test read what a container saw (env, mounted files) over HTTP
on the pod's IP.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from localcluster import LocalCluster, podman
from localcluster.health import wait_for
from localcluster.ports import pick_unused_pod_cidr

pytestmark = pytest.mark.e2e

BUSYBOX = Path("/bin/busybox")


@pytest.fixture(scope="module")
def busybox_image(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not BUSYBOX.exists():
        pytest.fail("no /bin/busybox: run dev/setup.sh (installs busybox-static)")
    ctx = tmp_path_factory.mktemp("busybox-image")
    shutil.copy(BUSYBOX, ctx / "busybox")
    (ctx / "Containerfile").write_text('FROM scratch\nCOPY busybox /bin/busybox\nENTRYPOINT ["/bin/busybox"]\n'
                                       'CMD ["sh", "-c", "sleep 3600"]\n')
    tag = "localhost/sparsegate-test-busybox:e2e"
    subprocess.run(["buildah", "bud", "--isolation", "chroot", "-q", "-t", tag, str(ctx)], check=True,
                   capture_output=True, env=podman._env(), timeout=120)
    return tag


@pytest.fixture(scope="module")
def ccluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    state = tmp_path_factory.mktemp("ccluster")
    local = LocalCluster(state_dir=state, pod_cidr=pick_unused_pod_cidr(), containers=True)
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture
def ns(ccluster: LocalCluster) -> Iterator[str]:
    name = f"cr-{time.monotonic_ns() % 10**8}"
    ccluster.kubectl("create", "namespace", name)
    wait_for(lambda: ccluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
             what="default ServiceAccount", timeout_s=60)
    yield name
    ccluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def apply(cluster: LocalCluster, namespace: str, *objs: dict) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                           "items": list(objs)}))


def get_pod(cluster: LocalCluster, namespace: str, name: str) -> dict:
    return json.loads(cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)


def container_status(cluster: LocalCluster, namespace: str, name: str) -> dict:
    return (get_pod(cluster, namespace, name)["status"].get("containerStatuses") or [{}])[0]


def events(cluster: LocalCluster, namespace: str, name: str) -> list[dict]:
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                          "-o", "json").stdout
    return json.loads(out)["items"]


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=3) as resp:
        return resp.read().decode()


def pod(name: str, image: str, command: list[str], **container: object) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"terminationGracePeriodSeconds": 2,
                     "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                                     "command": command, **container}]}}


def test_pod_runs_with_env_volumes_token_and_readiness(ccluster: LocalCluster, ns: str, busybox_image: str) -> None:
    script = ("env > /www/env && cat /etc/cfg/greeting > /www/greeting && "
              "cp /var/run/secrets/kubernetes.io/serviceaccount/token /www/token && "
              "cat /var/run/secrets/kubernetes.io/serviceaccount/namespace > /www/ns && "
              "touch /scratch/ok && id -u > /www/uid && "
              "sleep 3 && exec /bin/busybox httpd -f -p $(POD_IP):8080 -h /www")
    web = pod("web", busybox_image, ["/bin/busybox", "sh", "-c", script],
              env=[{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                   {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "password"}}}],
              ports=[{"name": "http", "containerPort": 8080}],
              readinessProbe={"httpGet": {"path": "/greeting", "port": "http"}, "periodSeconds": 1},
              volumeMounts=[{"name": "cfg", "mountPath": "/etc/cfg", "readOnly": True},
                            {"name": "scratch", "mountPath": "/scratch"}, {"name": "www", "mountPath": "/www"}],
              securityContext={"runAsUser": 65532, "allowPrivilegeEscalation": False,
                               "capabilities": {"drop": ["ALL"]}})
    web["spec"]["volumes"] = [{"name": "cfg", "configMap": {"name": "cfg"}}, {"name": "scratch", "emptyDir": {}},
                              {"name": "www", "emptyDir": {}}]
    apply(ccluster, ns,
          {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"greeting": "hello"}},
          {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "stringData": {"password": "pw"}},
          web)
    # Running but not Ready until the readiness probe passes (httpd starts after 3 s).
    first = wait_for(lambda: (s := container_status(ccluster, ns, "web")).get("state", {}).get("running") and s,
                     what="container running", timeout_s=60)
    assert first["ready"] is False  # running, probe not passed yet
    ready = wait_for(lambda: {c["type"]: c["status"] for c in get_pod(ccluster, ns, "web")["status"]["conditions"]}
                     .get("Ready") == "True", what="pod Ready", timeout_s=60)
    assert ready
    ip = get_pod(ccluster, ns, "web")["status"]["podIP"]
    env = dict(line.split("=", 1) for line in fetch(f"http://{ip}:8080/env").splitlines() if "=" in line)
    assert env["PASSWORD"] == "pw" and env["POD_IP"] == ip
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == str(ccluster.ports.apiserver)
    assert fetch(f"http://{ip}:8080/greeting") == "hello" and fetch(f"http://{ip}:8080/ns") == ns
    assert fetch(f"http://{ip}:8080/uid").strip() == "65532"
    # The mounted token is a real bound ServiceAccount token: the API server knows who it is.
    token = fetch(f"http://{ip}:8080/token")
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
    who = json.loads(ccluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review)).stdout)["status"]
    assert who["authenticated"] and who["user"]["username"] == f"system:serviceaccount:{ns}:default"
    assert who["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["web"]  # bound to this pod


def test_crashing_container_restarts_with_back_off(ccluster: LocalCluster, ns: str, busybox_image: str) -> None:
    apply(ccluster, ns, pod("crash", busybox_image, ["/bin/busybox", "sh", "-c", "echo boom; exit 3"]))
    status = wait_for(lambda: (s := container_status(ccluster, ns, "crash")).get("restartCount", 0) >= 2 and s,
                      what="two restarts", timeout_s=60)
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert {c["type"]: c["status"] for c in get_pod(ccluster, ns, "crash")["status"]["conditions"]}["Ready"] == "False"
    waiting = wait_for(lambda: container_status(ccluster, ns, "crash")["state"].get("waiting"),
                       what="CrashLoopBackOff", timeout_s=30)
    assert waiting["reason"] == "CrashLoopBackOff"
    assert any(e["reason"] == "BackOff" for e in events(ccluster, ns, "crash"))


def test_missing_image_waits_with_a_clear_reason(ccluster: LocalCluster, ns: str) -> None:
    apply(ccluster, ns, pod("noimage", "localhost/sparsegate-does-not-exist:1", ["x"]))
    waiting = wait_for(lambda: container_status(ccluster, ns, "noimage").get("state", {}).get("waiting", {})
                       .get("reason") == "ErrImageNeverPull" and container_status(ccluster, ns, "noimage"),
                       what="ErrImageNeverPull", timeout_s=30)
    assert "sparsegate-does-not-exist" in waiting["state"]["waiting"]["message"]
    assert any(e["reason"] == "ErrImageNeverPull" for e in events(ccluster, ns, "noimage"))


def test_unsupported_field_is_reported_not_skipped(ccluster: LocalCluster, ns: str, busybox_image: str) -> None:
    spec = pod("lifecycle", busybox_image, ["/bin/busybox", "sleep", "3600"])
    spec["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": ["true"]}}}
    apply(ccluster, ns, spec)
    found = wait_for(lambda: [e for e in events(ccluster, ns, "lifecycle") if e["reason"] == "UnsupportedField"],
                     what="UnsupportedField event", timeout_s=30)
    assert "spec.containers[0].lifecycle" in found[0]["message"] and found[0]["type"] == "Warning"


def test_liveness_failure_restarts_and_deletion_removes_the_container(ccluster: LocalCluster, ns: str,
                                                                      busybox_image: str) -> None:
    spec = pod("unhealthy", busybox_image, ["/bin/busybox", "sleep", "3600"],
               livenessProbe={"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2})
    apply(ccluster, ns, spec)
    wait_for(lambda: container_status(ccluster, ns, "unhealthy").get("restartCount", 0) >= 1,
             what="restart after liveness failures", timeout_s=60)
    assert any(e["reason"] == "Unhealthy" for e in events(ccluster, ns, "unhealthy"))
    uid = get_pod(ccluster, ns, "unhealthy")["metadata"]["uid"]
    ccluster.kubectl("delete", "pod", "unhealthy", "-n", ns, "--wait=true", "--timeout=60s")

    def gone() -> bool:
        out = podman.podman("ps", "-a", "--filter", f"label={podman.LABEL_POD_UID}={uid}", "--format", "{{.Names}}")
        return out.stdout.strip() == ""

    assert wait_for(gone, what="container removed with its pod", timeout_s=60)


def test_a_deleted_pod_s_object_outlives_its_stopping_container(ccluster: LocalCluster, ns: str,
                                                                   busybox_image: str) -> None:
    """As under a kubelet, the object of a deleted pod stays (with its deletionTimestamp) until its
    containers have stopped, so a stopping process's ServiceAccount token still authenticates."""
    spec = pod("slowstop", busybox_image, ["/bin/busybox", "sleep", "3600"])  # pid 1 ignores SIGTERM
    spec["spec"]["terminationGracePeriodSeconds"] = 3
    apply(ccluster, ns, spec)
    wait_for(lambda: container_status(ccluster, ns, "slowstop").get("ready"), what="slowstop running", timeout_s=60)
    uid = get_pod(ccluster, ns, "slowstop")["metadata"]["uid"]

    def container_listed() -> bool:
        out = podman.podman("ps", "-a", "--filter", f"label={podman.LABEL_POD_UID}={uid}", "--format", "{{.Names}}")
        return out.stdout.strip() != ""

    t0 = time.monotonic()
    ccluster.kubectl("delete", "pod", "slowstop", "-n", ns, "--wait=false")
    object_gone_s = None
    while object_gone_s is None and time.monotonic() - t0 < 60:
        found = ccluster.kubectl("get", "pod", "slowstop", "-n", ns, "-o", "json", check=False)
        listed = container_listed()  # after the object's read: listed here means listed when it was gone
        if found.returncode == 0:
            assert json.loads(found.stdout)["metadata"].get("deletionTimestamp")
        else:
            object_gone_s = time.monotonic() - t0
            assert not listed, "the pod's object went while its container was still there"
        time.sleep(0.1)
    assert object_gone_s is not None, "the deleted pod's object was never removed"
    # Its grace is 3 s and sleep ignores SIGTERM: the object lived through the SIGKILL.
    assert object_gone_s >= 2.5, f"object gone {object_gone_s:.1f}s after the delete, before the grace ran out"
    log = ccluster.layout.log("podrunner").read_text()
    assert f"deleted pod {ns}/slowstop ({uid[:8]}): its containers have stopped" in log


KILLED_SESSION = """
import json, sys, time
from pathlib import Path
from localcluster import LocalCluster
from localcluster.ports import pick_unused_pod_cidr
cluster = LocalCluster(state_dir=Path(sys.argv[1]), pod_cidr=pick_unused_pod_cidr(), containers=True)
cluster.start()
pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
       "spec": {"terminationGracePeriodSeconds": 1, "containers": [{"name": "main", "image": sys.argv[2],
                "imagePullPolicy": "Never", "command": ["/bin/busybox", "sleep", "3600"]}]}}
cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
path = "jsonpath={.status.containerStatuses[0].state.running}"
while not cluster.kubectl("get", "pod", "p", "-o", path, check=False).stdout.strip():
    time.sleep(0.5)
print("running", flush=True)
time.sleep(600)
"""


def test_a_session_killed_hard_leaves_no_container_running(tmp_path: Path, busybox_image: str) -> None:
    # A test session SIGKILLed (a CI timeout) takes its cluster's components with it
    # (die_with_parent); the pod runner must still remove its containers, which nothing else knows.
    import os
    import signal
    import sys

    state = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "dev")}
    session = subprocess.Popen([sys.executable, "-c", KILLED_SESSION, str(state), busybox_image], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runner = podman.runner_id(state / "podrunner")
    try:
        assert session.stdout is not None
        said = []
        for line in session.stdout:
            said.append(line)
            if line.strip() == "running":
                break
        else:
            pytest.fail("the session ended before its pod ran:\n" + "".join(said))
        assert podman.list_containers(runner)
    finally:
        session.send_signal(signal.SIGKILL)
        session.wait()
    try:
        wait_for(lambda: not podman.list_containers(runner), what="the killed session's containers removed",
                 timeout_s=60)
    finally:
        LocalCluster(state_dir=state).stop()
