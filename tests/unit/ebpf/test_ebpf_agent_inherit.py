"""Which predecessor's policy the agent carries over (agent._inherit) when programs of ours sit on
several interfaces: pure, mocked at our own wrappers (xdp.attached_program, inherit.live_policy*)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sparsegate_ebpf import agent, inherit, xdp
from sparsegate_ebpf.metrics import AgentState
from sparsegate_ebpf.policy import PolicyError


class FakeSwapper:
    """apply_records_if_empty as PolicySwapper's: records go live once, None once a policy is live."""

    def __init__(self, *, max_records: int = 100) -> None:
        self.max_records = max_records
        self.live: Any = None

    def apply_records_if_empty(self, records: list[str]) -> SimpleNamespace | None:
        if self.live is not None:
            return None
        if len(records) > self.max_records:
            raise PolicyError(f"{len(records)} records exceed the map capacity {self.max_records}")
        self.live = records
        return SimpleNamespace(generation=7, entries=len(records))


def node(monkeypatch: pytest.MonkeyPatch, *, on: dict[str, int], policies: dict[int, list[str] | None]) -> None:
    """Interface -> the prog id attached (all pinned by predecessors); prog id -> its live records."""
    monkeypatch.setattr(xdp, "attached_program", lambda ifname: {"mode": 1, "prog": {"id": on[ifname]}})
    monkeypatch.setattr(inherit, "live_policy_pinned", lambda pinned: policies[pinned])


def carried(interfaces: list[str], *, pinned: list[int], swapper: FakeSwapper) -> tuple[bool, AgentState]:
    state = AgentState(swapper=swapper)
    # The pinned handle only needs to name its program here: live_policy_pinned is mocked.
    return agent._inherit(interfaces, state=state, pinned={pid: pid for pid in pinned}), state  # type: ignore[arg-type]


def test_a_predecessor_without_policy_does_not_hide_another_interfaces_policy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """eth0 keeps an old agent's program that never got a policy; eth1 the last agent's, enforcing
    one. The attach replaces both: carrying nothing over would open eth1."""
    node(monkeypatch, on={"eth0": 10, "eth1": 20}, policies={10: None, 20: ["meta", "deny-rule"]})
    swapper = FakeSwapper()
    ok, state = carried(["eth0", "eth1"], pinned=[10, 20], swapper=swapper)
    assert ok and swapper.live == ["meta", "deny-rule"]
    assert state.policy_version == agent.INHERITED


def test_a_predecessor_too_large_for_our_maps_does_not_hide_another_interfaces_policy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    node(monkeypatch, on={"eth0": 30, "eth1": 20}, policies={30: ["r"] * 5, 20: ["meta", "deny-rule"]})
    swapper = FakeSwapper(max_records=3)
    ok, _ = carried(["eth0", "eth1"], pinned=[20, 30], swapper=swapper)
    assert ok and swapper.live == ["meta", "deny-rule"]


def test_the_newest_predecessors_policy_is_carried_over_whatever_the_interface_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A program kept on an interface a later agent no longer attached to enforces an older policy."""
    node(monkeypatch, on={"bond0": 10, "eth0": 20}, policies={10: ["older"], 20: ["newer"]})
    swapper = FakeSwapper()
    ok, _ = carried(["bond0", "eth0"], pinned=[10, 20], swapper=swapper)
    assert ok and swapper.live == ["newer"]


def test_a_document_that_arrived_meanwhile_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    node(monkeypatch, on={"eth0": 20}, policies={20: ["meta"]})
    swapper = FakeSwapper()
    swapper.live = ["from a document"]
    ok, state = carried(["eth0"], pinned=[20], swapper=swapper)
    assert not ok and swapper.live == ["from a document"] and state.policy_version == ""


def test_a_foreign_program_is_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xdp, "attached_program", lambda ifname: {"mode": 1, "prog": {"id": 99, "name": "other"}})

    def must_not_read(*_: object) -> None:
        raise AssertionError("read a foreign program's maps")

    monkeypatch.setattr(inherit, "live_policy_pinned", must_not_read)
    monkeypatch.setattr(inherit, "live_policy", must_not_read)
    ok, _ = carried(["eth0"], pinned=[20], swapper=FakeSwapper())
    assert not ok
