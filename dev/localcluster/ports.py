"""Free loopback ports for one cluster's components.

Ports are chosen by the kernel (bind to port 0) with every socket held open until all are
picked, so one cluster never gets the same port twice; they are recorded in the state file so
parallel clusters (and `down` from another process) know them.
"""

from __future__ import annotations

import contextlib
import random
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


def listening_loopback_octets() -> set[int]:
    """Second octets N of every 127.N.x.y address with a listening TCP socket (from /proc/net/tcp)."""
    used: set[int] = set()
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # TCP_LISTEN
                continue
            addr = int(local.split(":")[0], 16)  # little-endian IPv4
            octets = addr.to_bytes(4, "little")
            if octets[0] == 127:
                used.add(octets[1])
    return used


def pick_unused_pod_cidr(*, rng: random.Random | None = None) -> str:
    """A random ``127.N.0.0/16`` (N in 30..250) where nothing listens yet.

    Pod IPs are loopback addresses that real processes bind (the pod runner): two clusters with the
    same pod range would answer each other's requests, so each test cluster takes a range of its own.
    """
    free = sorted(set(range(30, 251)) - listening_loopback_octets())
    if not free:
        raise RuntimeError("every 127.N.0.0/16 pod range (N in 30..250) has listeners")
    return f"127.{(rng or random.Random()).choice(free)}.0.0/16"


def free_port(*, host: str = LOOPBACK) -> int:
    """One free TCP port on ``host`` (for a process the caller starts next)."""
    return pick_free_ports(["port"], host=host)["port"]
