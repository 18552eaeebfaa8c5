"""Free loopback ports for one cluster's components and for test servers.

Ports come from *below* the kernel's ephemeral range (``ip_local_port_range``): a port the kernel
hands out for ``bind(0)`` or an outgoing connection can be taken by any client in the seconds
between picking it and the server binding it (a CI run lost a model server to ``EADDRINUSE`` that
way), while a port outside that range is only ever taken by someone binding it on purpose. Each
candidate is bound to check it is free, and every socket is held open until all are picked, so one
call never returns the same port twice; clusters record theirs in the state file so parallel
clusters (and `down` from another process) know them.
"""

from __future__ import annotations

import contextlib
import random
import socket

LOOPBACK = "127.0.0.1"


LOWEST = 10000  # below this: well-known and registered services' habitual ports


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux default 32768..60999)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def candidate_ports(*, ephemeral: tuple[int, int] | None = None) -> range:
    """The ports picked from: [LOWEST, start of the ephemeral range), or above its end when the
    range starts too low to leave room."""
    low, high = ephemeral or ephemeral_range()
    if low - LOWEST >= 2000:
        return range(LOWEST, low)
    if 65535 - high >= 2000:
        return range(high + 1, 65536)
    raise RuntimeError(f"no room outside the ephemeral port range {low}-{high} to pick test ports from")


def pick_free_ports(names: list[str] | tuple[str, ...], *, host: str = LOOPBACK,
                    rng: random.Random | None = None) -> dict[str, int]:
    """One distinct free TCP port on ``host`` per name, outside the ephemeral range."""
    pool = candidate_ports()
    rng = rng or random.Random()
    ports: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            for _ in range(200):
                port = rng.choice(pool)
                if port in ports.values():
                    continue
                sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                ports[name] = port
                break
            else:
                raise RuntimeError(f"no free port on {host} in {pool.start}..{pool.stop - 1} after 200 tries")
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
