"""Per-port totals folded from the flow table at scrape time (metrics.PortTotals): pure."""
from __future__ import annotations

from sparsegate_ebpf.metrics import PortTotals

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
