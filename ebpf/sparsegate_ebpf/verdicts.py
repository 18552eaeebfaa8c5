"""Per-rule verdict counters: where the program counts them and how they are read back.

The program counts each judged packet in a per-CPU array, `verdict_counts[slot * MAX + rule_id]`,
where `slot` is the pool map (policy_a = 0, policy_b = 1) holding the generation that judged it:
an array index instead of a hash update per packet. A slot's range belongs to one generation at a
time; before the pool map is refilled, its counters are folded into the `verdicts` hash under
(generation, rule, action) and zeroed (`retire_slot`), so the totals of every generation survive.
The swapper then moves older generations' entries out of the hash into totals by rule name
(`PolicySwapper.retired_by_rule`), so the hash holds one generation, not one per swap.
"""
from __future__ import annotations

import ctypes as ct
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .maps import KEY_ENTRY, KEY_RULE, POLICY_MAX_ENTRIES, PolicyKey, VerdictKey

POOL = ("policy_a", "policy_b")
Totals = dict[tuple[int, int, int], tuple[int, int]]  # (generation, rule_id, action) -> (packets, bytes)


@dataclass(frozen=True)
class SlotInfo:
    """What one pool map holds: its generation and each rule's action (rule 0: the default)."""

    generation: int
    actions: Mapping[int, int]


def slot_info(records: Iterable[tuple[PolicyKey, Any]]) -> SlotInfo | None:
    """From one inner map's records (meta included); None without a meta record."""
    generation, actions = None, {}
    for k, v in records:
        if bytes(k) == bytes(PolicyKey()):
            generation, actions[0] = v.generation, v.action
        elif k.kind in (KEY_ENTRY, KEY_RULE):
            actions[v.rule_id] = v.action
    return None if generation is None else SlotInfo(generation, actions)


def _lib() -> Any:
    from bcc import lib

    return lib


def read_range(table: Any, start: int, n: int) -> list[tuple[int, int]]:
    """(packets, bytes) summed over CPUs for indexes start..start+n-1 of a per-CPU counter array
    (one BPF_MAP_LOOKUP_BATCH)."""
    if n <= 0:
        return []
    keys = (ct.c_uint32 * n)()
    vals = (table.Leaf * n)()
    count = ct.c_uint32(n)
    prev = ct.c_uint32(start - 1)
    out = ct.c_uint32(0)
    rc = _lib().bpf_lookup_batch(table.map_fd, ct.byref(prev) if start else None, ct.byref(out),
                                 ct.byref(keys), ct.byref(vals), ct.byref(count))
    err = ct.get_errno()
    if rc != 0 and err != 2:  # ENOENT: the end of the array
        raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
    got = [(0, 0)] * n
    for i in range(count.value):
        idx = keys[i] - start
        if 0 <= idx < n:
            got[idx] = (sum(c.packets for c in vals[i]), sum(c.bytes for c in vals[i]))
    return got


def zero_range(table: Any, start: int, n: int) -> None:
    """Zero indexes start..start+n-1 on every CPU (one BPF_MAP_UPDATE_BATCH)."""
    if n <= 0:
        return
    keys = (ct.c_uint32 * n)(*range(start, start + n))
    vals = (table.Leaf * n)()
    count = ct.c_uint32(n)
    if _lib().bpf_update_batch(table.map_fd, ct.byref(keys), ct.byref(vals), ct.byref(count)) != 0:
        err = ct.get_errno()
        raise OSError(err, f"BPF_MAP_UPDATE_BATCH: {os.strerror(err)}")


def _span(info: SlotInfo) -> int:
    return min(POLICY_MAX_ENTRIES, max(info.actions, default=0) + 1)


def slot_counts(bpf: Any, slot: int, info: SlotInfo) -> Totals:
    """The counters a slot holds now, under its generation's (rule, action)s; zeros left out."""
    out: Totals = {}
    for rule, (packets, bytes_) in enumerate(read_range(bpf[b"verdict_counts"], slot * POLICY_MAX_ENTRIES,
                                                        _span(info))):
        if packets and rule in info.actions:
            out[(info.generation, rule, info.actions[rule])] = (packets, bytes_)
    return out


def retire_slot(bpf: Any, slot: int, info: SlotInfo) -> None:
    """Fold a slot's counters into the `verdicts` hash and zero them. The caller makes sure no
    program still counts there (its map is not live and an RCU grace period has passed)."""
    retired = bpf[b"verdicts"]
    for (generation, rule, action), (packets, bytes_) in slot_counts(bpf, slot, info).items():
        key = VerdictKey(generation=generation, rule_id=rule, action=action)
        try:
            old = retired[key]
            packets, bytes_ = packets + old.packets, bytes_ + old.bytes
        except KeyError:
            pass
        retired[key] = retired.Leaf(packets, bytes_)
    zero_range(bpf[b"verdict_counts"], slot * POLICY_MAX_ENTRIES, _span(info))


def totals(bpf: Any, slots: Mapping[int, SlotInfo]) -> Totals:
    """Every generation's verdict counters: the folded ones plus what the slots hold now."""
    out: Totals = {(k.generation, k.rule_id, k.action): (v.packets, v.bytes) for k, v in bpf[b"verdicts"].items()}
    for slot, info in slots.items():
        for key, (packets, bytes_) in slot_counts(bpf, slot, info).items():
            p, b = out.get(key, (0, 0))
            out[key] = (p + packets, b + bytes_)
    return out


def slots_in_maps(bpf: Any) -> dict[int, SlotInfo]:
    """SlotInfo of each pool map, read from the maps themselves (no swapper needed)."""
    out = {}
    for slot, name in enumerate(POOL):
        info = slot_info(bpf[name.encode()].items_lookup_batch())
        if info is not None:
            out[slot] = info
    return out
