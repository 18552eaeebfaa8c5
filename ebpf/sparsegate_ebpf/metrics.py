"""Prometheus export: a custom collector that reads the BPF maps at scrape time.

Nothing is copied periodically; each scrape walks the maps, folds the per-CPU values and
yields fresh metric families. Flow series are capped (largest by bytes) to bound cardinality, and so
are handshake series (one per client, server and server port; most samples first).
Per-port totals are folded from the flow table at scrape time (the program keeps no per-port map:
one hash update less per packet); a flow that leaves the table (LRU eviction) keeps its last
scraped counts in its port's total, so the totals never go down, but packets it got between
that scrape and its eviction are not counted. Port series are capped too (largest totals by
bytes): every reply to a connection the node opened arrives at an ephemeral destination port, so
uncapped they would grow towards one series per port and protocol ever seen (2 x 65,536). A port
cut off keeps its total, so its series, when it comes back, is still monotonic.

A flow idle (no packet) for longer than ``flow_idle_timeout`` (the agent's --flow-idle-timeout) is
no longer exported as per-flow series, though it stays in the table (and in its port's total)
until the LRU evicts it: ended flows neither hold a series for ever nor crowd active flows out of
the cap. Each LRU table's fill (entries / max_entries, as Cilium's ``cilium_bpf_map_pressure``)
is counted from the walk every scrape does anyway (no extra syscall); `conntrack`'s, which is
not read otherwise, from a walk of its keys (65,536: ~0.1 s).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .flowclock import FlowClock
from .maps import PROTO_NAMES, Counter, be16_to_port, flow_ip, ip_of
from .policy import ACTION_NAMES


@dataclass
class FlowTotals:
    packets: int
    bytes: int
    dropped: int
    first_seen_jiffies: int
    last_seen_jiffies: int


def fold_flow(per_cpu: Iterable[Any]) -> FlowTotals:
    """Sum counters over CPUs; first seen = earliest non-zero, last seen = latest. A CPU other than
    the one whose packet created the entry counts into a zeroed slot (the per-CPU LRU map zeroes
    every CPU's value on insert) and never stamps its first packet: its first seen stays 0."""
    vals = [v for v in per_cpu if v.packets]
    return FlowTotals(
        packets=sum(v.packets for v in vals),
        bytes=sum(v.bytes for v in vals),
        dropped=sum(v.dropped for v in vals),
        first_seen_jiffies=min((v.first_seen_jiffies for v in vals if v.first_seen_jiffies), default=0),
        last_seen_jiffies=max((v.last_seen_jiffies for v in vals), default=0),
    )


def read_entries(table: Any) -> list[tuple[Any, Any]]:
    """A hash map's (key, value) pairs, each key once. The kernel's get-next-key walk starts over
    from the first bucket when the key it continues from is gone (a flow the LRU evicted while the
    table was read; under churn, often), so a walk can return the same keys again: the latest read
    of a key is kept."""
    return list({bytes(k): (k, v) for k, v in table.iteritems()}.values())


def fold_counter(per_cpu: Iterable[Any]) -> tuple[int, int]:
    packets = bytes_ = 0
    for v in per_cpu:
        packets += v.packets
        bytes_ += v.bytes
    return packets, bytes_


class PortTotals:
    """Monotonic per-(port, proto) totals folded from the flow table at each scrape."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # flow -> packets, bytes, port key, first seen (jiffies: which incarnation of the flow)
        self._last: dict[Any, tuple[int, int, tuple[int, int], int]] = {}
        self._retired: dict[tuple[int, int], list[int]] = {}

    def fold(self, flows: Iterable[tuple[Any, int, int, tuple[int, int], int]]) -> dict[tuple[int, int], tuple[int, int]]:
        """`flows`: (flow key, packets, bytes, (port, proto), first seen) as read now -> totals per
        port. A flow evicted and seen again is a new incarnation: a later first seen (or fewer
        packets or bytes than last read), however many packets it has got since."""
        with self._lock:
            now = {key: (packets, bytes_, port, first) for key, packets, bytes_, port, first in flows}
            for key, (packets, bytes_, port, first) in self._last.items():
                cur = now.get(key)
                if cur is None or cur[0] < packets or cur[1] < bytes_ or cur[3] > first:  # evicted (or evicted and seen again)
                    acc = self._retired.setdefault(port, [0, 0])
                    acc[0] += packets
                    acc[1] += bytes_
            self._last = now
            totals = {port: (acc[0], acc[1]) for port, acc in self._retired.items()}
            for packets, bytes_, port, _first in now.values():
                p, b = totals.get(port, (0, 0))
                totals[port] = (p + packets, b + bytes_)
            return totals


@dataclass
class AgentState:
    """What the agent knows beyond the maps; shared with the collector (read under no lock:
    single attribute reads are atomic in CPython)."""

    bpf_available: bool = False
    bpf_error: str = ""
    program: Any = None                 # programs.LoadedProgram
    swapper: Any = None                 # policyswap.PolicySwapper
    attached: dict[str, str] = field(default_factory=dict)  # interface -> native|generic
    policy_version: str = ""
    policy_errors: int = 0
    policy_swaps: int = 0
    last_swap_seconds: float = 0.0
    enforcement: str = "enforce"        # off | audit | enforce
    lock: threading.Lock = field(default_factory=threading.Lock)
    ports: PortTotals = field(default_factory=PortTotals)


FLOW_IDLE_TIMEOUT = 300.0  # seconds without a packet after which a flow's series are no longer exported
LRU_TABLES = (b"flows", b"flows6", b"handshakes")  # walked at every scrape: their fill comes free


def _proto(num: int) -> str:
    return PROTO_NAMES.get(num, str(num))


class XdpCollector:
    def __init__(self, *, state: AgentState, max_flows: int = 1000, max_ports: int = 1000,
                 flow_idle_timeout: float = FLOW_IDLE_TIMEOUT) -> None:
        self._state = state
        self._max_flows = max_flows
        self._flow_idle_timeout = flow_idle_timeout  # seconds; 0: flows are exported until evicted
        self._max_ports = max_ports
        # One scrape at a time reads the flow table and folds its port totals: a fold of a read
        # older than the last one folded would take every flow that grew meanwhile for an evicted
        # one and count it twice, for good (Prometheus HA pairs scrape each agent twice).
        self._scrape_lock = threading.Lock()
        self._handshake_samples: dict[bytes, int] = {}  # handshakes key -> samples at the last scrape
        self._handshake_last: dict[tuple[str, str, str], float] = {}  # labels -> last exported RTT

    def describe(self) -> Sequence[Metric]:
        return []  # no scrape at registration time

    def collect(self) -> Iterator[Metric]:
        s = self._state
        avail = GaugeMetricFamily("sparsegate_agent_bpf_available", "1 when the XDP program is loaded")
        avail.add_metric([], 1.0 if s.bpf_available else 0.0)
        yield avail
        att = GaugeMetricFamily("sparsegate_xdp_attached", "XDP program attached, by interface and mode",
                                labels=["interface", "mode"])
        for ifname, mode in sorted(s.attached.items()):
            att.add_metric([ifname, mode], 1.0)
        yield att
        pe = CounterMetricFamily("sparsegate_agent_policy_errors", "Policy documents rejected")
        pe.add_metric([], s.policy_errors)
        yield pe
        mode = GaugeMetricFamily("sparsegate_xdp_enforcement", "Enforcement mode of the loaded program "
                                 "(off: telemetry only; audit: judged, never dropped; enforce)", labels=["mode"])
        mode.add_metric([s.enforcement], 1.0)
        yield mode
        if not s.bpf_available or s.program is None:
            return
        bpf = s.program.bpf

        pk = CounterMetricFamily("sparsegate_xdp_packets", "Packets seen by XDP, by type", labels=["type"])
        by = CounterMetricFamily("sparsegate_xdp_bytes", "Bytes seen by XDP, by type", labels=["type"])
        counters = bpf[b"counters"]
        audit = 0
        for c in Counter:
            packets, bytes_ = fold_counter(counters[counters.Key(int(c))])
            pk.add_metric([c.name.lower()], packets)
            by.add_metric([c.name.lower()], bytes_)
            if c == Counter.AUDIT_DENY:
                audit = packets
        yield pk
        yield by
        ad = CounterMetricFamily("sparsegate_xdp_policy_audit_drops",
                                 "Packets the policy denies that audit mode passed (would-be drops)")
        ad.add_metric([], audit)
        yield ad

        with self._scrape_lock:  # read and fold as one step (materialised: no lock held across a yield)
            entries = {table: read_entries(bpf[table]) for table in LRU_TABLES}
            flows = [(k, fold_flow(v)) for table in (b"flows", b"flows6") for k, v in entries[table]]
            ports = list(self._ports(flows))
            handshakes = list(self._handshakes(bpf, entries[b"handshakes"]))
        yield from self._flows(flows, clock=s.program.clock)
        fill = {table.decode(): (len(entries[table]), int(bpf[table].max_entries)) for table in LRU_TABLES}
        # conntrack is not read otherwise: its keys alone are walked for the count (65,536: ~0.1 s)
        table = bpf[b"conntrack"]
        fill["conntrack"] = (len({bytes(k) for k in table.keys()}), int(table.max_entries))
        yield from self._fill(fill)
        yield from ports
        yield from handshakes
        yield from self._policy(bpf)

    def _flows(self, flows: list[tuple[Any, FlowTotals]], *, clock: FlowClock) -> Iterator[Metric]:
        labels = ["src", "dst", "sport", "dport", "proto"]
        fp = CounterMetricFamily("sparsegate_xdp_flow_packets", "Packets per TCP/UDP flow (IPv4 or IPv6)", labels=labels)
        fb = CounterMetricFamily("sparsegate_xdp_flow_bytes", "Bytes per TCP/UDP flow (IPv4 or IPv6)", labels=labels)
        fd = CounterMetricFamily("sparsegate_xdp_flow_dropped_packets", "Policy drops per flow", labels=labels)
        dur = GaugeMetricFamily("sparsegate_xdp_flow_duration_seconds",
                                "Last seen - first seen (kernel ticks: one tick of resolution)", labels=labels)
        gap = GaugeMetricFamily("sparsegate_xdp_flow_mean_interarrival_seconds",
                                "(last - first seen) / (packets - 1)", labels=labels)
        idle = GaugeMetricFamily("sparsegate_xdp_flow_idle_seconds", "Now - last seen", labels=labels)
        now = clock.sample().jiffies if flows else 0  # flows are stamped in jiffies (flowclock.py)
        timeout = self._flow_idle_timeout
        active = [(k, t) for k, t in flows
                  if not timeout or clock.seconds(max(0, now - t.last_seen_jiffies)) <= timeout]
        active.sort(key=lambda kv: kv[1].bytes, reverse=True)
        for k, t in active[: self._max_flows]:
            lv = [flow_ip(k.saddr), flow_ip(k.daddr), str(be16_to_port(k.sport)),
                  str(be16_to_port(k.dport)), _proto(k.proto)]
            fp.add_metric(lv, t.packets)
            fb.add_metric(lv, t.bytes)
            fd.add_metric(lv, t.dropped)
            span = clock.seconds(t.last_seen_jiffies - t.first_seen_jiffies)
            dur.add_metric(lv, span)
            if t.packets > 1:
                gap.add_metric(lv, span / (t.packets - 1))
            idle.add_metric(lv, clock.seconds(max(0, now - t.last_seen_jiffies)))
        tracked = GaugeMetricFamily("sparsegate_xdp_flows_tracked", "Flows in the LRU flow table")
        tracked.add_metric([], len(flows))
        expired = GaugeMetricFamily("sparsegate_xdp_flows_idle_expired",
                                    "Flows in the table idle past --flow-idle-timeout (not exported per flow)")
        expired.add_metric([], len(flows) - len(active))
        yield from (fp, fb, fd, dur, gap, idle, tracked, expired)

    @staticmethod
    def _fill(tables: dict[str, tuple[int, int]]) -> Iterator[Metric]:
        """Per LRU table: entries read by this scrape's walk and entries / max_entries (the
        kernel's LRU starts evicting before 1.0: its free lists are per CPU)."""
        entries = GaugeMetricFamily("sparsegate_xdp_map_entries", "Entries in an LRU map (this scrape's walk)",
                                    labels=["map"])
        capacity = GaugeMetricFamily("sparsegate_xdp_map_capacity", "max_entries of an LRU map", labels=["map"])
        pressure = GaugeMetricFamily("sparsegate_xdp_map_pressure", "Fill of an LRU map: entries / max_entries",
                                     labels=["map"])
        for name, (n, cap) in sorted(tables.items()):
            entries.add_metric([name], n)
            capacity.add_metric([name], cap)
            pressure.add_metric([name], n / cap if cap else 0.0)
        yield from (entries, capacity, pressure)

    def _ports(self, flows: list[tuple[Any, FlowTotals]]) -> Iterator[Metric]:
        pp = CounterMetricFamily("sparsegate_xdp_port_packets", "Packets by destination port", labels=["port", "proto"])
        pb = CounterMetricFamily("sparsegate_xdp_port_bytes", "Bytes by destination port", labels=["port", "proto"])
        totals = self._state.ports.fold(
            # The raw key: an IPv4 flow (16 bytes) is never the IPv6 one (40) with IPv4-mapped addresses.
            (bytes(k), t.packets, t.bytes, (be16_to_port(k.dport), k.proto), t.first_seen_jiffies) for k, t in flows)
        # Largest first (ties by port, so a scrape is deterministic), then exported in port order.
        kept = sorted(totals.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))[: self._max_ports]
        for (port, proto), (packets, bytes_) in sorted(kept):
            pp.add_metric([str(port), _proto(proto)], packets)
            pb.add_metric([str(port), _proto(proto)], bytes_)
        yield pp
        yield pb

    def _handshakes(self, bpf: Any, entries: list[tuple[Any, Any]] | None = None) -> Iterator[Metric]:
        """One series per (client, server, server port): the table holds one entry per client
        connection (its own source port), so entries are summed; capped like flows (most samples
        first). Caller holds ``_scrape_lock`` (the samples seen at the last scrape)."""
        labels = ["src", "dst", "dport"]
        last = GaugeMetricFamily("sparsegate_xdp_tcp_handshake_rtt_seconds",
                                 "Last SYN->SYN-ACK time seen at this node, by client, server and server port "
                                 "(of several connections handshaken since the previous scrape, the slowest)",
                                 labels=labels)
        mean = GaugeMetricFamily("sparsegate_xdp_tcp_handshake_rtt_mean_seconds",
                                 "Mean SYN->SYN-ACK time", labels=labels)
        # labels -> [rtt sum, samples, slowest last rtt sampled since the last scrape (-1: none), slowest last rtt]
        groups: dict[tuple[str, str, str], list[int]] = {}
        seen: dict[bytes, int] = {}
        for k, h in read_entries(bpf[b"handshakes"]) if entries is None else entries:
            if not h.samples:
                continue
            raw = bytes(k)
            seen[raw] = h.samples
            g = groups.setdefault((ip_of(k.saddr), ip_of(k.daddr), str(be16_to_port(k.dport))), [0, 0, -1, 0])
            g[0] += h.rtt_sum_ns
            g[1] += h.samples
            g[3] = max(g[3], h.last_rtt_ns)
            if h.samples != self._handshake_samples.get(raw):  # sampled since the last scrape
                g[2] = max(g[2], h.last_rtt_ns)
        kept = sorted(groups.items(), key=lambda kv: (-kv[1][1], kv[0]))[: self._max_flows]
        last_values = {}
        for lv, (rtt_sum, samples, newest, slowest) in sorted(kept):
            value = newest / 1e9 if newest >= 0 else self._handshake_last.get(lv, slowest / 1e9)
            last_values[lv] = value
            last.add_metric(list(lv), value)
            mean.add_metric(list(lv), rtt_sum / samples / 1e9)
        self._handshake_samples, self._handshake_last = seen, last_values
        yield last
        yield mean

    def _policy(self, bpf: Any) -> Iterator[Metric]:
        s = self._state
        if s.swapper is None:
            return
        gen = GaugeMetricFamily("sparsegate_xdp_policy_generation", "Live policy generation")
        gen.add_metric([], s.swapper.generation)
        yield gen
        info = GaugeMetricFamily("sparsegate_xdp_policy_info", "Live policy version", labels=["version"])
        if s.policy_version:
            info.add_metric([s.policy_version], 1.0)
        yield info
        swaps = CounterMetricFamily("sparsegate_xdp_policy_swaps", "Atomic policy swaps")
        swaps.add_metric([], s.policy_swaps)
        yield swaps
        sw = GaugeMetricFamily("sparsegate_xdp_policy_last_swap_seconds", "Duration of the last outer-slot update")
        sw.add_metric([], s.last_swap_seconds)
        yield sw
        cap = GaugeMetricFamily("sparsegate_xdp_policy_map_capacity_records",
                                "max_entries of each inner policy map (--policy-map-records)")
        cap.add_metric([], s.swapper.max_records)
        yield cap
        used = GaugeMetricFamily("sparsegate_xdp_policy_map_records", "Records in the live inner policy map")
        used.add_metric([], s.swapper.live_records)
        yield used
        verdicts = CounterMetricFamily("sparsegate_xdp_policy_verdicts", "Packets judged, by rule and action",
                                       labels=["rule", "action"])
        totals: dict[tuple[str, str], int] = {}
        for (rule, action), (packets, _) in s.swapper.verdict_totals_by_rule().items():
            key = (rule, ACTION_NAMES.get(action, str(action)))
            totals[key] = totals.get(key, 0) + packets
        for (rule, action), packets in sorted(totals.items()):
            verdicts.add_metric([rule, action], packets)
        yield verdicts
