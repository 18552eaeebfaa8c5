"""bpffs pins that let a restarted agent recognise, replace and read its predecessor's program
without CAP_SYS_ADMIN.

The kernel opens a program or map by id (`BPF_PROG_GET_FD_BY_ID`, `BPF_MAP_GET_FD_BY_ID`) only for
CAP_SYS_ADMIN, and iproute2 learns a program's name only through such a descriptor: the chart's
agent (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON) sees just the id of a program left attached, so by
name alone it can neither tell its predecessor's program from a foreign one nor swap it (checked
on this machine's kernel: `ip -d link` shows `prog {id}` without a name, the call fails EPERM).
A pinned object is opened by path (`BPF_OBJ_GET`: file permissions, no capability).

Each agent pins its program and its policy maps under ``<root>/<prog id>/`` once loaded. A
successor opens every other directory there: a program attached with one of those ids is its
predecessor's, replaced with a compare-and-swap on the pinned descriptor, and its live policy is
read through the pinned maps. A directory whose program is attached nowhere on the node is removed
(the pins are what keep such a program loaded); an agent that detaches on exit removes its own.
"""
from __future__ import annotations

import ctypes as ct
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROG = "prog"  # the program's pin in its directory; the maps are pinned under their own names


def _lib() -> Any:
    from bcc import lib  # libbcc.so, linked against the system libbpf

    lib.bpf_obj_pin.argtypes, lib.bpf_obj_pin.restype = [ct.c_int, ct.c_char_p], ct.c_int
    lib.bpf_obj_get.argtypes, lib.bpf_obj_get.restype = [ct.c_char_p], ct.c_int
    return lib


def _fail(rc: int, what: str) -> OSError:
    # bcc's own wrappers return -1 with errno set, libbpf's return -errno (and set errno too)
    err = ct.get_errno() or -rc
    return OSError(err, f"{what}: {os.strerror(err)}")


def obj_get(path: Path) -> int:
    """A new descriptor of the object pinned at ``path``."""
    fd = _lib().bpf_obj_get(str(path).encode())
    if fd < 0:
        raise _fail(fd, f"bpf_obj_get({path})")
    return fd


def obj_pin(fd: int, path: Path) -> None:
    rc = _lib().bpf_obj_pin(fd, str(path).encode())
    if rc < 0:
        raise _fail(rc, f"bpf_obj_pin({path})")


@dataclass
class Pinned:
    """A predecessor's program, opened through its pin (the descriptor is ours to close)."""

    prog_id: int
    path: Path
    prog_fd: int
    _maps: dict[str, int] = field(default_factory=dict)

    def map_fd(self, name: str) -> int:
        """A descriptor of the map pinned as ``name`` (kept open until ``close``)."""
        if name not in self._maps:
            self._maps[name] = obj_get(self.path / name)
        return self._maps[name]

    def close(self) -> None:
        for fd in [self.prog_fd, *self._maps.values()]:
            os.close(fd)
        self._maps.clear()


def pin(root: Path, *, prog_id: int, prog_fd: int, maps: Mapping[str, int]) -> Path:
    """Pin the program and ``maps`` (name -> fd) under ``root/<prog_id>/``; returns that path.
    On bpffs; ``root`` is created if missing."""
    path = root / str(prog_id)
    path.mkdir(parents=True, exist_ok=True)
    obj_pin(prog_fd, path / PROG)
    for name, fd in maps.items():
        obj_pin(fd, path / name)
    return path


def predecessors(root: Path, *, own_id: int) -> dict[int, Pinned]:
    """Every other program pinned under ``root``, by id. A directory that cannot be opened (not
    ours, half written by an agent that died while pinning) is logged and skipped."""
    found: dict[int, Pinned] = {}
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        if not entry.name.isdigit() or int(entry.name) == own_id:
            continue
        try:
            fd = obj_get(entry / PROG)
        except OSError as exc:
            log.warning("skipping %s: %s", entry, exc)
            continue
        found[int(entry.name)] = Pinned(prog_id=int(entry.name), path=entry, prog_fd=fd)
    return found


def attached_ids() -> set[int]:
    """The ids of every XDP program attached to an interface of this network namespace (visible
    without CAP_SYS_ADMIN)."""
    out = subprocess.run(["ip", "-j", "-d", "link", "show"], capture_output=True, text=True, timeout=10,
                         check=True).stdout
    ids: set[int] = set()
    for link in json.loads(out or "[]"):
        xdp = link.get("xdp") or {}
        for att in [xdp, *(xdp.get("attached") or [])]:
            if (pid := (att.get("prog") or {}).get("id")) is not None:
                ids.add(int(pid))
    return ids


def unpin(path: Path) -> None:
    """Remove a program's pins (the program lives on while attached or held open)."""
    shutil.rmtree(path, ignore_errors=True)


def sweep(found: dict[int, Pinned], *, attached: set[int]) -> list[int]:
    """Remove (and forget) the pins of predecessors' programs attached nowhere; returns their ids."""
    gone = [pid for pid in found if pid not in attached]
    for pid in gone:
        p = found.pop(pid)
        p.close()
        unpin(p.path)
        log.info("removed the pins of prog id %s (attached nowhere on this node)", pid)
    return gone


class AgentPins:
    """One agent's view of ``root``: its own pins and its predecessors' (opened)."""

    def __init__(self, root: Path, *, own_id: int, own_path: Path, found: dict[int, Pinned]) -> None:
        self.root, self.own_id, self.own_path, self.found = root, own_id, own_path, found

    @classmethod
    def open(cls, root: Path, *, prog_id: int, prog_fd: int, maps: Mapping[str, int]) -> AgentPins:
        """Open the predecessors' pins, then pin this agent's program and ``maps``."""
        found = predecessors(root, own_id=prog_id)
        try:
            own = pin(root, prog_id=prog_id, prog_fd=prog_fd, maps=maps)
        except OSError:
            for p in found.values():
                p.close()
            unpin(root / str(prog_id))
            raise
        if found:
            log.info("predecessors' programs pinned under %s: prog ids %s", root, sorted(found))
        return cls(root, own_id=prog_id, own_path=own, found=found)

    def known(self) -> dict[int, int]:
        """prog id -> descriptor, for ``xdp.attach``."""
        return {pid: p.prog_fd for pid, p in self.found.items()}

    def sweep(self) -> list[int]:
        """Forget and unpin the predecessors' programs attached nowhere on this node now."""
        if not self.found:
            return []
        try:
            attached = attached_ids()
        except Exception as exc:  # kept for the next sweep
            log.warning("cannot list the XDP programs attached on this node: %s", exc)
            return []
        return sweep(self.found, attached=attached)

    def release(self) -> None:
        """This agent leaves nothing attached: remove its own pins (and close its predecessors')."""
        unpin(self.own_path)
        for p in self.found.values():
            p.close()
        self.found.clear()
