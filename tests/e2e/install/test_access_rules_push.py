"""Per-request access switched on with kubectl apply: the chart's operator, model-server containers,
TokenRequest tokens and a real TokenReview.

Given the dev stack with chart defaults (the operator serves its release namespace, where the chart
created ServiceAccount sparsegate-model-server with only create tokenreviews), a SparseModel with
expert groups a=[0,1], b=[2,3] and ``spec.access.requestAuth: Enforce`` runs its pods as that
ServiceAccount with ``--request-auth in-cluster``, and the operator pushes the access rules compiled
from the namespace's RoutingPolicies to every pod (condition AccessRulesApplied). With "caller-a
may use group a" and "caller-b is denied":
- caller-a naming group a: 200 on every pod, using only experts 0 and 1; caller-b: 403 naming the
  Deny; no token: 401;
- the Deny replaced by an Allow for caller-b: every pod follows (caller-b: 200) within seconds;
- a deleted pod's replacement gets the rules without anyone re-applying anything.
Timings are printed.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from devstack import RELEASE_NS, Stack
from localcluster import nodes
from localcluster.health import wait_for
from localcluster.ports import pick_unused_pod_cidr

from sparsegate_contracts import names
from sparsegate_contracts.request_access import EXPERT_GROUP_HEADER

pytestmark = pytest.mark.e2e

NS = RELEASE_NS  # chart defaults serve the release namespace only
MODEL = "moe-auth"
REPLICAS = 2
TOKENS = {"tokens": [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]}
FOLLOW_LIMIT_S = 15.0  # "within a few seconds": a round runs at once on the RoutingPolicy event


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(state_dir=tmp_path_factory.mktemp("access-push"), pod_cidr=pick_unused_pod_cidr(),
              node_shape=nodes.NodeShape(count=2, gpu_count=0))
    t0 = time.monotonic()
    s.build_images()
    t_images = time.monotonic()
    try:
        s.up()
        sys.stderr.write(f"\n[e2e] access-push stack: images {t_images - t0:.1f}s, cluster+helm+operator Ready "
                         f"{time.monotonic() - t_images:.1f}s\n")
        yield s
    finally:
        sys.stderr.write(f"[e2e] access-push stack diagnostics:\n{s.diagnose()[-6000:]}\n")
        s.down()


def _apply(stack: Stack, obj: dict) -> None:
    stack.kubectl("apply", "--server-side", "-n", NS, "-f", "-", input=json.dumps(obj))


def _model() -> dict:
    return {"apiVersion": names.API_VERSION, "kind": "SparseModel", "metadata": {"name": MODEL, "namespace": NS},
            "spec": {"replicas": REPLICAS, "model": {"dModel": 64, "experts": 4},
                     "expertGroups": [{"name": "a", "experts": [0, 1]}, {"name": "b", "experts": [2, 3]}],
                     "access": {"requestAuth": "Enforce"}}}


def _policy(name: str, action: str, caller: str, **target: object) -> dict:
    return {"apiVersion": names.API_VERSION, "kind": "RoutingPolicy", "metadata": {"name": name, "namespace": NS},
            "spec": {"action": action, "sources": [{"serviceAccount": caller}],
                     "targets": [{"sparseModel": MODEL, **target}]}}


def _conditions(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def _pods(stack: Stack) -> list[dict]:
    return [p for p in stack.pods(NS, f"{names.MODEL_LABEL}={MODEL}")
            if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
            and p["status"].get("phase") == "Running"]


def _token(stack: Stack, sa: str) -> str:
    return stack.kubectl("create", "token", sa, "-n", NS, "--duration=10m", "--audience=sparsegate").stdout.strip()


def _infer(ip: str, token: str | None = None, group: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if group is not None:
        headers[EXPERT_GROUP_HEADER] = group
    req = urllib.request.Request(f"http://{ip}:8080/v1/infer", data=json.dumps(TOKENS).encode(), headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError as e:  # not listening yet (a replacement pod starting)
        return 0, {"error": str(e)}


def _get_or_none(stack: Stack, kind: str, name: str) -> dict | None:
    proc = stack.kubectl("get", kind, name, "-n", NS, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def _applied(stack: Stack, pods: int) -> dict | None:
    """The model once AccessRulesApplied is True for ``pods`` pods at the current accessRevision."""
    model = stack.get("sparsemodel", MODEL, NS)
    cond = _conditions(model).get("AccessRulesApplied") or {}
    if cond.get("status") == "True" and cond.get("message", "").startswith(f"{pods}/{pods} pods hold"):
        return model
    return None


def test_enforced_model_gets_its_rules_and_follows_policy_changes(stack: Stack) -> None:
    for sa in ("caller-a", "caller-b"):
        stack.kubectl("create", "serviceaccount", sa, "-n", NS)
    _apply(stack, _policy("allow-a", "Allow", "caller-a", expertGroups=["a"]))
    _apply(stack, _policy("deny-b", "Deny", "caller-b"))
    t0 = time.monotonic()
    _apply(stack, _model())

    deployment = wait_for(lambda: _get_or_none(stack, "deployment", MODEL), what="Deployment rendered",
                          timeout_s=60)
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == names.MODEL_SERVICE_ACCOUNT
    args = pod_spec["containers"][0]["args"]
    assert args[args.index("--request-auth") + 1] == "in-cluster"

    wait_for(lambda: len(_pods(stack)) == REPLICAS and _conditions(stack.get("sparsemodel", MODEL, NS))
             .get("Ready", {}).get("status") == "True", what="model Ready", timeout_s=300, interval_s=1.0)
    t_ready = time.monotonic()
    model = wait_for(lambda: _applied(stack, REPLICAS), what="AccessRulesApplied True for every pod",
                     timeout_s=60, interval_s=0.2)
    t_applied = time.monotonic()
    revision = model["status"]["accessRevision"]
    assert revision.startswith("sha256:")

    token_a, token_b = _token(stack, "caller-a"), _token(stack, "caller-b")
    for pod in _pods(stack):
        ip = pod["status"]["podIP"]
        status, body = _infer(ip, token_a, "a")
        assert status == 200, (pod["metadata"]["name"], body)
        used = {e for layer in body["expertCounts"] for e, n in enumerate(layer) if n > 0}
        assert used and used <= {0, 1}, body["expertCounts"]
        assert body["access"]["rule"] == f"{NS}/allow-a#s0t0"
        status, body = _infer(ip, token_b, "a")
        assert status == 403 and body["rule"] == f"{NS}/deny-b#s0t0", body
        status, body = _infer(ip)
        assert status == 401, body

    # The Deny becomes an Allow: every pod follows without a restart.
    t_change = time.monotonic()
    _apply(stack, _policy("deny-b", "Allow", "caller-b"))

    def all_allow_b() -> bool:
        return all(_infer(p["status"]["podIP"], token_b, "b")[0] == 200 for p in _pods(stack))

    wait_for(all_allow_b, what="caller-b allowed on every pod", timeout_s=FOLLOW_LIMIT_S, interval_s=0.1)
    t_followed = time.monotonic()
    wait_for(lambda: (m := _applied(stack, REPLICAS)) and m["status"]["accessRevision"] != revision,
             what="status names the new revision", timeout_s=30, interval_s=0.2)

    # A replaced pod starts with no rules; the operator gives them to it.
    before = {p["metadata"]["name"] for p in _pods(stack)}
    victim = sorted(before)[0]
    t_delete = time.monotonic()
    stack.kubectl("delete", "pod", victim, "-n", NS, "--wait=false")

    def replacement_serves() -> bool:
        pods = [p for p in _pods(stack) if p["metadata"]["name"] != victim]
        new = [p for p in pods if p["metadata"]["name"] not in before]
        return len(pods) == REPLICAS and len(new) == 1 \
            and all(_infer(p["status"]["podIP"], token_a, "a")[0] == 200 for p in pods)

    wait_for(replacement_serves, what="replacement pod serves caller-a", timeout_s=300, interval_s=0.5)
    t_replaced = time.monotonic()

    sys.stderr.write(
        f"\n[e2e] access-push timings: model Ready {t_ready - t0:.1f}s after apply; AccessRulesApplied "
        f"{t_applied - t_ready:.2f}s after Ready; RoutingPolicy change -> caller-b 200 on all {REPLICAS} pods "
        f"{t_followed - t_change:.2f}s; pod deleted -> replacement serving with rules {t_replaced - t_delete:.1f}s\n")
    assert t_followed - t_change < FOLLOW_LIMIT_S


def test_model_service_account_may_create_tokenreviews_and_nothing_else(stack: Stack) -> None:
    user = f"system:serviceaccount:{NS}:{names.MODEL_SERVICE_ACCOUNT}"

    def can(verb: str, resource: str) -> str:
        return stack.kubectl("auth", "can-i", verb, resource, "-n", NS, f"--as={user}", check=False).stdout.strip()

    assert can("create", "tokenreviews.authentication.k8s.io") == "yes"
    for verb, resource in (("get", "secrets"), ("list", "pods"), ("create", "serviceaccounts/token"),
                           ("create", "subjectaccessreviews.authorization.k8s.io")):
        assert can(verb, resource) == "no", (verb, resource)
