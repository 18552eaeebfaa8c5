"""Attach/replace/detach the loaded program on interfaces, native (driver) XDP or generic (skb).

A restarting agent must never leave an interface without its program, even for a moment: the
program a predecessor left attached (it keeps its maps, hence the policy in force, alive) is
replaced in one netlink call (`XDP_FLAGS_REPLACE`: compare-and-swap on the attached program), and
an exiting agent detaches only the program that is still its own. Both go through libbpf's
`bpf_xdp_attach`, which `libbcc.so` links (python3-bpfcc 0.26's `attach_xdp` takes no expected
program).
"""
from __future__ import annotations

import ctypes as ct
import enum
import json
import logging
import os
import socket
import subprocess
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0  # never replace someone else's program
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
XDP_FLAGS_REPLACE = 1 << 4  # only if the attached program is the expected one (opts.old_prog_fd)


class XdpMode(str, enum.Enum):
    AUTO = "auto"
    # try native first, fall back to generic
    NATIVE = "native"
    # driver hook: only drivers with XDP support (veth, mlx5, ixgbe, ...)
    GENERIC = "generic"
    # skb hook: every driver, slower


_FLAGS = {XdpMode.NATIVE: XDP_FLAGS_DRV_MODE, XdpMode.GENERIC: XDP_FLAGS_SKB_MODE}


class AttachError(RuntimeError):
    pass


class NotOurs(RuntimeError):
    """The program attached is not the one expected (someone replaced or removed it)."""


# `ip -j -d link` xdp.mode (XDP_ATTACHED_DRV / _SKB) -> the mode whose flag addresses it.
_ATTACHED_MODES = {1: XdpMode.NATIVE, 2: XdpMode.GENERIC}
_ATTACHED_FLAGS = {k: _FLAGS[m] for k, m in _ATTACHED_MODES.items()}


def attached_program(ifname: str) -> dict[str, Any] | None:
    """The XDP program on `ifname` as iproute2 reports it ({"mode": int, "prog": {"name", "id"}})."""
    out = subprocess.run(["ip", "-j", "-d", "link", "show", "dev", ifname], capture_output=True,
                         text=True, timeout=10, check=True).stdout
    return json.loads(out)[0].get("xdp")


def attached_programs() -> dict[str, set[int]]:
    """Every interface of this network namespace -> the ids of the XDP programs attached to it
    (one `ip -j -d link show`; the ids are visible without CAP_SYS_ADMIN)."""
    out = subprocess.run(["ip", "-j", "-d", "link", "show"], capture_output=True, text=True, timeout=10,
                         check=True).stdout
    links: dict[str, set[int]] = {}
    for link in json.loads(out or "[]"):
        found = link.get("xdp") or {}
        links[link.get("ifname", "")] = {int(pid) for att in [found, *(found.get("attached") or [])]
                                         if (pid := (att.get("prog") or {}).get("id")) is not None}
    return links


class _XdpAttachOpts(ct.Structure):
    # libbpf's struct bpf_xdp_attach_opts { size_t sz; int old_prog_fd; size_t :0; }
    _fields_ = [("sz", ct.c_size_t), ("old_prog_fd", ct.c_int)]


def _libbpf() -> Any:
    from bcc import lib  # libbcc.so, linked against the system libbpf

    lib.bpf_xdp_attach.argtypes = [ct.c_int, ct.c_int, ct.c_uint32, ct.POINTER(_XdpAttachOpts)]
    lib.bpf_xdp_attach.restype = ct.c_int
    lib.bpf_prog_get_fd_by_id.argtypes = [ct.c_uint32]
    lib.bpf_prog_get_fd_by_id.restype = ct.c_int
    return lib


def _xdp_cas(*, ifname: str, new_fd: int, expected_fd: int, mode: XdpMode, ifindex: int | None = None) -> None:
    """Put `new_fd` (-1: nothing) on `ifname` (or the interface whose index is `ifindex`) iff
    `expected_fd`'s program is the one attached."""
    opts = _XdpAttachOpts(sz=ct.sizeof(_XdpAttachOpts), old_prog_fd=expected_fd)
    index = socket.if_nametoindex(ifname) if ifindex is None else ifindex
    rc = _libbpf().bpf_xdp_attach(index, new_fd, _FLAGS[mode] | XDP_FLAGS_REPLACE, ct.byref(opts))
    if rc == -17:  # EEXIST: "Active program does not match expected"
        raise NotOurs(f"the XDP program on {ifname} is not the expected one")
    if rc < 0:
        raise OSError(-rc, f"bpf_xdp_attach({ifname}): {os.strerror(-rc)}")


def replace(*, prog_fd: int, ifname: str, mode: XdpMode, expected_id: int, expected_fd: int | None = None) -> None:
    """Swap the attached program `expected_id` for `prog_fd` in one step: at no instant is the
    interface without a program. Raises NotOurs when `expected_id` is no longer attached.
    `expected_fd`: a descriptor of that program already held (from its pin); without one it is
    opened by id, which the kernel allows only to CAP_SYS_ADMIN."""
    if expected_fd is not None:
        _xdp_cas(ifname=ifname, new_fd=prog_fd, expected_fd=expected_fd, mode=mode)
        return
    old_fd = _libbpf().bpf_prog_get_fd_by_id(expected_id)
    if old_fd < 0:
        raise NotOurs(f"prog id {expected_id} on {ifname} cannot be opened by id: {os.strerror(-old_fd)}")
    try:
        _xdp_cas(ifname=ifname, new_fd=prog_fd, expected_fd=old_fd, mode=mode)
    finally:
        os.close(old_fd)


def detach_own(*, prog_fd: int, ifname: str, mode: XdpMode, ifindex: int | None = None) -> None:
    """Detach `prog_fd` from `ifname` only if it is still the program attached there: a successor
    that already replaced it (DaemonSet surge, a second agent) keeps its program. `ifindex`: the
    interface's index when the program was attached, which finds it after a rename (the name may
    be gone, or another interface's now); the compare-and-swap leaves an index reused by another
    interface alone."""
    _xdp_cas(ifname=ifname, new_fd=-1, expected_fd=prog_fd, mode=mode, ifindex=ifindex)


def _ours(current: dict[str, Any] | None, *, prog_name: str, known: Mapping[int, int]) -> bool:
    """Whether the attached program is a previous agent's: one whose pin we opened (its id is in
    `known`), or, where the name is visible (CAP_SYS_ADMIN), one carrying our program's name."""
    prog = (current or {}).get("prog") or {}
    return prog.get("id") in known or (prog.get("name") is not None and prog.get("name") == prog_name)


def remove_stale(*, bpf: Any, ifname: str, prog_name: str, known: Mapping[int, int] | None = None) -> bool:
    """Remove our program left by a previous agent, if (and only if) it is ours (`_ours`);
    someone else's program is never touched. Used only where it cannot be replaced in one
    step (a different mode was asked for): the interface runs without a program in between."""
    current = attached_program(ifname)
    if not _ours(current, prog_name=prog_name, known=known or {}):
        return False
    flags = _ATTACHED_FLAGS.get(current.get("mode"))
    if flags is None:
        return False
    log.warning("removing %s (prog id %s) left on %s by a previous agent",
                prog_name, current["prog"].get("id"), ifname)
    bpf.remove_xdp(ifname.encode(), flags)
    return True


def attach(*, bpf: Any, fn: Any, ifname: str, mode: XdpMode, prog_name: str = "xdp_flow",
           known: Mapping[int, int] | None = None) -> XdpMode:
    """Attach and return the mode actually used.

    Our own program left by a previous agent (restart, crash, SIGKILL: netlink attachments outlive
    their process) is replaced atomically in the mode it runs in, when that mode is the one asked
    for (or `auto`); a different mode needs remove-then-attach. `known`: prog id -> descriptor of
    the previous agents' programs opened through their pins (`pins.py`). A foreign program is never
    touched: AttachError, naming the program attached."""
    known = known or {}
    current = attached_program(ifname)
    if _ours(current, prog_name=prog_name, known=known):
        assert current is not None
        running = _ATTACHED_MODES.get(current.get("mode"))
        if running is not None and mode in (XdpMode.AUTO, running):
            pid = current["prog"]["id"]
            try:
                replace(prog_fd=fn.fd, ifname=ifname, mode=running, expected_id=pid, expected_fd=known.get(pid))
                log.info("replaced %s (prog id %s) on %s in one step", prog_name, current["prog"]["id"], ifname)
                return running
            except NotOurs as exc:  # it changed under us: start over with what is there now
                log.warning("%s; attaching afresh", exc)
            except OSError as exc:
                raise AttachError(f"cannot replace XDP on {ifname}: {exc}") from exc
        else:
            log.warning("%s runs on %s in mode %s, %s asked: removing it first (no program in between)",
                        prog_name, ifname, running, mode.value)
        removed = running if remove_stale(bpf=bpf, ifname=ifname, prog_name=prog_name, known=known) else None
    else:
        removed = None
    order = asked = [XdpMode.NATIVE, XdpMode.GENERIC] if mode == XdpMode.AUTO else [mode]
    if removed is not None and removed not in asked:
        # The mode asked may not work here (native on a driver without it): then back in the mode
        # the removed program ran in, rather than leave the interface with no program at all.
        order = [*asked, removed]
    errors = []
    for m in order:
        try:
            bpf.attach_xdp(ifname.encode(), fn, _FLAGS[m] | XDP_FLAGS_UPDATE_IF_NOEXIST)
            if m not in asked:
                log.error("XDP on %s attached in %s mode, as the program it replaced ran: %s", ifname, m.value,
                          "; ".join(errors))
            return m
        except Exception as exc:  # bcc raises bare Exception with the netlink error
            errors.append(f"{m.value}: {exc}")
            log.info("XDP %s attach on %s failed: %s", m.value, ifname, exc)
    raise AttachError(f"cannot attach XDP to {ifname}{_holder(ifname)}: " + "; ".join(errors))


def _holder(ifname: str) -> str:
    """Who holds the interface now, for an error message (the name only where it is visible)."""
    try:
        current = attached_program(ifname)
    except Exception:  # the message is what matters; the interface may be gone
        return ""
    prog = (current or {}).get("prog") or {}
    if not prog:
        return ""
    mode = {1: "native", 2: "generic", 3: "offloaded"}.get((current or {}).get("mode"), "?")
    return f" (prog id {prog.get('id')} {prog.get('name') or '(name not visible without CAP_SYS_ADMIN)'} " \
           f"attached {mode}, not one this agent knows as its predecessor's)"


def detach(*, bpf: Any, ifname: str, mode: XdpMode) -> None:
    """Detach whatever program runs on `ifname` in `mode`."""
    bpf.remove_xdp(ifname.encode(), _FLAGS[mode])
