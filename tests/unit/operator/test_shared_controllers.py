"""One rollout controller and one access controller for the whole operator: built at startup in
the operator's memo, which Kopf copies into each object's memo (``sparsegate.memo``: copies that
read through to it; with Kopf's own Memo, shallow copies), so every GateConfig's and every model's
loop shares them; each model's FleetCache stays its own."""

from __future__ import annotations

import copy

import kopf
import pytest

from sparsegate import main
from sparsegate.clients.kube import Kube
from sparsegate.handlers import accesssync, gateconfig
from sparsegate.memo import OperatorMemo


@pytest.mark.parametrize("memo_type", [OperatorMemo, kopf.Memo])
def test_startup_builds_one_controller_each_shared_by_every_objects_memo(
        monkeypatch: pytest.MonkeyPatch, memo_type: type[kopf.Memo]) -> None:
    kube = object.__new__(Kube)  # no cluster: the controllers only keep the client
    monkeypatch.setattr(Kube, "from_environment", classmethod(lambda cls: kube))
    operator_memo = memo_type()
    main.configure(settings=kopf.OperatorSettings(), memo=operator_memo)
    first, second = copy.copy(operator_memo), copy.copy(operator_memo)  # as Kopf makes per-object memos

    assert gateconfig._loop(first) is gateconfig._loop(second) is operator_memo.rollout_loop
    assert operator_memo.rollout_loop.kube is kube
    assert accesssync._sync(first) is accesssync._sync(second) is operator_memo.access_sync
    assert first.access_cache is not second.access_cache  # per model
    assert getattr(operator_memo, "access_cache", None) is None


def test_a_memo_without_startup_still_gets_its_controllers() -> None:
    memo = kopf.Memo()
    memo.kube = object.__new__(Kube)
    assert gateconfig._loop(memo) is gateconfig._loop(memo)
    assert accesssync._sync(memo) is accesssync._sync(memo) and memo.access_cache is not None


def test_startup_keeps_one_applied_objects_record_with_the_run_flags_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Kube, "from_environment", classmethod(lambda cls: object.__new__(Kube)))
    for memo, interval in ((OperatorMemo(reapply_interval_s=30.0), 30.0), (OperatorMemo(), 3600.0)):
        main.configure(settings=kopf.OperatorSettings(), memo=memo)
        assert memo.applied_objects.interval_s == interval
        assert copy.copy(memo).applied_objects is memo.applied_objects  # shared by every model's handler
