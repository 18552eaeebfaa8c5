"""Connection limits of the model server's listeners (inference and admin), so that idle clients
cannot take the file descriptors the kubelet's probes and real requests need.

aiohttp's ``run_app`` keeps an idle keep-alive connection 75 s (a bare ``AppRunner``, as the
admin listener used, about an hour) and accepts connections until ``accept()`` fails with
EMFILE; from then on every new connection (probes included) waits in the kernel's backlog until
an idle one times out, and the kubelet restarts the pod. Here:

* ``--keepalive-timeout`` (default 15 s, as aiohttp's client pool): an idle connection, or one
  that never sends a complete request, is closed after that long; on the admin listener a TLS
  handshake too (at most asyncio's 60 s): until its handshake ends a connection has no handler,
  so it counts against the cap below but cannot be closed to make room.
* ``--max-connections`` (default: from ``RLIMIT_NOFILE``, see :func:`default_max_connections`),
  counted over both listeners (they share the descriptors). A new connection beyond it closes the
  oldest idle connection (one waiting for its next request: nothing is lost, a client reconnects)
  and is served; when none is idle (all are inside a request) it is still served within a small
  reserve (``PROBE_RESERVE``: a probe gets through while every connection is busy), and beyond
  that it is closed at once, without a response.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("sparsegate.workload.connections")

DEFAULT_KEEPALIVE_TIMEOUT_S = 15.0
# Connections served beyond --max-connections while none is idle (probes, a few clients).
PROBE_RESERVE = 16
# The default cap never exceeds this (a container with a huge RLIMIT_NOFILE would otherwise let
# idle connections grow the memory to the pod's limit; --max-inflight is 256 by default).
MAX_DEFAULT_CONNECTIONS = 4096
# Descriptors kept for the process itself (model files, tool and TokenReview sockets, pipes) and
# for connections accepted but not yet closed when refused: asyncio accepts up to the listen
# backlog (128) per loop iteration, and a refused socket is closed two iterations later.
MIN_HEADROOM_FDS = 3 * 128 + 64


def soft_nofile_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections(soft_limit: int | None = None) -> int:
    """The soft ``RLIMIT_NOFILE`` less a quarter (at least ``MIN_HEADROOM_FDS``) and the probe
    reserve, at most ``MAX_DEFAULT_CONNECTIONS``, at least 1."""
    if soft_limit is None:
        soft_limit = soft_nofile_limit()
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        return MAX_DEFAULT_CONNECTIONS
    headroom = max(MIN_HEADROOM_FDS, soft_limit // 4)
    return max(1, min(MAX_DEFAULT_CONNECTIONS, soft_limit - headroom - PROBE_RESERVE))


def _idle(handler: RequestHandler) -> bool:
    # aiohttp's own keep-alive test: the handler waits for the next (or first) request.
    waiter = getattr(handler, "_waiter", None)
    return waiter is not None and not waiter.done()


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class ConnectionLimiter:
    """Counts the connections of the sites started with it (one limiter per process)."""

    def __init__(self, max_connections: int, *, reserve: int = PROBE_RESERVE) -> None:
        if max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {max_connections}")
        self.max_connections = max_connections
        self.reserve = reserve
        self._servers: list[web.Server] = []
        # Handlers made but not yet connected: asyncio accepts a burst (up to the backlog) and
        # makes their protocols before any connection_made, so the servers do not count them yet.
        self._pending: list[tuple[float, RequestHandler]] = []
        self.evicted = 0  # idle connections closed to make room
        self.refused = 0  # new connections closed at once

    def open_connections(self) -> list[RequestHandler]:
        return [h for s in self._servers for h in s.connections]

    def _count(self, handlers: list[RequestHandler]) -> int:
        connected, now = set(handlers), time.monotonic()
        # Connected: in a server's list, or already gone (its manager unset at connection_lost).
        # One never connected (a TLS handshake that failed: asyncio gives it 60 s) is forgotten.
        self._pending = [(t, h) for t, h in self._pending if h not in connected
                         and getattr(h, "_manager", None) is not None and now - t < 75]
        return len(handlers) + len(self._pending)

    def factory(self, server: web.Server) -> Any:
        self._servers.append(server)

        def make() -> asyncio.Protocol:
            handlers = self.open_connections()
            count = self._count(handlers)
            if count >= self.max_connections:
                victim = next((h for h in handlers if _idle(h)), None)  # oldest first
                if victim is not None:
                    victim.force_close()
                    self.evicted += 1
                elif count >= self.max_connections + self.reserve:
                    self.refused += 1
                    if self.refused == 1 or self.refused % 1000 == 0:
                        log.warning("%d connections open, none idle (--max-connections %d): "
                                    "closing new connections (%d so far)", count,
                                    self.max_connections, self.refused)
                    return _Refused()
            handler = server()
            self._pending.append((time.monotonic(), handler))
            return handler
        return make


class LimitedTCPSite(web.TCPSite):
    """``web.TCPSite`` whose connections go through ``limiter``."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int | None, *,
                 limiter: ConnectionLimiter, ssl_handshake_timeout: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self._limiter = limiter
        self._handshake_timeout = ssl_handshake_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._limiter.factory(server), self._host, self._port, ssl=self._ssl_context,
            backlog=self._backlog, reuse_address=self._reuse_address, reuse_port=self._reuse_port,
            **({"ssl_handshake_timeout": self._handshake_timeout}
               if self._ssl_context is not None and self._handshake_timeout is not None else {}))
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
