"""Atomic policy replacement: an A/B pool of inner maps behind one outer array slot.

A new policy is written completely into the inactive inner map, then made live with one
update of `policy_outer[0]` - a single pointer store the program reads once per packet, so no
packet ever sees a half-written policy and allowed flows are never dropped by a swap. Then
`policy_live[0]` gets the new generation: flows whose cached outcome is older are judged again.

Reusing the old inner map right away is safe: for map-in-map types the kernel's update
syscall waits for an RCU grace period (kernel/bpf/syscall.c `maybe_wait_bpf_programs`), so
when it returns no running program still holds the previous inner map.
"""
from __future__ import annotations

import ctypes as ct
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import verdicts
from .maps import IDENTITY_ALLOWED, KEY_POLICED_DST, KEY_RULE, KEY_SOURCE, PolicyKey, PolicyVal
from .policy import FlowPolicy, PolicyError, compile_policy, upgrade_records
from .verdicts import POOL, SlotInfo


def rule_layout(records: list[tuple[PolicyKey, PolicyVal]]) -> frozenset[tuple[bytes, int, int, int]]:
    """What a generation's rule ids stand for, generation and slot aside: the default action, each
    rule record (key, action, rule id) and the identities of addresses (policed destinations and
    rule sources; the always-allowed sources, the node's own among them, left out). Two record
    sets with the same layout give every rule id the same meaning."""
    out = set()
    for k, v in records:
        if bytes(k) == bytes(PolicyKey()):
            out.add((b"", v.action, 0, 0))
        elif k.kind == KEY_RULE:
            out.add((bytes(k), v.action, v.rule_id, 0))
        elif k.kind == KEY_POLICED_DST or (k.kind == KEY_SOURCE and v.identity != IDENTITY_ALLOWED):
            out.add((bytes(k), 0, 0, v.identity))
    return frozenset(out)


@dataclass(frozen=True)
class SwapResult:
    generation: int
    slot: str             # inner map now live
    entries: int          # records written (incl. meta)
    fill_seconds: float   # writing the inactive map
    swap_seconds: float   # the outer-slot update alone (incl. the kernel's RCU wait)


def empty(table: Any) -> None:
    """Delete every record of a hash map no one else writes. Not bcc's ``clear()``: it deletes each
    key as it walks, and the kernel continues a walk whose key is gone from the first bucket, so
    every delete rescans the buckets already emptied (quadratic: 5.9 s for 101,800 records in a
    131,072-record map, 115 s in a 1,048,576-record one, against 0.4 and 1.1 s listed first), all
    under the swapper's lock that every scrape waits for."""
    for key in list(table.keys()):
        try:
            del table[key]
        except KeyError:
            pass


class PolicySwapper:
    def __init__(self, *, bpf: Any) -> None:
        self._outer = bpf[b"policy_outer"]
        self._live = bpf[b"policy_live"]
        self._pool = [bpf[name.encode()] for name in POOL]
        # Read from the maps themselves, so the records checked against are the records loaded.
        self.max_records = int(self._pool[0].max_entries)
        self.live_records = 0  # records in the live inner map (meta included)
        self._active: int | None = None
        self._lock = threading.Lock()
        self._bpf = bpf
        # What each pool map holds (its verdict counters' generation and rule actions).
        self.slots: dict[int, SlotInfo] = verdicts.slots_in_maps(bpf)
        self.generation = 0
        self.policy: FlowPolicy | None = None
        self.rule_names: dict[int, dict[int, str]] = {}  # generation -> rule_id -> rule
        # Verdicts of generations older than the last one retired, by (rule name, action): folded
        # out of the `verdicts` hash at each swap, so the hash holds at most one generation's rules
        # (it grew by one generation a swap until updates failed) and a rule's total never drops
        # while a generation in the maps names it; a rule none of them names (its RoutingPolicy
        # deleted) is dropped, or every rule ever published stayed a series for the agent's life.
        self.retired_by_rule: dict[tuple[str, int], tuple[int, int]] = {}
        # Sources always allowed to policed destinations besides the document's (node addresses).
        self.extra_sources: tuple[str, ...] = ()
        # A carried-over generation whose rule names are unknown, and its rule layout: the first
        # document applied after it names its rules when it compiles to the same layout (the
        # document the predecessor had, arriving late), so their verdicts keep their rule series.
        self._unnamed: tuple[int, frozenset[tuple[bytes, int, int, int]]] | None = None

    def apply(self, policy: FlowPolicy, *, extra_sources: tuple[str, ...] | None = None) -> SwapResult:
        """Make `policy` live; `extra_sources` (None: keep the current ones) replace the node's own
        always-allowed sources."""
        with self._lock:
            if extra_sources is not None:
                self.extra_sources = tuple(sorted(set(extra_sources)))
            generation = self.generation + 1
            records = compile_policy(policy, generation=generation, extra_sources=self.extra_sources,
                                     max_records=self.max_records)
            result = self._install(records, generation=generation, policy=policy, rule_names=policy.rule_names())
            if self._unnamed is not None:
                inherited, layout = self._unnamed
                self._unnamed = None  # only the first document: a later one is newer than the predecessor's
                if inherited in self.rule_names and rule_layout(records) == layout:
                    self.rule_names[inherited] = policy.rule_names()
            return result

    def apply_records_if_empty(self, records: list[tuple[PolicyKey, PolicyVal]]) -> SwapResult | None:
        """Make records read from another program live as they are (inherit.py), unless a policy
        is live already (a document that arrived meanwhile is newer: None). They keep their
        generation (the meta record's), so verdicts stay attributed to one generation; rule names
        are unknown (the document is not in the maps): verdicts read gen<N>/rule<M> until the next
        document, which names them when it compiles to the same rules (``rule_layout``)."""
        meta = next((v for k, v in records if bytes(k) == bytes(PolicyKey())), None)
        if meta is None:
            raise ValueError("no meta record: not a policy map")
        generation = meta.generation
        # A predecessor from before identities (IP-level entries, allowed-source records; or from
        # before scoped enforcement: no policed destinations) is read as this program reads policy.
        records = upgrade_records(records)
        with self._lock:
            if self._active is not None:
                return None
            result = self._install(records, generation=generation, policy=None, rule_names={})
            self._unnamed = (generation, rule_layout(records))
            return result

    def _install(self, records: list[tuple[PolicyKey, PolicyVal]], *, generation: int,
                 policy: FlowPolicy | None, rule_names: dict[int, str]) -> SwapResult:
        """Fill the inactive inner map, then flip the outer slot (caller holds self._lock)."""
        if len(records) > self.max_records:  # e.g. inherited from a program with larger maps
            raise PolicyError(f"{len(records)} records exceed the map capacity {self.max_records}")
        target = 1 if self._active == 0 else 0
        inner = self._pool[target]
        previous = self.slots.get(target)
        if previous is not None:
            if self._active is not None:
                # Barrier: a map-in-map update waits for running programs, so none still counts
                # for the generation that used this slot (read from policy_live before its change).
                self._outer[ct.c_int(0)] = ct.c_int(self._pool[self._active].get_fd())
            verdicts.retire_slot(self._bpf, target, previous)
            self._fold_retired(before=previous.generation)
            del self.slots[target]  # only once its counters are safe: a failed retire is retried
        records = [(k, PolicyVal(action=v.action, rule_id=v.rule_id, generation=v.generation, slot=target,
                                 identity=v.identity)) for k, v in records]
        t0 = time.perf_counter()
        empty(inner)  # not live: nothing reads it (see module docstring)
        for key, val in records:
            inner[key] = val
        t1 = time.perf_counter()
        self._outer[ct.c_int(0)] = ct.c_int(inner.get_fd())
        t2 = time.perf_counter()
        # After the flip (which waited for running programs): flows' cached outcomes of older
        # generations are judged again at their next packet (xdp_flow.bpf.c, policy_live).
        self._live[ct.c_int(0)] = ct.c_uint32(generation)
        self._active = target
        self.live_records = len(records)
        self.slots[target] = verdicts.slot_info(records)
        self.generation = generation
        self.policy = policy
        self.rule_names[generation] = rule_names
        # Keep attribution for recent generations only (their verdict counters may linger).
        for old in [g for g in self.rule_names if g < generation - 256]:
            del self.rule_names[old]
        if previous is not None:
            self._drop_unnamed(kept={previous.generation, *(info.generation for info in self.slots.values())})
        return SwapResult(generation, POOL[target], len(records), t1 - t0, t2 - t1)

    def rule_name(self, generation: int, rule_id: int) -> str:
        """The rule a generation's rule id stands for (``gen<N>/rule<M>`` when its name is unknown)."""
        return self.rule_names.get(generation, {}).get(rule_id, f"gen{generation}/rule{rule_id}")

    def _fold_retired(self, *, before: int) -> None:
        """Move the `verdicts` hash entries of generations older than ``before`` into
        ``retired_by_rule`` (under their rule names, known for the last 256 generations)."""
        table = self._bpf[b"verdicts"]
        for key, val in list(table.items()):
            if key.generation < before:
                name = (self.rule_name(key.generation, key.rule_id), key.action)
                packets, bytes_ = self.retired_by_rule.get(name, (0, 0))
                self.retired_by_rule[name] = (packets + val.packets, bytes_ + val.bytes)
                del table[key]

    def _drop_unnamed(self, *, kept: set[int]) -> None:
        """Drop the folded totals of rules no generation in ``kept`` (those still in the maps) names."""
        named = {name for g in kept for name in self.rule_names.get(g, {}).values()}
        unknown = tuple(f"gen{g}/" for g in kept)  # ids a generation's names do not cover (``rule_name``)
        for key in [k for k in self.retired_by_rule if k[0] not in named and not k[0].startswith(unknown)]:
            del self.retired_by_rule[key]

    def verdict_totals_by_rule(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(rule name, action) -> (packets, bytes) over every generation (consistent with swaps).
        Every rule of the live generation is there, at 0 until it judges a packet: rate() counts a
        series from its first sample, so a rule's series born at its first packets lost them (a
        single burst of drops never showed on the dashboard's verdicts-by-rule panel)."""
        with self._lock:
            out = dict(self.retired_by_rule)
            live = self.slots.get(self._active) if self._active is not None else None
            if live is not None:
                for rule_id, action in live.actions.items():
                    out.setdefault((self.rule_name(live.generation, rule_id), action), (0, 0))
            for (generation, rule_id, action), (packets, bytes_) in verdicts.totals(self._bpf, dict(self.slots)).items():
                key = (self.rule_name(generation, rule_id), action)
                p, b = out.get(key, (0, 0))
                out[key] = (p + packets, b + bytes_)
            return out
