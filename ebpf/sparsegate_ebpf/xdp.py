"""Attach/detach the loaded program to interfaces, native (driver) XDP or generic (skb)."""
from __future__ import annotations

import enum
import logging
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


def attach(*, bpf: Any, fn: Any, ifname: str, mode: XdpMode) -> XdpMode:
    """Attach and return the mode actually used."""
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
