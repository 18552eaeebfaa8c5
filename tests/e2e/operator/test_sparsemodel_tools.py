"""`SparseModel.spec.tools` end to end: the operator renders them, the model-server container calls them.

Given the dev stack (operator in-cluster from its image) and an HTTP tool server this test starts on
the host's loopback (pods run in the host network namespace, so a container reaches it), a GateConfig
whose tool gate fires at every position (toolGateThreshold just above 0) and a SparseModel naming the
tool in `spec.tools`: the pod's server gets `--tools-json` with that tool, and `/v1/infer` on the pod
calls it (the tool server sees `{"tool", "arguments"}` and the result is forced as the next tokens),
calls the built-in calculator, and degrades a tool that times out to plain decoding with 200.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from localcluster.health import wait_for
from prometheus_client.parser import text_string_to_metric_families

from sparsegate_contracts import names

pytestmark = pytest.mark.e2e

MODEL, GATE = "moe-tools", "tools-gate"


class _ToolHandler(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"path": self.path, **body})
        if self.path == "/slow":
            time.sleep(2.0)
        out = json.dumps({"result": str(body["arguments"]).upper()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def tool_server() -> Iterator[str]:
    _ToolHandler.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ToolHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _infer(base: str, rows: list[bytes]) -> dict:
    req = urllib.request.Request(f"{base}/v1/infer", method="POST",
                                 data=json.dumps({"tokens": [list(r) for r in rows]}).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": "e2e-tools"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def test_spec_tools_are_rendered_and_called_from_the_pod(stack, stack_namespace: str, tool_server: str) -> None:
    ns = stack_namespace
    gate = {"apiVersion": names.API_VERSION, "kind": "GateConfig", "metadata": {"name": GATE},
            # sigmoid > 1e-6 wherever the head's logit is above -13.8: the gate fires at every position.
            "spec": {"params": {"toolGateThreshold": 1e-6, "entropyBeta": 0.1}}}
    model = {"apiVersion": names.API_VERSION, "kind": "SparseModel", "metadata": {"name": MODEL},
             "spec": {"replicas": 1, "gateConfigRef": {"name": GATE},
                      "model": {"dModel": 64, "experts": 4, "maxExpertsPerToken": 2},
                      "tools": [{"name": "upper", "url": f"{tool_server}/upper", "timeoutMs": 3000},
                                {"name": "slow", "url": f"{tool_server}/slow", "timeoutMs": 200}]}}
    stack.kubectl("apply", "-n", ns, "-f", "-",
                  input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [gate, model]}))

    def ready_pod() -> dict | None:
        for p in stack.pods(ns, f"sparsegate.dev/model={MODEL}"):
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or []):
                return p
        return None

    pod = wait_for(ready_pod, what="the tools model's server Ready", timeout_s=300, interval_s=1.0)
    args = next(c for c in pod["spec"]["containers"] if c["name"] == "server")["args"]
    rendered = json.loads(args[args.index("--tools-json") + 1])
    assert [t["name"] for t in rendered] == ["upper", "slow"] and rendered[0]["url"] == f"{tool_server}/upper"
    base = f"http://{pod['status']['podIP']}:8080"
    # The operator pushes the GateConfig's version; the firing threshold must be in effect.
    stable = wait_for(lambda: stack.get("gateconfig", GATE, ns).get("status", {}).get("stable", {}).get("version"),
                      what="the GateConfig's stable version", timeout_s=60)

    def serving_stable() -> bool:
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as resp:
            return json.loads(resp.read()).get("gateVersion") == stable

    wait_for(serving_stable, what=f"the pod serving {stable}", timeout_s=60, interval_s=0.5)

    # Equal lengths (one batch); each segment ends at the last position, where the gate fires.
    rows = [b"\nupper:ab", b"xy\n2+3*4=", b"\nslow: zz"]
    out = _infer(base, rows)
    upper, calc, slow = out["toolResults"]
    assert (upper["tool"], upper["outcome"], upper["tokens"]) == ("upper", "ok", list(b"AB")), upper
    assert out["nextTokens"][0] == ord("A")
    assert (calc["tool"], calc["outcome"], calc["tokens"]) == ("calculator", "ok", list(b"14")), calc
    assert out["nextTokens"][1] == ord("1")
    assert (slow["tool"], slow["outcome"], slow["tokens"]) == ("slow", "timeout", []), slow
    assert upper["requestId"] == "e2e-tools"
    # The tool server saw exactly what the container sent.
    assert {"path": "/upper", "tool": "upper", "arguments": "ab"} in _ToolHandler.seen, _ToolHandler.seen
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    calls = {(s.labels["tool"], s.labels["outcome"]): s.value
             for fam in text_string_to_metric_families(metrics) for s in fam.samples
             if s.name == "sparsegate_tool_calls_total"}
    assert calls[("upper", "ok")] == 1.0 and calls[("calculator", "ok")] == 1.0 and calls[("slow", "timeout")] == 1.0
