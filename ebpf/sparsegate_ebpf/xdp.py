"""Attach/detach the loaded program to interfaces, native (driver) XDP or generic (skb)."""
from __future__ import annotations

import enum
import json
import logging
import subprocess
from typing import Any

log = logging.getLogger(__name__)

XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0  # never replace someone else's program
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2


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


# `ip -j -d link` xdp.mode -> the flag that detaches it (XDP_ATTACHED_DRV / _SKB).
_ATTACHED_FLAGS = {1: XDP_FLAGS_DRV_MODE, 2: XDP_FLAGS_SKB_MODE}


def attached_program(ifname: str) -> dict[str, Any] | None:
    """The XDP program on `ifname` as iproute2 reports it ({"mode": int, "prog": {"name", "id"}})."""
    out = subprocess.run(["ip", "-j", "-d", "link", "show", "dev", ifname], capture_output=True,
                         text=True, timeout=10, check=True).stdout
    return json.loads(out)[0].get("xdp")


def remove_stale(*, bpf: Any, ifname: str, prog_name: str) -> bool:
    """Netlink XDP attachments outlive their process: after a crash (SIGKILL, OOM) our old
    program keeps running with its last policy and blocks re-attachment. Remove it if (and
    only if) it carries our program's name; someone else's program is never touched."""
    current = attached_program(ifname)
    if not current or current.get("prog", {}).get("name") != prog_name:
        return False
    flags = _ATTACHED_FLAGS.get(current.get("mode"))
    if flags is None:
        return False
    log.warning("removing stale %s (prog id %s) left on %s by a previous agent",
                prog_name, current["prog"].get("id"), ifname)
    bpf.remove_xdp(ifname.encode(), flags)
    return True


def attach(*, bpf: Any, fn: Any, ifname: str, mode: XdpMode, prog_name: str = "xdp_flow") -> XdpMode:
    """Attach and return the mode actually used."""
    remove_stale(bpf=bpf, ifname=ifname, prog_name=prog_name)
    order = [XdpMode.NATIVE, XdpMode.GENERIC] if mode == XdpMode.AUTO else [mode]
    errors = []
    for m in order:
        try:
            bpf.attach_xdp(ifname.encode(), fn, _FLAGS[m] | XDP_FLAGS_UPDATE_IF_NOEXIST)
            return m
        except Exception as exc:  # bcc raises bare Exception with the netlink error
            errors.append(f"{m.value}: {exc}")
            log.info("XDP %s attach on %s failed: %s", m.value, ifname, exc)
    raise AttachError(f"cannot attach XDP to {ifname}: " + "; ".join(errors))


def detach(*, bpf: Any, ifname: str, mode: XdpMode) -> None:
    bpf.remove_xdp(ifname.encode(), _FLAGS[mode])
