"""Kubernetes names the components share: API group/version/plurals, labels, annotations.

The CRDs themselves are defined once, in ``charts/sparsegate/crds/`` (a unit test checks these
names against them).
"""

from __future__ import annotations

GROUP = "sparsegate.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# kind -> plural, for every CRD of the group
PLURALS: dict[str, str] = {
    "SparseModel": "sparsemodels",
    "GateConfig": "gateconfigs",
    "RoutingPolicy": "routingpolicies",
    "TelemetryProbe": "telemetryprobes",
}
SPARSEMODELS = PLURALS["SparseModel"]
GATECONFIGS = PLURALS["GateConfig"]
ROUTINGPOLICIES = PLURALS["RoutingPolicy"]
TELEMETRYPROBES = PLURALS["TelemetryProbe"]

# Labels. Model-server pods: NAME_LABEL=MODEL_SERVER_NAME and MODEL_LABEL=<SparseModel name>
# (the Deployment selector; also what the pod runner and the routing sync find pods by).
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
PART_OF_LABEL = "app.kubernetes.io/part-of"
COMPONENT_LABEL = "app.kubernetes.io/component"
MODEL_SERVER_NAME = "sparsegate-model"
MODEL_LABEL = f"{GROUP}/model"
MANAGED_BY = "sparsegate"
PART_OF = "sparsegate"
FLOW_POLICY_COMPONENT = "flow-policy"

# Annotations.
GATE_VERSION_ANNOTATION = f"{GROUP}/gate-version"  # Deployment and <m>-gate ConfigMap
GATE_CHECKSUM_ANNOTATION = f"{GROUP}/gate-checksum"
ABORT_ANNOTATION = f"{GROUP}/abort"  # GateConfig, one-shot (any value)
PROMOTE_ANNOTATION = f"{GROUP}/promote"  # GateConfig, one-shot: "step" = next step, "full"/"now"/"all" = all; else refused
RETRY_ANNOTATION = f"{GROUP}/retry"  # GateConfig, one-shot (any value): re-run the rejected version the spec names
FLOW_POLICY_VERSION_ANNOTATION = f"{GROUP}/flow-policy-version"  # sparsegate-flow-policy ConfigMap
# What OPA last decided the published allow-list from (operator-only; lets a restarted operator fail closed).
FLOW_POLICY_BASIS_ANNOTATION = f"{GROUP}/flow-policy-basis"

# Kopf's bookkeeping on our objects: progress/diff-base annotations under GROUP, and a finalizer.
KOPF_ANNOTATION_PREFIX = GROUP
KOPF_DIFFBASE_KEY = "last-handled-configuration"
FINALIZER = f"{GROUP}/finalizer"

# The model server's admin channel (GET/PUT /admin/gate): a TLS listener of its own on every
# model-server pod (container port ADMIN_PORT_NAME, not in the Service: the operator calls pod IPs).
# Secret <model>-admin (type Opaque) holds exactly these keys; the server reads them as files of a
# Secret volume, so a change of the Secret reaches running pods without a restart.
ADMIN_PORT_NAME = "admin"
DEFAULT_ADMIN_PORT = 8443
ADMIN_TOKEN_KEY = "token"
ADMIN_TLS_CERT_KEY = "tls.crt"
ADMIN_TLS_KEY_KEY = "tls.key"
ADMIN_SECRET_KEYS = (ADMIN_TOKEN_KEY, ADMIN_TLS_CERT_KEY, ADMIN_TLS_KEY_KEY)

# SparseModel spec.access.requestAuth Enforce: pods run as this ServiceAccount, which the chart
# creates in each served namespace and binds to a ClusterRole with only create tokenreviews.
MODEL_SERVICE_ACCOUNT = "sparsegate-model-server"
REQUEST_AUTH_OFF = "Off"
REQUEST_AUTH_ENFORCE = "Enforce"


def admin_server_name(*, model: str, namespace: str) -> str:
    """The DNS name the model's admin certificate carries (subjectAltName) and the operator checks
    (TLS server name). Not resolvable and never looked up: it names the model, not a host."""
    return f"{model}.{namespace}.admin.{GROUP}"
