"""The flow table's clock: kernel jiffies, turned into seconds for the exporter.

The XDP program stamps each flow's first and last packet with ``bpf_jiffies64``, which the
verifier inlines into a memory load; ``bpf_ktime_get_coarse_ns`` (the same one-tick resolution)
is a helper call, about 6 ns of a packet's ~40 ns here. Userspace cannot read jiffies directly, so
the program's object carries ``sg_clock``, a function that is never attached: run with
BPF_PROG_TEST_RUN it samples jiffies and CLOCK_MONOTONIC side by side. Each scrape reads "now" in
jiffies from it (one syscall), and the tick rate (CONFIG_HZ, which the running kernel does not
reliably expose) is measured once from two samples.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from .maps import ClockSample
from .testrun import run_xdp

FUNCTION = "sg_clock"
TABLE = "clock_sample"
# CONFIG_HZ choices of x86-64 and arm64 kernels (kernel/Kconfig.hz).
HZ_CHOICES = (100, 250, 300, 1000)
_FRAME = bytes(64)  # sg_clock reads no packet data
_SNAP_TOLERANCE = 0.15  # a measured rate within 15 % of a choice is that choice


def snap_hz(ticks: int, seconds: float) -> int:
    """The CONFIG_HZ choice nearest to ``ticks / seconds``; the rate itself (rounded) when no
    choice is within 15 % of it (another architecture's HZ)."""
    if seconds <= 0 or ticks <= 0:
        raise ValueError(f"cannot measure a tick rate from {ticks} ticks in {seconds} s")
    rate = ticks / seconds
    best = min(HZ_CHOICES, key=lambda hz: abs(rate - hz) / hz)
    return best if abs(rate - best) / best <= _SNAP_TOLERANCE else round(rate)


class FlowClock:
    """Reads the kernel's jiffies through a loaded ``sg_clock`` program and its sample map."""

    def __init__(self, *, prog_fd: int, table: Any, measure_s: float = 0.1) -> None:
        self._fd, self._table, self._measure_s = prog_fd, table, measure_s
        self._lock = threading.Lock()
        self._hz: int | None = None

    def sample(self) -> ClockSample:
        with self._lock:  # run and read as one step: a concurrent scrape's run would overwrite
            run_xdp(prog_fd=self._fd, data=_FRAME)
            return ClockSample.from_buffer_copy(self._table[self._table.Key(0)])

    @property
    def hz(self) -> int:
        """Ticks per second, measured at the first use (``measure_s`` of wall time, once)."""
        if self._hz is None:
            first = self.sample()
            time.sleep(self._measure_s)
            last = self.sample()
            self._hz = snap_hz(last.jiffies - first.jiffies, (last.mono_ns - first.mono_ns) / 1e9)
        return self._hz

    def seconds(self, jiffies: int) -> float:
        """A span of ``jiffies`` ticks in seconds."""
        return jiffies / self.hz
