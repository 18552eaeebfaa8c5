"""Free loopback ports for one cluster's components.

Ports are chosen by the kernel (bind to port 0) with every socket held open until all are
picked, so one cluster never gets the same port twice; they are recorded in the state file so
parallel clusters (and `down` from another process) know them.
"""

from __future__ import annotations

import contextlib
import socket

LOOPBACK = "127.0.0.1"


def pick_free_ports(names: list[str] | tuple[str, ...], *, host: str = LOOPBACK) -> dict[str, int]:
    """One distinct free TCP port on ``host`` per name."""
    ports: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports[name] = sock.getsockname()[1]
    return ports


def is_port_free(port: int, *, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
