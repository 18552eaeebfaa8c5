"""Per-port totals folded from the flow table at scrape time (metrics.PortTotals): pure."""
from __future__ import annotations

from sparsegate_ebpf.maps import FlowKey, addr_of, port_to_be16
from sparsegate_ebpf.metrics import AgentState, FlowTotals, PortTotals, XdpCollector

HTTP, DNS = (8080, 6), (53, 17)


def test_totals_sum_live_flows_per_port() -> None:
    t = PortTotals()
    got = t.fold([("a", 3, 300, HTTP), ("b", 2, 200, HTTP), ("c", 1, 60, DNS)])
    assert got == {HTTP: (5, 500), DNS: (1, 60)}


def test_an_evicted_flow_keeps_its_last_scraped_counts_so_totals_never_go_down() -> None:
    t = PortTotals()
    t.fold([("a", 3, 300, HTTP), ("b", 2, 200, HTTP)])
    assert t.fold([("b", 4, 400, HTTP)]) == {HTTP: (7, 700)}          # a evicted: its 3 stay
    # b evicted and seen again (fewer packets than last time): both incarnations counted
    assert t.fold([("b", 1, 100, HTTP)]) == {HTTP: (8, 800)}
    assert t.fold([]) == {HTTP: (8, 800)}


def _flow(dport: int, *, packets: int, bytes_: int) -> tuple[FlowKey, FlowTotals]:
    key = FlowKey(saddr=addr_of("10.1.0.1"), daddr=addr_of("10.1.0.2"), sport=port_to_be16(443),
                  dport=port_to_be16(dport), proto=6)
    return key, FlowTotals(packets=packets, bytes=bytes_, dropped=0, first_seen_jiffies=1, last_seen_jiffies=1)


def _series(collector: XdpCollector, flows: list[tuple[FlowKey, FlowTotals]]) -> dict[str, float]:
    packets, _bytes = collector._ports(flows)
    return {s.labels["port"]: s.value for s in packets.samples if s.name.endswith("_total")}


def test_port_series_are_capped_to_the_largest_and_a_port_cut_off_comes_back_monotonic() -> None:
    """Replies reach the node's ephemeral ports: one series per port ever seen would grow without
    a cap (up to 2 x 65,536 per metric); the exporter keeps the largest by bytes."""
    collector = XdpCollector(state=AgentState(), max_ports=3)
    serving = _flow(8080, packets=10, bytes_=10_000)
    ephemeral = [_flow(32768 + i, packets=1, bytes_=100 + i) for i in range(50)]
    got = _series(collector, [serving, *ephemeral])
    assert got == {"8080": 10, "32817": 1, "32816": 1}
    # 8080's flow evicted (its total stays) while bigger ports come: cut off, then back with its total
    got = _series(collector, [_flow(40000 + i, packets=5, bytes_=20_000) for i in range(3)])
    assert "8080" not in got and len(got) == 3
    got = _series(collector, [_flow(8080, packets=90, bytes_=90_000)])
    assert got["8080"] == 100 and len(got) == 3
