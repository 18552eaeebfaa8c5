"""A real Prometheus server for tests: started on a config, ready-checked, asked through its HTTP API.

One definition for the chart's unit tests (dashboard queries, alert rules) and the dashboards e2e
test (one scraping the dev stack's operator, model pods and agent); `exporter` serves made-up series
for it to scrape."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from localcluster.ports import free_port


class Prometheus:
    """The ``binary`` serving ``config`` (written to ``work``) on loopback ``port`` (default: a free
    one). Raises AssertionError naming the log's end when the binary is missing, exits (a rules file
    it cannot parse makes it exit at start) or is not ready within 30 s."""

    def __init__(self, *, binary: Path, work: Path, config: Mapping[str, Any], port: int | None = None) -> None:
        assert binary.is_file(), (f"the real prometheus binary is required at {binary}; run: "
                                  "source dev/env.sh && bash dev/setup/binaries.sh prometheus")
        (work / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.log = work / "prometheus.log"
        self.url = f"http://127.0.0.1:{port or free_port()}"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(binary), f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"prometheus exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"prometheus not ready within 30 s: {self.log.read_text()[-3000:]}"
                time.sleep(0.2)

    def get(self, path: str, **params: str) -> dict[str, Any]:
        """The JSON answer of ``path`` (an error status's body too: the caller checks ``status``)."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}" if params else f"{self.url}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` answers now."""
        body = self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        return body["data"]["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.get("/api/v1/targets", state="active")["data"]["activeTargets"]

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule (``/api/v1/rules``), each with its group's name as ``group``."""
        body = self.get("/api/v1/rules")
        assert body["status"] == "success", body
        return [dict(r, group=g["name"]) for g in body["data"]["groups"] for r in g["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts (``/api/v1/alerts``)."""
        body = self.get("/api/v1/alerts")
        assert body["status"] == "success", body
        return body["data"]["alerts"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@contextlib.contextmanager
def exporter(text: Callable[[], str]) -> Iterator[str]:
    """A loopback HTTP server answering every GET with ``text()`` (Prometheus's text format, read
    anew each scrape); yields its ``host:port`` for a scrape config."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
