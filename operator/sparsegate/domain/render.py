"""Render a SparseModel and its resolved gate into the objects it owns (dev/CONTRACTS.md).

Pure builders: each returns a complete apply configuration (the fields the operator owns, no
more), so server-side apply of the same input is a no-op. Side effects live in clients.kube.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Mapping

from sparsegate_contracts import names
from sparsegate_contracts.gate import GateDocument, default_max_experts
from sparsegate_contracts.names import (
    ADMIN_PORT_NAME,
    ADMIN_TLS_CERT_KEY,
    ADMIN_TLS_KEY_KEY,
    ADMIN_TOKEN_KEY,
    API_VERSION,
    DEFAULT_ADMIN_PORT,
    GATE_CHECKSUM_ANNOTATION,
    GATE_VERSION_ANNOTATION,
    INSTANCE_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    MODEL_LABEL,
    MODEL_SERVER_NAME,
    NAME_LABEL,
)

from sparsegate.domain.admin_tls import AdminMaterial

KIND = "SparseModel"

GATE_KEY = "gate.json"
GATE_DIR = "/etc/sparsegate"
# Secret <model>-admin mounted as a directory (not subPath), so a changed Secret reaches the
# running server's files and it rotates its token and certificate without a restart.
ADMIN_DIR = "/etc/sparsegate-admin"
CONTAINER_NAME = "server"
PORT_NAME = "http"
DEFAULT_PORT = 8080

# Every listener binds the pod's own IP (pods may share one network namespace, as in the local dev
# cluster): the kubelet expands $(POD_IP) in the args from this downward-API variable.
POD_IP_ENV = "POD_IP"

# The image of pods whose SparseModel sets no spec.image: the operator's env (the chart's
# modelServer.image), else this.
MODEL_IMAGE_ENV = "SPARSEGATE_MODEL_IMAGE"
MODEL_IMAGE_PULL_POLICY_ENV = "SPARSEGATE_MODEL_IMAGE_PULL_POLICY"
# Comma-separated Secret names (chart modelServer.imagePullSecrets) every model pod lists.
MODEL_IMAGE_PULL_SECRETS_ENV = "SPARSEGATE_MODEL_IMAGE_PULL_SECRETS"
DEFAULT_MODEL_IMAGE = "ghcr.io/sparsegate/model-server:0.1.0"

# Pod Security "restricted" (charts/sparsegate/README.md "Pod Security admission"). The uid/gid are
# the image's USER (workloads/Containerfile), set here too so the kubelet need not trust the image
# for runAsNonRoot (it refuses an image whose USER is a name).
MODEL_UID = 65532
POD_SECURITY_CONTEXT: Mapping[str, Any] = {
    "runAsNonRoot": True, "runAsUser": MODEL_UID, "runAsGroup": MODEL_UID,
    "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT: Mapping[str, Any] = {
    "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
# The only writable path: torch takes a temp directory when it loads (with none, a checkpoint
# fails "No usable temporary directory found"). Library caches that would go under the read-only
# home go there too.
TMP_VOLUME = "tmp"
TMP_DIR = "/tmp"
CACHE_ENV = (("XDG_CACHE_HOME", f"{TMP_DIR}/.cache"),  # Hugging Face (HF_HOME), torch hub
             ("TRITON_CACHE_DIR", f"{TMP_DIR}/.triton"),
             ("CUDA_CACHE_PATH", f"{TMP_DIR}/.nv/ComputeCache"))

# Ports below 1024 are privileged: the server runs as MODEL_UID with every capability dropped (an
# added NET_BIND_SERVICE never reaches a non-root process's effective set), so it could not bind a
# servingPort under 1024 (EACCES: a crash loop) unless its pod's own network namespace lets
# unprivileged processes bind from there. A namespaced "safe" sysctl: allowed by every kubelet
# since Kubernetes 1.22 and by Pod Security restricted.
UNPRIVILEGED_PORT_SYSCTL = "net.ipv4.ip_unprivileged_port_start"
PRIVILEGED_PORTS_END = 1024

# Graceful stop (the server's --shutdown-delay, set by its environment variable, which a
# model-server image older than the operator ignores where it would refuse a flag): on SIGTERM
# the server turns unready and keeps serving this long, while endpoints and kube-proxy drop the pod,
# then refuses new requests (503) and lets those in flight finish, each within the server's
# --request-timeout (default 30 s). The grace period covers both, and the exit, so the kubelet's
# SIGKILL never cuts a generation that would have finished (Kubernetes' default is 30 s).
SHUTDOWN_DELAY_ENV = "SPARSEGATE_SHUTDOWN_DELAY"  # sparsegate_workload.server.SHUTDOWN_DELAY_ENV
SHUTDOWN_DELAY_S = 5
SERVER_REQUEST_TIMEOUT_S = 30  # sparsegate_workload.server_state.DEFAULT_REQUEST_TIMEOUT_S
TERMINATION_GRACE_S = SHUTDOWN_DELAY_S + SERVER_REQUEST_TIMEOUT_S + 10

GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE_LABEL = "nvidia.com/gpu.present"
CPU_MEMORY = ("cpu", "memory")  # spec.resources.requests / limits keys (Kubernetes quantities)


@dataclasses.dataclass(frozen=True)
class DefaultImage:
    """What pods of a SparseModel without ``spec.image`` run. The pull policy applies to this
    image only: an image a user names gets Kubernetes' default policy for it. The pull secrets go
    on every model pod (a ``spec.image`` is likely in the same registry; a secret the pull does
    not need is unused)."""

    image: str = DEFAULT_MODEL_IMAGE
    pull_policy: str | None = None
    pull_secrets: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DefaultImage:
        secrets = (env.get(MODEL_IMAGE_PULL_SECRETS_ENV) or "").split(",")
        return cls(image=env.get(MODEL_IMAGE_ENV) or DEFAULT_MODEL_IMAGE,
                   pull_policy=env.get(MODEL_IMAGE_PULL_POLICY_ENV) or None,
                   pull_secrets=tuple(n.strip() for n in secrets if n.strip()))


def gate_configmap_name(model: str) -> str:
    return f"{model}-gate"


def admin_secret_name(model: str) -> str:
    return f"{model}-admin"


def selector_labels(model: str) -> dict[str, str]:
    """Immutable Deployment selector; also what Services and policies match pods by."""
    return {NAME_LABEL: MODEL_SERVER_NAME, MODEL_LABEL: model}


def common_labels(model: str) -> dict[str, str]:
    return {**selector_labels(model), MANAGED_BY_LABEL: MANAGED_BY, INSTANCE_LABEL: model}


def owner_reference(model: Mapping[str, Any]) -> dict[str, Any]:
    meta = model["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _metadata(model: Mapping[str, Any], name: str, **extra: Any) -> dict[str, Any]:
    meta = model["metadata"]
    return {"name": name, "namespace": meta["namespace"], "labels": common_labels(meta["name"]),
            "ownerReferences": [owner_reference(model)], **extra}


def gate_json(document: GateDocument) -> str:
    """The file the server reads: stable key order so equal documents render byte-identically."""
    return document.file_text()


def render_configmap(model: Mapping[str, Any], document: GateDocument) -> dict[str, Any]:
    name = gate_configmap_name(model["metadata"]["name"])
    annotations = {GATE_VERSION_ANNOTATION: document.version,
                   GATE_CHECKSUM_ANNOTATION: document.checksum}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(model, name, annotations=annotations),
            "data": {GATE_KEY: gate_json(document)}}


def admin_server_name(model: Mapping[str, Any]) -> str:
    """The name in the model's admin certificate and the TLS server name the operator checks."""
    meta = model["metadata"]
    return names.admin_server_name(model=meta["name"], namespace=meta["namespace"])


def render_secret(model: Mapping[str, Any], *, material: AdminMaterial) -> dict[str, Any]:
    """Secret ``<model>-admin``: token, certificate and key of the admin channel. Random, so it is
    created once (or replaced when incomplete or expiring, see ``admin_tls.secret_problem``),
    never re-applied on each reconcile."""
    name = admin_secret_name(model["metadata"]["name"])
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _metadata(model, name), "data": material.secret_data()}


HEADLESS = "None"  # Service.spec.clusterIP of a headless Service


def render_service(model: Mapping[str, Any]) -> dict[str, Any]:
    """ClusterIP Service ``<model>``; headless (clusterIP None) with ``spec.service.headless``
    (immutable in the CRD, as clusterIP is in the Service: never switched in place)."""
    name = model["metadata"]["name"]
    port = serving_port(model)
    spec: dict[str, Any] = {"type": "ClusterIP", "selector": selector_labels(name),
                            "ports": [{"name": PORT_NAME, "port": port, "targetPort": PORT_NAME,
                                       "protocol": "TCP"}]}
    if headless_service(model):
        spec["clusterIP"] = HEADLESS
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(model, name), "spec": spec}


def headless_service(model: Mapping[str, Any]) -> bool:
    return bool((model["spec"].get("service") or {}).get("headless"))


def serving_port(model: Mapping[str, Any]) -> int:
    return int(model["spec"].get("servingPort") or DEFAULT_PORT)


def gpus(model: Mapping[str, Any]) -> int:
    return int((model["spec"].get("resources") or {}).get("gpus") or 0)


def container_resources(model: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The model server container's ``resources``: ``spec.resources.requests``/``limits`` (cpu,
    memory: Kubernetes quantities, as written) and ``gpus`` as nvidia.com/gpu in both; a part
    with nothing in it is left out (no requests and limits at all: BestEffort, as before)."""
    res = model["spec"].get("resources") or {}
    n_gpus = gpus(model)
    out: dict[str, dict[str, str]] = {}
    for part in ("limits", "requests"):
        values = {k: str(v) for k, v in (res.get(part) or {}).items() if k in CPU_MEMORY and v is not None}
        if n_gpus > 0:
            values[GPU_RESOURCE] = str(n_gpus)
        if values:
            out[part] = values
    return out


# SparseModel spec.model field -> model server flag (sparsegate_workload.server).
MODEL_SHAPE_FLAGS = (("dModel", "--d-model"), ("experts", "--experts"),
                     ("minExpertsPerToken", "--min-experts-per-token"),
                     ("maxExpertsPerToken", "--max-experts-per-token"))


def model_shape_args(model: Mapping[str, Any]) -> list[str]:
    """The server flags for ``spec.model``. An unset maxExpertsPerToken is the smaller of 4 and
    experts (``default_max_experts``; the CRD has no default for it, so a 2-expert model is valid
    as written); other absent optional fields keep the server's defaults (the API server fills in
    the CRD's)."""
    shape = dict(model["spec"]["model"])
    if shape.get("maxExpertsPerToken") is None and shape.get("experts") is not None:
        shape["maxExpertsPerToken"] = default_max_experts(int(shape["experts"]))
    args: list[str] = []
    for field, flag in MODEL_SHAPE_FLAGS:
        if shape.get(field) is not None:
            args += [flag, str(int(shape[field]))]
    return args


BUILTIN_SOURCE_PREFIX = "builtin:"
MODEL_VOLUME = "model"


def checkpoint_path(model: Mapping[str, Any]) -> str | None:
    """The Hugging Face checkpoint directory ``spec.model.source`` names, None for the built-in model."""
    source = model["spec"]["model"].get("source")
    return None if not source or source.startswith(BUILTIN_SOURCE_PREFIX) else str(source)


def model_args(model: Mapping[str, Any]) -> list[str]:
    """Server flags for the model: a checkpoint (its own shape; served under the SparseModel's name)
    or the built-in model's shape. A checkpoint with ``spec.resources.gpus > 0`` runs on CUDA
    (``--device cuda``: the server exits with the reason if the pod sees no GPU, rather than
    silently serving from the CPU); the built-in demo model always runs on the CPU."""
    path = checkpoint_path(model)
    if path is None:
        return model_shape_args(model)
    device = ["--device", "cuda"] if gpus(model) > 0 else []
    return ["--model-path", literal_arg(path), "--served-model-name", model["metadata"]["name"],
            *device]


def literal_arg(value: str) -> str:
    """``value`` as a container arg the kubelet passes through unchanged: it expands ``$(VAR)``
    in args and turns ``$$`` into ``$``, so every ``$`` of user data is doubled."""
    return value.replace("$", "$$")


def tool_args(model: Mapping[str, Any]) -> list[str]:
    """``spec.tools`` as the server's ``--tools-json`` (none when absent or empty). The server
    parses and checks it again at start; the built-in model's tool gate calls them, a
    checkpoint's only with a tool-gate head (sparsegate_tool_gate.safetensors) beside its weights."""
    tools = model["spec"].get("tools") or []
    if not tools:
        return []
    return ["--tools-json", literal_arg(json.dumps(
        [{k: t[k] for k in ("name", "url", "timeoutMs") if k in t} for t in tools],
        separators=(",", ":")))]


def expert_group_args(model: Mapping[str, Any]) -> list[str]:
    """``spec.expertGroups`` as the server's ``--expert-groups-json`` (none when absent or empty).
    The server parses and checks it again at start (``sparsegate_contracts.request_access``)."""
    groups = model["spec"].get("expertGroups") or []
    if not groups:
        return []
    return ["--expert-groups-json", json.dumps([{"name": g["name"], "experts": list(g["experts"])}
                                                for g in groups], separators=(",", ":"))]


def request_auth_enforced(model: Mapping[str, Any]) -> bool:
    """``spec.access.requestAuth`` is Enforce (absent or Off: callers are not checked)."""
    access = model["spec"].get("access") or {}
    return access.get("requestAuth", names.REQUEST_AUTH_OFF) == names.REQUEST_AUTH_ENFORCE


def request_auth_args(model: Mapping[str, Any]) -> list[str]:
    """``--request-auth in-cluster`` (and ``--token-cache-ttl``) when the model enforces callers.
    The server finds the API server from the pod's KUBERNETES_SERVICE_HOST/PORT and reviews
    tokens with its own mounted ServiceAccount token (``names.MODEL_SERVICE_ACCOUNT``)."""
    if not request_auth_enforced(model):
        return []
    args = ["--request-auth", "in-cluster"]
    ttl = (model["spec"].get("access") or {}).get("tokenCacheSeconds")
    if ttl is not None:
        args += ["--token-cache-ttl", str(int(ttl))]
    return args


def render_deployment(model: Mapping[str, Any], document: GateDocument, *,
                      default_image: DefaultImage = DefaultImage()) -> dict[str, Any]:
    """The model server Deployment.

    The gate version goes on the Deployment's metadata, NOT the pod template: a new stable gate
    changes what new pods read from the ConfigMap, while running pods are switched one by one by
    the rollout controller (PUT /admin/gate on the admin port), never by a rolling restart.
    """
    meta, spec = model["metadata"], model["spec"]
    name = meta["name"]
    port = serving_port(model)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.get("image") or default_image.image,
        "command": ["python", "-m", "sparsegate_workload.server"],
        "args": [f"--host=$({POD_IP_ENV})", "--port", str(port),
                 "--gate-config", f"{GATE_DIR}/{GATE_KEY}",
                 "--admin-port", str(DEFAULT_ADMIN_PORT),
                 "--admin-token-file", f"{ADMIN_DIR}/{ADMIN_TOKEN_KEY}",
                 "--admin-tls-cert", f"{ADMIN_DIR}/{ADMIN_TLS_CERT_KEY}",
                 "--admin-tls-key", f"{ADMIN_DIR}/{ADMIN_TLS_KEY_KEY}",
                 *model_args(model), *tool_args(model), *expert_group_args(model),
                 *request_auth_args(model)],
        # The admin port is declared (the operator reads it from the pod) but in no Service.
        "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"},
                  {"name": ADMIN_PORT_NAME, "containerPort": DEFAULT_ADMIN_PORT, "protocol": "TCP"}],
        "env": [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                *({"name": k, "value": v} for k, v in CACHE_ENV),
                {"name": SHUTDOWN_DELAY_ENV, "value": str(SHUTDOWN_DELAY_S)}],
        "volumeMounts": [{"name": "gate", "mountPath": GATE_DIR, "readOnly": True},
                         {"name": "admin", "mountPath": ADMIN_DIR, "readOnly": True},
                         {"name": TMP_VOLUME, "mountPath": TMP_DIR}],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        # Importing torch and building the model can take minutes on a busy node: liveness only
        # starts once the server has answered /healthz (up to 5 minutes), as for any slow starter.
        "startupProbe": {"httpGet": {"path": "/healthz", "port": PORT_NAME}, "periodSeconds": 2,
                         "failureThreshold": 150},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": PORT_NAME}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": PORT_NAME}, "periodSeconds": 10},
    }
    if not spec.get("image") and default_image.pull_policy:
        container["imagePullPolicy"] = default_image.pull_policy
    pod_spec: dict[str, Any] = {
        "containers": [container],
        # Mount the directory, not a subPath, so ConfigMap updates reach running pods' files.
        # The Secret's default file mode (0644, owner root) lets the image's non-root user read
        # the key; the pod runs the server alone, so no other process shares those files.
        "volumes": [{"name": "gate", "configMap": {"name": gate_configmap_name(name)}},
                    {"name": "admin", "secret": {"secretName": admin_secret_name(name)}},
                    {"name": TMP_VOLUME, "emptyDir": {}}],
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
    }
    if port < PRIVILEGED_PORTS_END:
        pod_spec["securityContext"]["sysctls"] = [{"name": UNPRIVILEGED_PORT_SYSCTL, "value": str(port)}]
    if default_image.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in default_image.pull_secrets]
    if request_auth_enforced(model):
        # TokenReview needs a ServiceAccount allowed to create them, and its token in the pod.
        pod_spec["serviceAccountName"] = names.MODEL_SERVICE_ACCOUNT
        pod_spec["automountServiceAccountToken"] = True
    else:
        # The namespace's default ServiceAccount. Both fields explicitly empty: the API server
        # mirrors serviceAccountName into the deprecated alias serviceAccount, which no apply owns,
        # so leaving them out after Enforce would keep the pods on sparsegate-model-server
        # (kubernetes#108208). Empty is the stored default: a template never changes for it.
        pod_spec["serviceAccountName"] = ""
        pod_spec["serviceAccount"] = ""
    claim = spec["model"].get("persistentVolumeClaim")
    if claim:
        # Read-only: the checkpoint is data the server only reads (and many pods share it). No
        # fsGroup: a kubelet does not change the ownership of a read-only volume, so the files
        # must be readable by uid/gid MODEL_UID or by all.
        pod_spec["volumes"].append({"name": MODEL_VOLUME, "persistentVolumeClaim": {
            "claimName": claim["claimName"], "readOnly": True}})
        container["volumeMounts"].append({"name": MODEL_VOLUME, "mountPath": claim["mountPath"], "readOnly": True})
    resources = container_resources(model)
    if resources:
        container["resources"] = resources
    n_gpus = gpus(model)
    if n_gpus > 0:
        pod_spec["nodeSelector"] = {GPU_NODE_LABEL: "true"}
        # GPU pools are commonly tainted so that only GPU workloads land there.
        pod_spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists",
                                    "effect": "NoSchedule"}]
    annotations = {GATE_VERSION_ANNOTATION: document.version,
                   GATE_CHECKSUM_ANNOTATION: document.checksum}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _metadata(model, name, annotations=annotations),
            "spec": {"replicas": int(spec.get("replicas", 1)),
                     "selector": {"matchLabels": selector_labels(name)},
                     "template": {"metadata": {"labels": common_labels(name)}, "spec": pod_spec}}}


def render_applied(model: Mapping[str, Any], document: GateDocument, *,
                   default_image: DefaultImage = DefaultImage()) -> list[dict[str, Any]]:
    """The objects each reconcile applies, in dependency order (config before pods); the caller
    skips the ConfigMap and Service while unchanged within --reapply-interval
    (``controllers.applied_objects``), the Deployment is applied every time."""
    return [render_configmap(model, document), render_service(model),
            render_deployment(model, document, default_image=default_image)]
