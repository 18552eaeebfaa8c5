"""The operator's API request counter: verb and resource of each path the client sends."""

from __future__ import annotations

import pytest

from sparsegate.clients.kube import path_for, verb_and_resource


@pytest.mark.parametrize(("method", "path", "expected"), [
    ("GET", path_for("Pod", namespace="ns"), ("list", "pods")),
    ("GET", path_for("Deployment", namespace="ns", name="m"), ("get", "deployments")),
    ("PATCH", path_for("GateConfig", namespace="ns", name="g", subresource="status"), ("patch", "gateconfigs/status")),
    ("POST", path_for("Secret", namespace="ns"), ("create", "secrets")),
    ("PUT", path_for("Secret", namespace="ns", name="m-admin"), ("update", "secrets")),
    ("GET", "/api/v1/nodes", ("list", "nodes")),
    ("GET", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/op?watch=1", ("get", "leases")),
])
def test_each_path_is_named_by_verb_and_resource(method: str, path: str, expected: tuple[str, str]) -> None:
    assert verb_and_resource(method, path) == expected


class _Answer:
    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.reason, self._body = status, "", body

    def read(self) -> bytes:
        return self._body


class _Transport:
    """Stands in for kubernetes.client.ApiClient's two calls Kube makes (no HTTP)."""

    def __init__(self, answer: _Answer) -> None:
        self.answer = answer

    def param_serialize(self, **kwargs):
        return (kwargs["method"], kwargs["resource_path"])

    def call_api(self, *params, _request_timeout=None):
        return self.answer


def test_each_request_is_counted_by_code_and_timed_by_verb_and_resource() -> None:
    from prometheus_client import REGISTRY

    from sparsegate.clients.kube import Kube

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    timed = {"verb": "get", "resource": "secrets"}
    count0 = sample("sparsegate_operator_kube_request_duration_seconds_count", **timed)
    missing0 = sample("sparsegate_operator_kube_requests_total", code="404", **timed)
    kube = Kube(_Transport(_Answer(404, b'{"message": "not found"}')))
    assert kube.get("Secret", namespace="ns", name="m-admin") is None
    kube._api = _Transport(_Answer(200, b'{"metadata": {"name": "m-admin"}}'))
    assert kube.get("Secret", namespace="ns", name="m-admin")["metadata"]["name"] == "m-admin"
    assert sample("sparsegate_operator_kube_request_duration_seconds_count", **timed) == count0 + 2
    assert sample("sparsegate_operator_kube_requests_total", code="404", **timed) == missing0 + 1


class _Answers:
    """call_api answering from a list in turn (status, headers); records each attempt's timeout."""

    def __init__(self, *answers: tuple[int, dict[str, str]]) -> None:
        self.answers = list(answers)
        self.timeouts: list[float] = []

    def param_serialize(self, **kwargs):
        return (kwargs["method"], kwargs["resource_path"])

    def call_api(self, *params, _request_timeout=None):
        self.timeouts.append(_request_timeout)
        status, headers = self.answers.pop(0)
        answer = _Answer(status, b'{"metadata": {"name": "x"}}' if status < 400 else b'{"message": "busy"}')
        answer.headers = headers
        return answer


def _kube(transport: _Answers) -> tuple[Kube, list[float]]:
    from sparsegate.clients.kube import Kube

    slept: list[float] = []
    return Kube(transport, sleep=slept.append), slept


def test_a_429_is_sent_again_after_its_retry_after() -> None:
    """API Priority and Fairness answers 429 with Retry-After before handling a request: one such
    answer failed the reconcile (ApplyFailed on the model, Kopf's retry a minute later)."""
    transport = _Answers((429, {"Retry-After": "1"}), (200, {}))
    kube, slept = _kube(transport)
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ns"}}
    assert kube.apply(obj)["metadata"]["name"] == "x"
    assert slept == [1.0]


@pytest.mark.parametrize(("method", "status", "headers", "retried"), [
    ("PATCH", 503, {"Retry-After": "2"}, True),   # the server asks to come back: any verb
    ("PATCH", 500, {}, False),                    # a write may have landed: not sent twice
    ("GET", 500, {}, True),                       # a read repeats safely
    ("GET", 404, {}, False),
    ("PUT", 409, {}, False),
])
def test_which_answers_are_retried(method: str, status: int, headers: dict[str, str], retried: bool) -> None:
    from sparsegate.clients.kube import KubeError

    transport = _Answers((status, headers), (200, {}))
    kube, slept = _kube(transport)
    if retried:
        assert kube.request(method, path_for("ConfigMap", namespace="ns", name="x"))["metadata"]["name"] == "x"
        assert len(slept) == 1
    else:
        with pytest.raises(KubeError) as raised:
            kube.request(method, path_for("ConfigMap", namespace="ns", name="x"))
        assert raised.value.status == status and slept == []


def test_retries_are_bounded_in_number_and_by_the_request_timeout() -> None:
    from sparsegate.clients.kube import RETRIES, KubeError

    transport = _Answers(*[(429, {"Retry-After": "0"})] * (RETRIES + 1))
    kube, slept = _kube(transport)
    with pytest.raises(KubeError) as raised:
        kube.get("ConfigMap", namespace="ns", name="x")
    assert raised.value.status == 429 and len(slept) == RETRIES and not transport.answers

    # A wait past the caller's timeout (the leader's renew deadline) is not waited: the 429 is raised.
    transport = _Answers((429, {"Retry-After": "5"}), (200, {}))
    kube, slept = _kube(transport)
    with pytest.raises(KubeError):
        kube.request("GET", path_for("Lease", namespace="ns", name="l"), timeout=2.0)
    assert slept == [] and transport.timeouts == [pytest.approx(2.0, abs=0.1)]


def test_a_429_of_a_real_http_server_is_retried_once_per_answer(tmp_path) -> None:
    """Through the official client's transport as the operator configures it: the Retry-After
    header is read from its answer, and urllib3 does not retry the 429 itself beforehand."""
    import http.server
    import threading

    from sparsegate.clients.kube import Kube

    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(self.command)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, body = (429, b'{"kind": "Status", "code": 429}') if len(seen) % 2 else (200, b'{"data": {}}')
            self.send_response(status)
            if status == 429:
                self.send_header("Retry-After", "1")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PATCH = _answer  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{server.server_address[1]}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n")
    try:
        kube = Kube.from_kubeconfig(str(kubeconfig))
        slept: list[float] = []
        kube._sleep = slept.append
        assert kube.get("ConfigMap", namespace="ns", name="x") == {"data": {}}
        assert kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": "x", "namespace": "ns"}}) == {"data": {}}
        assert seen == ["GET", "GET", "PATCH", "PATCH"] and slept == [1.0, 1.0]
    finally:
        server.shutdown()
        server.server_close()


def test_in_cluster_the_client_verifies_the_cluster_ca_and_re_reads_a_rotated_token(tmp_path, monkeypatch) -> None:
    """Bound ServiceAccount tokens expire (about an hour) and the kubelet rewrites the file before:
    a client that kept the token it read at start would get 401 from then on. The in-cluster
    configuration re-reads the file (at most a minute old) and each request takes the header anew."""
    import datetime
    import http.server
    import ssl
    import threading

    import kubernetes
    import kubernetes.config.incluster_config as incluster

    from sparsegate.clients.kube import Kube
    from sparsegate.domain import admin_tls

    cert_pem, key_pem = admin_tls.issue(server_name="localhost", now=datetime.datetime.now(datetime.timezone.utc))
    (tmp_path / "ca.crt").write_text(cert_pem)
    (tmp_path / "key.pem").write_text(key_pem)
    token = tmp_path / "token"
    token.write_text("token-one")
    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            body = b'{"data": {}}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "ca.crt", tmp_path / "key.pem")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # from_environment sets the process's default configuration: put it back afterwards.
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", kubernetes.client.Configuration._default)
    monkeypatch.setattr(incluster, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "localhost")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.server_address[1]))
    try:
        kube = Kube.from_environment()
        assert kube._api.configuration.verify_ssl and kube._api.configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
        assert kube.get("ConfigMap", namespace="ns", name="x") == {"data": {}}
        token.write_text("token-two")  # the kubelet rotated it; two minutes later:
        later = datetime.datetime.now() + datetime.timedelta(minutes=2)
        monkeypatch.setattr(incluster, "datetime", type("clock", (), {
            "datetime": type("dt", (datetime.datetime,), {"now": staticmethod(lambda tz=None: later)}),
            "timedelta": datetime.timedelta}))
        assert kube.get("ConfigMap", namespace="ns", name="x") == {"data": {}}
        assert [h.lower() if h else h for h in seen] == ["bearer token-one", "bearer token-two"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_never_answers_costs_a_get_its_timeout_not_four(tmp_path) -> None:
    """urllib3 retries a broken connection (3 times) with the whole timeout each: a GET to an API
    server that accepted the connection and never answered (etcd stuck, a half-dead proxy) took 4 x
    its timeout (2 minutes at the default 30 s). A connection dropped at once is still sent again."""
    import socket
    import threading
    import time

    import kubernetes

    from sparsegate.clients.kube import Kube, _api_client

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    answer = threading.Event()  # from then on: the first connection is dropped, the next one answered

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            if not answer.is_set():
                continue  # never answers
            if len(accepted) % 2:
                conn.close()  # dropped before answering (a stale kept-alive connection, say)
                continue
            conn.recv(65536)
            body = b'{"data": {}}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    threading.Thread(target=serve, daemon=True).start()
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{listener.getsockname()[1]}"
    kube = Kube(_api_client(config))
    try:
        started = time.monotonic()
        with pytest.raises(Exception):
            kube.request("GET", path_for("ConfigMap", namespace="ns", name="x"), timeout=0.5)
        assert time.monotonic() - started < 1.0 and len(accepted) == 1
        answer.set()
        accepted.clear()
        assert kube.get("ConfigMap", namespace="ns", name="x") == {"data": {}}
        assert len(accepted) == 2
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
