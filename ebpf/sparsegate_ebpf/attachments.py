"""Move the agent's one loaded program onto the interfaces its configuration asks for.

``Attachments.apply(desired)`` detaches from interfaces no longer wanted (only where the program
attached is still ours: ``xdp.detach_own``), re-attaches where the asked mode changed (native or
generic asked, the other in use; ``auto`` keeps whatever runs), and attaches to the new ones
(``xdp.attach``, which replaces our own program a previous agent left there in one step). An
interface that cannot be attached (missing, a foreign program on it, a driver without native XDP)
is recorded with its error and retried at the next ``apply``; the others are unaffected. An
attached interface that is gone, or came back under its name as a new interface (a re-created
veth: its program went with the old one; told by its index, or, where a new one got the old index,
by finding no program on it, as where ours was removed), is attached again at the next ``apply``; one renamed
keeps the program, which is detached from it by its old index (the name is what is asked for). The
policy maps belong to the program, not to an interface, so attaching to one more interface
enforces the policy already in force there at once. A mode change the driver refuses (native asked
where only generic works) puts the program back in the mode it ran in, reported with the error and
not retried while that mode is asked: the interface is never left without the program by it.
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
                 detach: Detach = xdp.detach_own, after_apply: Callable[[], object] | None = None,
                 check_bare: bool = False) -> None:
        self.state = state
        self.bpf, self.fn = bpf, fn
        self._attach, self._detach = attach, detach
        # Called after every apply (the agent forgets the pins of predecessors attached nowhere then).
        self._after_apply = after_apply
        self.errors: dict[str, str] = {}  # interface -> why it is not attached
        self.ifindex: dict[str, int] = {}  # interface -> its index when we attached to it
        self._check_bare = check_bare  # look for attached interfaces left with no program at each apply
        self.refused: dict[str, xdp.XdpMode] = {}  # interface -> a mode asked that failed there (kept in the old)
        self.lock = threading.Lock()

    def apply(self, desired: Mapping[str, xdp.XdpMode]) -> dict[str, str]:
        """Make the attached set match ``desired`` (interface -> mode); returns the errors."""
        with self.lock:
            # A new dict each time, swapped in whole: the metrics collector reads it from its own thread.
            attached = dict(self.state.attached)
            errors: dict[str, str] = {}
            for ifname in list(attached):
                if ifname in self.ifindex and _index(ifname) != self.ifindex[ifname]:
                    # Gone (the program went with it), re-created, or renamed: a renamed interface
                    # keeps the program, which would enforce there unseen and outlive the agent,
                    # so it is detached by the index it had (only where still ours).
                    log.warning("%s is gone, re-created or renamed since XDP was attached: attaching again", ifname)
                    try:
                        self._detach(prog_fd=self.fn.fd, ifname=ifname, mode=xdp.XdpMode(attached[ifname]),
                                     ifindex=self.ifindex[ifname])
                        log.warning("XDP detached from the interface %s had (index %d): renamed since",
                                    ifname, self.ifindex[ifname])
                    except Exception:  # gone with its program (ENODEV), or the index is not ours now
                        pass
                    del attached[ifname]
                    self.ifindex.pop(ifname, None)
            for ifname in self._bare(attached):
                # Same name and index, no program: a new interface that got the old one's index
                # (deleted, re-created: the program went with the old one), or ours was removed.
                log.warning("%s has no XDP program, though ours was attached to it: attaching again", ifname)
                del attached[ifname]
                self.ifindex.pop(ifname, None)
            previous: dict[str, xdp.XdpMode] = {}  # interface -> the mode it ran in before a mode change
            for ifname, mode in list(attached.items()):
                want = desired.get(ifname)
                if want is not None and want in (xdp.XdpMode.AUTO, xdp.XdpMode(mode)):
                    continue
                if want is not None and self.refused.get(ifname) == want:
                    # That mode failed here and the program went back to the one it ran in: not
                    # retried (each try leaves the interface without a program for a moment).
                    errors[ifname] = self.errors.get(ifname, f"{want.value} mode refused")
                    continue
                if want is not None:
                    previous[ifname] = xdp.XdpMode(mode)
                try:
                    self._detach(prog_fd=self.fn.fd, ifname=ifname, mode=xdp.XdpMode(mode),
                                 ifindex=self.ifindex.get(ifname))
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
                    if ifname in previous and self._restore(ifname, previous[ifname], attached, exc):
                        self.refused[ifname] = mode
                        errors[ifname] = f"{exc} (kept in {previous[ifname].value} mode)"[:ERROR_MAX]
                        continue
                    if self.errors.get(ifname) != errors[ifname]:
                        log.error("XDP not attached to %s: %s", ifname, exc)
                    continue
                attached[ifname] = used.value
                index = _index(ifname)
                if index is not None:
                    self.ifindex[ifname] = index
                log.info("XDP attached to %s in %s mode", ifname, used.value)
                if mode not in (xdp.XdpMode.AUTO, used):  # back in the mode a predecessor's program ran in
                    self.refused[ifname] = mode
                    errors[ifname] = f"{mode.value} mode refused: kept in {used.value} mode"
            self.state.attached = attached
            self.errors = errors
            self.refused = {i: m for i, m in self.refused.items() if i in attached and desired.get(i) == m}
            # Errors or not: the sweep forgets only programs attached nowhere, which no retry needs,
            # and each one it keeps holds a whole program's maps (tens of MiB) for the node's life.
            if self._after_apply is not None:
                self._after_apply()
            return dict(errors)

    def _bare(self, names: Mapping[str, str]) -> list[str]:
        """Those of ``names`` with no XDP program attached now (a successor's program, or anyone
        else's, is left alone). Only with ``check_bare`` (the agent's; not with fake attach calls)."""
        if not names or not self._check_bare:
            return []
        try:
            links = xdp.attached_programs()
        except Exception as exc:  # checked again at the next apply
            log.warning("cannot list the XDP programs attached: %s", exc)
            return []
        return [i for i in names if i in links and not links[i]]

    def _restore(self, ifname: str, mode: xdp.XdpMode, attached: dict[str, str], exc: Exception) -> bool:
        """After a mode change the driver refused: attach again in the mode that ran, so the
        interface is not left without the program (its policy, its telemetry) until the
        configuration changes. True when done."""
        try:
            used = self._attach(bpf=self.bpf, fn=self.fn, ifname=ifname, mode=mode)
        except Exception as again:
            log.error("XDP not attached to %s: %s; and back in %s mode: %s", ifname, exc, mode.value, again)
            return False
        attached[ifname] = used.value
        index = _index(ifname)
        if index is not None:
            self.ifindex[ifname] = index
        log.error("XDP mode change on %s refused (%s): attached again in %s mode; not retried until the "
                  "configuration changes", ifname, exc, used.value)
        return True

    def report(self, *, node: str, config_version: str | None, program_id: int | None,
               desired: Mapping[str, xdp.XdpMode]) -> NodeReport:
        """What is attached now, and why each desired interface that is not attached is not."""
        with self.lock:
            attached, errors = dict(self.state.attached), dict(self.errors)
        items = [InterfaceReport(name=i, mode=attached.get(i),
                                 error=errors.get(i) if i in attached else errors.get(i, "not attached yet"))
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
