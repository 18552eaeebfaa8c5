"""Helpers shared by the BPF unit tests, the netns integration tests and the benchmark."""
from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .maps import POLICY_MAX_RECORDS, Counter, be16_to_port, flow_addr_bytes
from .metrics import FlowTotals, fold_counter, fold_flow
from .programs import BpfUnavailable, LoadedProgram, load
from .verdicts import slots_in_maps, zero_range
from .verdicts import totals as verdict_totals


def require_program(*, enforce: bool, audit: bool = False, policy_records: int = POLICY_MAX_RECORDS) -> LoadedProgram:
    """Load the program or raise with the reason; tests turn this into a loud failure."""
    if os.geteuid() != 0:
        raise BpfUnavailable("BPF tests need root (run dev/test.sh as root)")
    return load(enforce=enforce, audit=audit, policy_records=policy_records)


def reset_maps(prog: LoadedProgram) -> None:
    """Empty every telemetry map (policy maps are left to the swapper)."""
    for name in ("flows", "flows6", "handshakes", "verdicts", "counters", "conntrack"):
        prog.bpf[name.encode()].clear()
    table = prog.bpf[b"verdict_counts"]
    zero_range(table, 0, len(table))


def counters(prog: LoadedProgram) -> dict[Counter, int]:
    t = prog.bpf[b"counters"]
    return {c: fold_counter(t[t.Key(int(c))])[0] for c in Counter}


def flows(prog: LoadedProgram) -> dict[tuple[bytes, bytes, int, int, int], FlowTotals]:
    """(saddr, daddr, sport, dport, proto) in map byte order (addresses: ``maps.addr_bytes``) ->
    totals over CPUs, from both flow tables (IPv4 and IPv6)."""
    return {(flow_addr_bytes(k.saddr), flow_addr_bytes(k.daddr), k.sport, k.dport, k.proto): fold_flow(v)
            for table in (b"flows", b"flows6") for k, v in prog.bpf[table].items()}


def verdicts(prog: LoadedProgram) -> dict[tuple[int, int, int], int]:
    """(generation, rule_id, action) -> packets, over every generation (folded and live)."""
    got = verdict_totals(prog.bpf, slots_in_maps(prog.bpf))
    return {key: packets for key, (packets, _) in got.items() if packets}


def ports(prog: LoadedProgram) -> dict[tuple[int, int], tuple[int, int]]:
    """(port host order, proto) -> (packets, bytes), summed over the flows in the table."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for (_s, _d, _sp, dport, proto), t in flows(prog).items():
        key = (be16_to_port(dport), proto)
        packets, bytes_ = out.get(key, (0, 0))
        out[key] = (packets + t.packets, bytes_ + t.bytes)
    return out


def nonzero(d: dict[Any, int], keys: Iterable[Any]) -> dict[Any, int]:
    return {k: d[k] for k in keys if d[k]}


def clear_policy(prog: LoadedProgram) -> None:
    """Empty the outer policy slot (back to 'no policy': everything passes, counted)."""
    import ctypes as ct

    outer = prog.bpf[b"policy_outer"]
    try:
        del outer[ct.c_int(0)]
    except KeyError:
        pass  # already empty
