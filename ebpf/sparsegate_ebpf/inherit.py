"""Read the policy a previous agent's program still enforces, to carry it over.

When a restarted agent gets no policy document within --initial-policy-timeout (API server down
while the kubelet restarts a crashed agent, say), attaching a program with empty maps would pass
everything a moment after the predecessor's program had still been denying it. The predecessor's
program is still attached, and its maps with it; this module reads its live inner policy map
(program -> its maps -> `policy_outer[0]` -> the inner map -> every record), through the
predecessor's pins (`pins.py`) or, for a program without pins, libbpf's id-based calls (CAP_SYS_ADMIN
only), so the new program can start from the same records.
A predecessor from before IPv6 keyed its records with one __u32 per address (12-byte keys, told
by the inner map's key size): its records are read in that layout and widened (maps.upgrade_key).
"""
from __future__ import annotations

import ctypes as ct
import os
from collections.abc import Callable, Sequence
from typing import Any

from .maps import PolicyKey, PolicyKeyV4, PolicyVal, upgrade_key
from .pins import Pinned
from .verdicts import POOL

OUTER = b"policy_outer"
_MAX_MAPS = 64


class _ProgInfo(ct.Structure):
    # The head of the kernel's struct bpf_prog_info, up to and including `name` (uapi bpf.h);
    # the kernel copies only as many bytes as we pass.
    _fields_ = [("type", ct.c_uint32), ("id", ct.c_uint32), ("tag", ct.c_uint8 * 8),
                ("jited_prog_len", ct.c_uint32), ("xlated_prog_len", ct.c_uint32),
                ("jited_prog_insns", ct.c_uint64), ("xlated_prog_insns", ct.c_uint64),
                ("load_time", ct.c_uint64), ("created_by_uid", ct.c_uint32), ("nr_map_ids", ct.c_uint32),
                ("map_ids", ct.c_uint64), ("name", ct.c_char * 16)]


class _MapInfo(ct.Structure):
    # The head of struct bpf_map_info.
    _fields_ = [("type", ct.c_uint32), ("id", ct.c_uint32), ("key_size", ct.c_uint32),
                ("value_size", ct.c_uint32), ("max_entries", ct.c_uint32), ("map_flags", ct.c_uint32),
                ("name", ct.c_char * 16)]


def _lib() -> Any:
    from bcc import lib  # libbcc.so, linked against the system libbpf

    for fn in (lib.bpf_prog_get_fd_by_id, lib.bpf_map_get_fd_by_id):
        fn.argtypes, fn.restype = [ct.c_uint32], ct.c_int
    lib.bpf_obj_get_info_by_fd.argtypes = [ct.c_int, ct.c_void_p, ct.POINTER(ct.c_uint32)]
    lib.bpf_obj_get_info_by_fd.restype = ct.c_int
    for fn in (lib.bpf_map_lookup_elem, lib.bpf_map_get_next_key):
        fn.argtypes, fn.restype = [ct.c_int, ct.c_void_p, ct.c_void_p], ct.c_int
    return lib


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    return rc


def _info(lib: Any, fd: int, info: ct.Structure) -> None:
    size = ct.c_uint32(ct.sizeof(info))
    _check(lib.bpf_obj_get_info_by_fd(fd, ct.byref(info), ct.byref(size)), "bpf_obj_get_info_by_fd")


def live_policy(prog_id: int) -> list[tuple[PolicyKey, PolicyVal]] | None:
    """Every record of the inner policy map live in program `prog_id` (meta record included),
    or None when that program has no policy installed. Raises OSError when it cannot be read.
    Opens the program and its maps by id, which the kernel allows only to CAP_SYS_ADMIN: an agent
    without it reads its predecessor's policy through pins (`live_policy_pinned`)."""
    lib = _lib()
    fds: list[int] = []
    try:
        prog_fd = _check(lib.bpf_prog_get_fd_by_id(prog_id), f"prog id {prog_id}")
        fds.append(prog_fd)
        ids = (ct.c_uint32 * _MAX_MAPS)()
        info = _ProgInfo(nr_map_ids=_MAX_MAPS, map_ids=ct.addressof(ids))
        _info(lib, prog_fd, info)
        outer_fd = None
        for map_id in ids[: min(info.nr_map_ids, _MAX_MAPS)]:
            fd = _check(lib.bpf_map_get_fd_by_id(map_id), f"map id {map_id}")
            fds.append(fd)
            minfo = _MapInfo()
            _info(lib, fd, minfo)
            if minfo.name == OUTER:
                outer_fd = fd
        if outer_fd is None:
            raise OSError(0, f"prog id {prog_id} has no {OUTER.decode()} map")

        def inner_by_id(inner_id: int) -> int:
            fd = _check(lib.bpf_map_get_fd_by_id(inner_id), f"inner map id {inner_id}")
            fds.append(fd)
            return fd

        return _read_live(lib, outer_fd, inner_by_id, what=f"prog id {prog_id}")
    finally:
        for fd in fds:
            os.close(fd)


def live_policy_pinned(pinned: Pinned, *, pool: Sequence[str] = POOL) -> list[tuple[PolicyKey, PolicyVal]] | None:
    """`live_policy` of a predecessor's program through its pins (no CAP_SYS_ADMIN needed): the
    outer map and each inner map of the A/B `pool` are pinned by name; the live one is the pool map
    whose id the outer slot holds."""
    lib = _lib()

    def inner_by_id(inner_id: int) -> int:
        for name in pool:
            fd = pinned.map_fd(name)
            minfo = _MapInfo()
            _info(lib, fd, minfo)
            if minfo.id == inner_id:
                return fd
        raise OSError(0, f"prog id {pinned.prog_id}: the live inner map (id {inner_id}) is not one of its pins")

    return _read_live(lib, pinned.map_fd(OUTER.decode()), inner_by_id, what=f"prog id {pinned.prog_id}")


def _read_live(lib: Any, outer_fd: int, inner_fd: Callable[[int], int],
               *, what: str) -> list[tuple[PolicyKey, PolicyVal]] | None:
    """Every record of the inner map `policy_outer[0]` points at; None when the slot is empty."""
    # From user space a map-in-map slot reads as the inner map's id.
    zero, inner_id = ct.c_uint32(0), ct.c_uint32(0)
    if lib.bpf_map_lookup_elem(outer_fd, ct.byref(zero), ct.byref(inner_id)) < 0:
        return None  # empty slot: the predecessor never had a policy
    fd = inner_fd(inner_id.value)
    inner_info = _MapInfo()
    _info(lib, fd, inner_info)
    layouts = {ct.sizeof(PolicyKey): PolicyKey, ct.sizeof(PolicyKeyV4): PolicyKeyV4}
    key_type = layouts.get(inner_info.key_size)
    if key_type is None or inner_info.value_size != ct.sizeof(PolicyVal):
        raise OSError(0, f"{what}: inner policy map has {inner_info.key_size}-byte keys and "
                         f"{inner_info.value_size}-byte values, a layout this agent cannot read")
    records: list[tuple[PolicyKey, PolicyVal]] = []
    key, nxt = key_type(), key_type()
    prev = None  # NULL: the first key
    while lib.bpf_map_get_next_key(fd, prev, ct.byref(nxt)) == 0:
        val = PolicyVal()
        if lib.bpf_map_lookup_elem(fd, ct.byref(nxt), ct.byref(val)) == 0:
            got = key_type.from_buffer_copy(nxt)
            records.append((got if key_type is PolicyKey else upgrade_key(got), val))
        ct.memmove(ct.byref(key), ct.byref(nxt), ct.sizeof(key))
        prev = ct.byref(key)
    return records


def program_id(prog_fd: int) -> int:
    """The kernel's id of the program behind ``prog_fd`` (what `ip link` and bpftool show)."""
    info = _ProgInfo()
    _info(_lib(), prog_fd, info)
    return int(info.id)
