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


def _flow_series(metrics: dict, name: str) -> dict[str, float]:
    return {s.labels["sport"]: s.value for s in metrics[name].samples if not s.name.endswith("_created")}


@pytest.mark.bpf
def test_an_ended_flow_stops_being_exported_and_no_longer_crowds_out_an_active_one(
        telemetry_prog: LoadedProgram) -> None:
    """Ended flows stayed in the LRU table, so in the export, until evicted (under light churn: for
    ever), and being the largest they held the cap (--max-flows series by bytes): a new flow was
    not exported at all. Past --flow-idle-timeout a flow is no longer exported (still counted)."""
    big = P.udp_frame(src="10.1.0.1", dst="10.1.0.2", sport=4000, dport=9000, payload=b"x" * 1000)
    small = P.udp_frame(src="10.1.0.1", dst="10.1.0.2", sport=4001, dport=9000)
    run_xdp(prog_fd=telemetry_prog.prog_fd, data=big, repeat=5)  # ends here
    time.sleep(0.5)
    run_xdp(prog_fd=telemetry_prog.prog_fd, data=small)
    state = AgentState(bpf_available=True, program=telemetry_prog, enforcement="off")
    metrics = {m.name: m for m in XdpCollector(state=state, max_flows=1, flow_idle_timeout=0.3).collect()}
    assert _flow_series(metrics, "sparsegate_xdp_flow_packets") == {"4001": 1}
    assert metrics["sparsegate_xdp_flows_tracked"].samples[0].value == 2
    assert metrics["sparsegate_xdp_flows_idle_expired"].samples[0].value == 1
    # Its port's totals keep it; with the timeout off every flow in the table is exported again.
    assert {s.value for s in metrics["sparsegate_xdp_port_packets"].samples if s.name.endswith("_total")} == {6}
    metrics = {m.name: m for m in XdpCollector(state=state, max_flows=2, flow_idle_timeout=0).collect()}
    assert _flow_series(metrics, "sparsegate_xdp_flow_packets") == {"4000": 5, "4001": 1}
