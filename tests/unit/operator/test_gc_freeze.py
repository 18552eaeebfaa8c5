"""sparsegate.gc_freeze: the long-lived heap kept out of full garbage collections."""

from __future__ import annotations

import gc
import weakref

import pytest

from sparsegate import cli, gc_freeze


def test_schedule_freezes_every_interval_and_refreshes_less_often() -> None:
    s = gc_freeze.FreezeSchedule(freeze_s=30, refresh_s=100, now=0)
    assert [s.due(t) for t in (10, 30, 31, 60, 95)] == [None, "freeze", None, "freeze", "freeze"]
    assert s.due(100) == "refresh"  # and both timers restart from it
    assert [s.due(t) for t in (110, 130, 200)] == [None, "freeze", "refresh"]


@pytest.mark.parametrize("freeze_s, refresh_s", [(0, 600), (-1, 600), (60, 30), (float("nan"), 600), (60, float("nan"))])
def test_schedule_refuses_intervals_that_cannot_work(freeze_s: float, refresh_s: float) -> None:
    with pytest.raises(ValueError):
        gc_freeze.FreezeSchedule(freeze_s=freeze_s, refresh_s=refresh_s, now=0)


def test_freeze_keeps_objects_out_of_collections_and_refresh_reclaims_frozen_cycles() -> None:
    try:
        gc.collect()
        gc_freeze.act("freeze")
        assert gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        gc.collect()
        assert gc.get_freeze_count() == frozen  # a full collection left them alone

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle, alive while frozen
        alive = weakref.ref(a)
        gc_freeze.act("freeze")
        del a, b
        gc.collect()
        assert alive() is not None  # frozen when it died: full collections do not find it
        gc_freeze.act("refresh")
        assert alive() is None  # the refresh's collection reclaimed it
        assert gc_freeze.FROZEN._value.get() == gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_run_flags_default_on_and_refuse_a_refresh_shorter_than_the_freeze() -> None:
    parse = cli._parser().parse_args
    assert cli.gc_freeze_intervals(parse(["run"])) == (30.0, 600.0)
    assert cli.gc_freeze_intervals(parse(["run", "--gc-freeze-interval", "0"])) == (0.0, 600.0)
    with pytest.raises(ValueError, match="--gc-refresh-interval"):
        cli.gc_freeze_intervals(parse(["run", "--gc-freeze-interval", "60", "--gc-refresh-interval", "30"]))
    with pytest.raises(ValueError, match="--gc-freeze-interval"):
        cli.gc_freeze_intervals(parse(["run", "--gc-freeze-interval", "-1"]))


def test_off_starts_nothing() -> None:
    assert gc_freeze.start(freeze_s=0, refresh_s=600) is None


def test_young_threshold_sets_generation_0_only_and_refuses_below_1() -> None:
    before = gc.get_threshold()
    try:
        gc_freeze.set_young_threshold(50_000)
        assert gc.get_threshold() == (50_000, *before[1:])
        with pytest.raises(ValueError, match="at least 1"):
            gc_freeze.set_young_threshold(0)
        assert gc.get_threshold() == (50_000, *before[1:])  # a refused value changes nothing
    finally:
        gc.set_threshold(*before)
