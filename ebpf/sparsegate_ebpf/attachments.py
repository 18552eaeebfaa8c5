"""Move the agent's one loaded program onto the interfaces its configuration asks for.

``Attachments.apply(desired)`` detaches from interfaces no longer wanted (only where the program
attached is still ours: ``xdp.detach_own``), re-attaches where the asked mode changed (native or
generic asked, the other in use; ``auto`` keeps whatever runs), and attaches to the new ones
(``xdp.attach``, which replaces our own program a previous agent left there in one step). An
interface that cannot be attached (missing, a foreign program on it, a driver without native XDP)
is recorded with its error and retried at the next ``apply``; the others are unaffected. An
attached interface that is gone, or came back under its name as a new interface (a re-created
veth: its program went with the old one), is attached again at the next ``apply``. The
policy maps belong to the program, not to an interface, so attaching to one more interface
enforces the policy already in force there at once.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

from sparsegate_contracts.probes import ERROR_MAX, InterfaceReport, NodeReport, is_ifname

from . import xdp
from .metrics import AgentState

log = logging.getLogger(__name__)

Attach = Callable[..., xdp.XdpMode]
Detach = Callable[..., None]


class Attachments:
    def __init__(self, *, state: AgentState, bpf: Any, fn: Any, attach: Attach = xdp.attach,
                 detach: Detach = xdp.detach_own, after_apply: Callable[[], object] | None = None) -> None:
        self.state = state
        self.bpf, self.fn = bpf, fn
        self._attach, self._detach = attach, detach
        # Called after an apply that left no error (the agent forgets its predecessors' pins then).
        self._after_apply = after_apply
        self.errors: dict[str, str] = {}  # interface -> why it is not attached
        self.ifindex: dict[str, int] = {}  # interface -> its index when we attached to it
        self.lock = threading.Lock()

    def apply(self, desired: Mapping[str, xdp.XdpMode]) -> dict[str, str]:
        """Make the attached set match ``desired`` (interface -> mode); returns the errors."""
        with self.lock:
            # A new dict each time, swapped in whole: the metrics collector reads it from its own thread.
            attached = dict(self.state.attached)
            errors: dict[str, str] = {}
            for ifname in list(attached):
                if ifname in self.ifindex and _index(ifname) != self.ifindex[ifname]:
                    # Gone, or a new interface under the name: the program went with the old one.
                    log.warning("%s is gone or was re-created since XDP was attached: attaching again", ifname)
                    del attached[ifname]
                    self.ifindex.pop(ifname, None)
            for ifname, mode in list(attached.items()):
                want = desired.get(ifname)
                if want is not None and want in (xdp.XdpMode.AUTO, xdp.XdpMode(mode)):
                    continue
                try:
                    self._detach(prog_fd=self.fn.fd, ifname=ifname, mode=xdp.XdpMode(mode))
                    log.info("XDP detached from %s%s", ifname,
                             "" if want is None else f" (mode {mode} -> {want.value})")
                except xdp.NotOurs as exc:
                    log.info("%s: left in place", exc)
                except Exception as exc:  # the interface may be gone with its program
                    log.warning("detaching XDP from %s: %s", ifname, exc)
                del attached[ifname]
                self.ifindex.pop(ifname, None)
            for ifname, mode in sorted(desired.items()):
                if ifname in attached:
                    continue
                try:
                    _exists(ifname)
                    used = self._attach(bpf=self.bpf, fn=self.fn, ifname=ifname, mode=mode)
                except Exception as exc:  # AttachError, or the interface does not exist (OSError)
                    errors[ifname] = str(exc)[:ERROR_MAX]
                    if self.errors.get(ifname) != errors[ifname]:
                        log.error("XDP not attached to %s: %s", ifname, exc)
                    continue
                attached[ifname] = used.value
                index = _index(ifname)
                if index is not None:
                    self.ifindex[ifname] = index
                log.info("XDP attached to %s in %s mode", ifname, used.value)
            self.state.attached = attached
            self.errors = errors
            if not errors and self._after_apply is not None:
                self._after_apply()
            return dict(errors)

    def report(self, *, node: str, config_version: str | None, program_id: int | None,
               desired: Mapping[str, xdp.XdpMode]) -> NodeReport:
        """What is attached now, and why each desired interface that is not attached is not."""
        with self.lock:
            attached, errors = dict(self.state.attached), dict(self.errors)
        items = [InterfaceReport(name=i, mode=attached.get(i),
                                 error=None if i in attached else errors.get(i, "not attached yet"))
                 for i in sorted(set(desired) | set(attached))]
        return NodeReport(node=node, config_version=config_version, program_id=program_id, interfaces=tuple(items))


def _index(ifname: str) -> int | None:
    try:
        return socket.if_nametoindex(ifname)
    except OSError:
        return None


def _exists(ifname: str) -> None:
    if not is_ifname(ifname):
        # No device has such a name; glibc's if_nametoindex would resolve an alias label like
        # eth0:1 to eth0 and the program would land there under another interface's name.
        raise xdp.AttachError(f"{ifname!r} is not a Linux interface name (1-15 bytes, not '.' or '..', "
                              "no '/', ':' or whitespace)")
    try:
        socket.if_nametoindex(ifname)
    except OSError:
        raise xdp.AttachError(f"interface {ifname} does not exist on this node") from None
