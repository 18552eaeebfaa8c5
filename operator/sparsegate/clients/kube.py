"""A small JSON-in, JSON-out Kubernetes client for the operator's own writes.

Rendered objects are plain dicts, so this wraps the official client's transport (auth, TLS,
kubeconfig or in-cluster config) rather than its typed models. Rendered workload objects
(ConfigMap, Service, Deployment) are written with server-side apply, field manager ``sparsegate``
and ``force`` (the admin Secret and the probe ConfigMaps are created and replaced whole): the
operator owns exactly
the fields it renders, re-applying identical input is a no-op (no resourceVersion bump), and
fields set by others (e.g. an HPA's replicas if one is added later) are never clobbered
unless we render them.

A 429 (API Priority and Fairness) or a 5xx with Retry-After is sent again after the wait it asks
for, as client-go does, within the request's timeout (``Kube.request``).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Mapping
from urllib.parse import quote

import kubernetes
import prometheus_client
import urllib3

from sparsegate_contracts import names

FIELD_MANAGER = "sparsegate"
# Kept-alive connections to the API server. The client's default (5 per CPU) is below what the
# operator's threads send at once (model pool, its apply fan-out, rollout and access loops): a
# connection over the limit is closed after one request, and the next costs a new TLS handshake.
CONNECTIONS = 64
# Default bound on one request (connect + response); callers with a deadline pass a shorter one.
# It bounds the retries below too: every attempt and every wait fit in it.
REQUEST_TIMEOUT_S = 30.0
# Answers tried again, as client-go does: 429 (API Priority and Fairness turned the request away
# before handling it) and a 5xx carrying Retry-After, whatever the verb; a 5xx without it only for a
# GET (a read repeats safely). Each waits what Retry-After says, else a doubling backoff.
RETRIES = 5
RETRY_BACKOFF_S = 0.25
RETRY_WAIT_MAX_S = 10.0

# Plural and group/version per kind this operator reads or writes; add here for a new kind.
# The chart's admission policy covers exactly the core kinds written here (a unit test checks it).
WRITTEN_KINDS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),
    "Service": ("v1", "services"),
    "Deployment": ("apps/v1", "deployments"),
    **{kind: (names.API_VERSION, plural) for kind, plural in names.PLURALS.items()},
    "Lease": ("coordination.k8s.io/v1", "leases"),
}
# Kinds only read (the rollout controller's ReplicaSet owner check; Pod: none today, pods come
# from the operator's watch indexes).
READ_KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("v1", "pods"),
    "ReplicaSet": ("apps/v1", "replicasets"),
}
_KINDS: dict[str, tuple[str, str]] = {**WRITTEN_KINDS, **READ_KINDS}


# What the operator asks of the API server, so the cost of a reconcile at scale is visible (the
# scale benchmark divides these by reconciles). ``verb``: get, list, create, update, patch, delete.
API_REQUESTS = prometheus_client.Counter(
    "sparsegate_operator_kube_requests_total",
    "Requests the operator's own client sent to the Kubernetes API server, by answer code (Kopf's watches "
    "and its own patches are not counted).",
    ["verb", "resource", "code"])


# How long each of those took (sent until the whole answer was read): with the counts above, where
# a reconcile's time goes.
API_REQUEST_SECONDS = prometheus_client.Histogram(
    "sparsegate_operator_kube_request_duration_seconds",
    "Time from sending a request of the operator's own client to reading its whole answer.",
    # Up to REQUEST_TIMEOUT_S: an attempt can take that long before it times out.
    ["verb", "resource"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def verb_and_resource(method: str, path: str) -> tuple[str, str]:
    """(``get`` | ``list`` | ``create`` | ..., plural[/subresource]) of one API path."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    # /api/v1/namespaces/<ns>/<plural>[/<name>[/<sub>]] or /apis/<group>/<version>/namespaces/...
    rest = parts[parts.index("namespaces") + 2:] if "namespaces" in parts else parts[2 if parts[:1] == ["api"] else 3:]
    resource = rest[0] if rest else "unknown"
    if len(rest) >= 3:
        resource = f"{resource}/{rest[2]}"
    named = len(rest) >= 2
    verb = {"GET": "get" if named else "list", "POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "delete"}.get(method.upper(), method.lower())
    return verb, resource


def retry_wait(method: str, status: int, retry_after: str | None, *, retry: int) -> float | None:
    """Seconds to wait before sending again an answer of ``status`` (None: not retried)."""
    if status != 429 and not (500 <= status <= 599 and (retry_after is not None or method.upper() == "GET")):
        return None
    try:
        wait = float(retry_after) if retry_after is not None else None
    except ValueError:
        wait = None  # an HTTP date: the API server sends seconds
    if wait is None or wait < 0:
        wait = RETRY_BACKOFF_S * 2 ** retry
    return min(wait, RETRY_WAIT_MAX_S)


def _header(resp: Any, name: str) -> str | None:
    headers = getattr(resp, "headers", None)
    return headers.get(name) if headers is not None else None


class KubeError(Exception):
    def __init__(self, status: int, reason: str, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.body = body


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    pass


def path_for(kind: str, *, namespace: str, name: str | None = None,
             subresource: str | None = None) -> str:
    group_version, plural = _KINDS[kind]
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    path = f"{root}/namespaces/{quote(namespace)}/{plural}"
    if name is not None:
        path += f"/{quote(name)}"
    if subresource:
        path += f"/{subresource}"
    return path


# The monotonic deadline of the ``Kube.request`` this thread is in (urllib3 retries in the caller's thread).
_request_deadline = threading.local()


class _DeadlineRetry(urllib3.util.Retry):
    """urllib3's retries of a broken connection, only while the request's deadline leaves time: each
    attempt gets the whole timeout again, so a GET to an API server that accepts and never answers
    (or a connect blackholed) took 4 x its timeout, 2 minutes instead of the 30 s ``Kube.request``
    promises."""

    def increment(self, method: str | None = None, url: str | None = None, response: Any = None,
                  error: Exception | None = None, _pool: Any = None, _stacktrace: Any = None) -> urllib3.util.Retry:
        retry = super().increment(method, url, response, error, _pool, _stacktrace)  # raises when out of retries
        deadline = getattr(_request_deadline, "at", None)
        if error is not None and deadline is not None and time.monotonic() >= deadline:
            raise urllib3.exceptions.MaxRetryError(_pool, url or "", error) from error
        return retry


def _api_client(config: kubernetes.client.Configuration) -> kubernetes.client.ApiClient:
    config.connection_pool_maxsize = CONNECTIONS
    # urllib3's retries of a broken connection stay (within the request's timeout); its own retry of
    # a 429/503 with Retry-After (GET and PUT only, waiting past the request's timeout) does not:
    # ``Kube.request`` retries.
    config.retries = _DeadlineRetry(3, respect_retry_after_header=False)
    return kubernetes.client.ApiClient(config)


class Kube:
    """Thread-safe for Kopf's sync handlers (each runs in an executor thread)."""

    def __init__(self, api_client: kubernetes.client.ApiClient, *,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._api = api_client
        self._sleep = sleep

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account if present, else $KUBECONFIG (like kubectl)."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return cls(_api_client(kubernetes.client.Configuration.get_default_copy()))

    @classmethod
    def from_kubeconfig(cls, path: str) -> Kube:
        config = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=path, client_configuration=config)
        return cls(_api_client(config))

    def request(self, method: str, path: str, *, body: Any = None,
                query: Mapping[str, str] | None = None,
                content_type: str = "application/json",
                timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """One API request; ``timeout`` bounds it whole, the retries of a 429 or 5xx included."""
        deadline = time.monotonic() + timeout
        for retry in range(RETRIES + 1):
            # Serialized per attempt: the auth header is read then (a rotated token is re-read).
            params = self._api.param_serialize(
                method=method, resource_path=path, query_params=list((query or {}).items()),
                header_params={"Content-Type": content_type, "Accept": "application/json"},
                body=body, auth_settings=["BearerToken"])
            start = time.perf_counter()
            _request_deadline.at = deadline
            try:
                resp = self._api.call_api(*params, _request_timeout=max(deadline - time.monotonic(), 0.001))
            finally:
                _request_deadline.at = None
            raw = resp.read()
            verb, resource = verb_and_resource(method, path)
            API_REQUEST_SECONDS.labels(verb=verb, resource=resource).observe(time.perf_counter() - start)
            API_REQUESTS.labels(verb=verb, resource=resource, code=str(resp.status)).inc()
            try:
                data = json.loads(raw) if raw else {}
            except ValueError:
                data = raw.decode(errors="replace")
            if resp.status < 400:
                return data
            wait = retry_wait(method, resp.status, _header(resp, "Retry-After"), retry=retry)
            if wait is None or retry == RETRIES or time.monotonic() + wait >= deadline:
                err = {404: NotFound, 409: Conflict}.get(resp.status, KubeError)
                raise err(resp.status, resp.reason or "", data)
            self._sleep(wait)
        raise AssertionError("unreachable")

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as field manager ``sparsegate`` (force: we are the controller)."""
        meta = obj["metadata"]
        path = path_for(obj["kind"], namespace=meta["namespace"], name=meta["name"])
        return self.request("PATCH", path, body=dict(obj),
                            query={"fieldManager": FIELD_MANAGER, "force": "true"},
                            content_type="application/apply-patch+yaml")

    def create_if_absent(self, obj: Mapping[str, Any]) -> bool:
        """Create once (e.g. a Secret with a random token); True if this call created it."""
        meta = obj["metadata"]
        try:
            self.request("POST", path_for(obj["kind"], namespace=meta["namespace"]),
                         body=dict(obj), query={"fieldManager": FIELD_MANAGER})
        except Conflict:
            return False
        return True

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.request("POST", path_for(obj["kind"], namespace=meta["namespace"]),
                            body=dict(obj), query={"fieldManager": FIELD_MANAGER})

    def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT; carries metadata.resourceVersion, so a concurrent writer makes it 409."""
        meta = obj["metadata"]
        return self.request("PUT", path_for(obj["kind"], namespace=meta["namespace"],
                                            name=meta["name"]),
                            body=dict(obj), query={"fieldManager": FIELD_MANAGER})

    def get(self, kind: str, *, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path_for(kind, namespace=namespace, name=name))
        except NotFound:
            return None

    def exists(self, kind: str, *, namespace: str, name: str) -> bool:
        return self.get(kind, namespace=namespace, name=name) is not None

    def patch_status(self, kind: str, *, namespace: str, name: str, status: Mapping[str, Any],
                     resource_version: str | None = None) -> dict[str, Any]:
        """Merge-patch the status subresource; with resource_version, only if unchanged since."""
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return self.request("PATCH", path_for(kind, namespace=namespace, name=name,
                                              subresource="status"),
                            body=body, content_type="application/merge-patch+json")

    def update_status(self, kind: str, *, namespace: str, name: str,
                      mutate: Callable[[dict[str, Any]], dict[str, Any] | None],
                      attempts: int = 5, current: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Read-modify-write of status with optimistic concurrency (retried on 409).

        ``mutate`` gets the current object and returns the status patch, or None for no write.
        ``current``: the object as the caller just read it, used for the first attempt instead of a
        GET (a conflict reads it again). Returns the object as read (the write's input), or None if
        it does not exist.
        """
        for attempt in range(attempts):
            if attempt or current is None:
                current = self.get(kind, namespace=namespace, name=name)
            if current is None:
                return None
            patch = mutate(current)
            if patch is None:
                return current
            try:
                self.patch_status(kind, namespace=namespace, name=name, status=patch,
                                  resource_version=current["metadata"]["resourceVersion"])
                return current
            except NotFound:
                return None  # deleted between the read and the write (no finalizer holds it)
            except Conflict:
                continue
        raise KubeError(409, "Conflict", f"status of {kind} {namespace}/{name} kept changing")
