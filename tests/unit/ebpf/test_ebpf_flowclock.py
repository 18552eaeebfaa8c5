"""The flow table's clock: jiffies stamped by the program, read and converted by userspace."""
from __future__ import annotations

import time

import pytest

from sparsegate_ebpf import packets as P
from sparsegate_ebpf.agent import AgentState
from sparsegate_ebpf.flowclock import HZ_CHOICES, snap_hz
from sparsegate_ebpf.metrics import XdpCollector
from sparsegate_ebpf.programs import LoadedProgram
from sparsegate_ebpf.testrun import run_xdp


@pytest.mark.parametrize(("ticks", "seconds", "hz"), [
    (10, 0.1, 100), (25, 0.1, 250), (26, 0.1, 250), (24, 0.1, 250), (30, 0.1, 300), (29, 0.1, 300),
    (100, 0.1, 1000), (101, 0.1, 1000), (64, 1.0, 64),  # no Kconfig choice near: the rate itself
])
def test_a_measured_tick_rate_snaps_to_the_nearest_config_hz(ticks: int, seconds: float, hz: int) -> None:
    assert snap_hz(ticks, seconds) == hz


@pytest.mark.parametrize(("ticks", "seconds"), [(0, 0.1), (10, 0.0), (-3, 0.1)])
def test_no_rate_from_no_ticks_or_no_time(ticks: int, seconds: float) -> None:
    with pytest.raises(ValueError, match="tick rate"):
        snap_hz(ticks, seconds)


@pytest.mark.bpf
def test_the_clock_reads_jiffies_at_the_kernels_tick_rate(telemetry_prog: LoadedProgram) -> None:
    clock = telemetry_prog.clock
    assert clock.hz in HZ_CHOICES
    first = clock.sample()
    time.sleep(0.3)
    last = clock.sample()
    elapsed = (last.mono_ns - first.mono_ns) / 1e9
    assert abs((last.jiffies - first.jiffies) - elapsed * clock.hz) <= 2
    assert clock.seconds(clock.hz) == 1.0


@pytest.mark.bpf
def test_the_exporter_turns_jiffies_into_seconds(telemetry_prog: LoadedProgram) -> None:
    """A flow with packets 0.4 s apart, scraped 0.3 s after its last: duration and idle in seconds,
    within a tick or two of the wall clock."""
    frame = P.udp_frame(src="10.1.0.1", dst="10.1.0.2", sport=4000, dport=9000)
    hz = telemetry_prog.clock.hz
    run_xdp(prog_fd=telemetry_prog.prog_fd, data=frame)
    time.sleep(0.4)
    run_xdp(prog_fd=telemetry_prog.prog_fd, data=frame, repeat=2)
    time.sleep(0.3)
    state = AgentState(bpf_available=True, program=telemetry_prog, enforcement="off")
    samples = {m.name: m.samples for m in XdpCollector(state=state).collect()}
    (duration,) = samples["sparsegate_xdp_flow_duration_seconds"]
    (idle,) = samples["sparsegate_xdp_flow_idle_seconds"]
    (gap,) = samples["sparsegate_xdp_flow_mean_interarrival_seconds"]
    tick = 1 / hz
    assert abs(duration.value - 0.4) <= 2 * tick + 0.05  # sleep overshoots a little, never undershoots
    assert abs(idle.value - 0.3) <= 2 * tick + 0.05
    assert gap.value == pytest.approx(duration.value / 2)
