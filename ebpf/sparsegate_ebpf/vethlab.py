"""Throw-away network namespaces joined by a veth pair, for integration tests and benchmarks.

    with VethLab.create() as lab:      # netns <lab.client_ns> / <lab.server_ns>
        lab.run(lab.server_ns, ["python3", "-c", ...])
        with lab.inside(lab.server_ns):   # this thread enters the netns (e.g. to attach XDP)
            ...

Names are unique per lab; addresses 10.200.<n>.1 (client) / .2 (server) exist only inside
these namespaces, which are always deleted (and the veth pair with them) on exit.
"""
from __future__ import annotations

import contextlib
import ctypes as ct
import json
import os
import secrets
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

CLONE_NEWNET = 0x40000000
_libc = ct.CDLL(None, use_errno=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@dataclass
class VethLab:
    client_ns: str
    server_ns: str
    client_if: str
    server_if: str
    client_ip: str
    server_ip: str

    @classmethod
    @contextlib.contextmanager
    def create(cls) -> Iterator["VethLab"]:
        tag = secrets.token_hex(3)
        subnet = int(tag[:2], 16)
        lab = cls(
            client_ns=f"sgc-{tag}", server_ns=f"sgs-{tag}",
            client_if=f"sgc{tag}", server_if=f"sgs{tag}",
            client_ip=f"10.200.{subnet}.1", server_ip=f"10.200.{subnet}.2",
        )
        try:
            lab._setup()
            yield lab
        finally:
            lab.destroy()

    def _setup(self) -> None:
        _ip("netns", "add", self.client_ns)
        _ip("netns", "add", self.server_ns)
        _ip("link", "add", self.client_if, "netns", self.client_ns, "type", "veth",
            "peer", "name", self.server_if, "netns", self.server_ns)
        for ns, ifname, addr in ((self.client_ns, self.client_if, self.client_ip),
                                 (self.server_ns, self.server_if, self.server_ip)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def destroy(self) -> None:
        for ns in (self.client_ns, self.server_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

    def run(self, ns: str, argv: Sequence[str], *, timeout: float = 60, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True,
                              timeout=timeout, check=check, input=input)

    def popen(self, ns: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", ns, *argv], text=True, **kwargs)

    def link_stats(self, ns: str, ifname: str) -> dict[str, Any]:
        out = self.run(ns, ["ip", "-s", "-j", "link", "show", ifname]).stdout
        return json.loads(out)[0]

    def snmp(self, ns: str) -> dict[str, dict[str, int]]:
        """/proc/net/snmp of that namespace: {"Tcp": {"OutSegs": n, ...}, "Udp": {...}}."""
        lines = self.run(ns, ["cat", "/proc/net/snmp"]).stdout.splitlines()
        out: dict[str, dict[str, int]] = {}
        for head, vals in zip(lines[::2], lines[1::2]):
            proto, names = head.split(":")
            out[proto] = dict(zip(names.split(), (int(v) for v in vals.split(":")[1].split())))
        return out

    @contextlib.contextmanager
    def inside(self, ns: str) -> Iterator[None]:
        """Move the calling thread into `ns` for the block (setns is per thread)."""
        orig = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ct.get_errno(), f"setns({ns})")
            try:
                yield
            finally:
                if _libc.setns(orig, CLONE_NEWNET) != 0:
                    raise OSError(ct.get_errno(), "setns back to the original netns")
        finally:
            os.close(orig)
            os.close(target)
