"""Torch thread count that follows the CPU left to the worker when it shares the machine.

A CPU decode step is hundreds of short parallel regions (one per matmul, norm, attention
call), each ending in a barrier. With T torch threads on T cores and another process busy
on one of them, the thread that shares that core gets a time slice only every few
milliseconds, so every barrier waits for it: the step slows by far more than the share of
CPU lost (measured on 2 cores: 11x slower with one core busy). With one thread fewer, the
step runs on the cores that are free and slows in proportion to the compute lost.

:class:`ThreadGovernor` measures, every ``interval_s``, the CPU the rest of the machine
used (``/proc/stat`` busy time minus this process's own, from ``os.times``), and sets
``torch.set_num_threads`` to the cores left (at least 1, at most the configured count).
A change needs two consecutive readings that agree (no flapping on a burst). Where
``/proc/stat`` is unreadable it leaves the count alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# Cores' worth of other processes' CPU that takes a core away from the worker. Below one:
# a core busy most of the time stalls every barrier; above a half: the serving cluster's
# own frontend and scheduler (~0.3-0.5 core at full speed on 2 cores) leave the count alone.
TAKEN_CORE_LOAD = 0.6


def read_machine_busy_s() -> float | None:
    """CPU seconds all cores spent busy since boot (``/proc/stat`` first line: everything
    but idle and iowait), or None where unavailable."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 6:
        return None
    ticks = [int(x) for x in fields[1:]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # idle, iowait
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return busy / hz


def read_own_busy_s() -> float:
    """CPU seconds this process (all its threads) used."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Adapts the torch thread count to the CPU left free by other processes.

    Args:
        max_threads: the configured thread count (>= 1): never more.
        num_cores: cores this process may run on (default: its CPU affinity).
        set_threads: applies a count (``torch.set_num_threads``).
        interval_s: seconds between readings.
        machine_busy: CPU-seconds of the whole machine (injectable for tests).
        own_busy: CPU-seconds of this process (injectable for tests).
        clock: monotonic seconds (injectable for tests).

    Raises:
        ValueError: ``max_threads < 1`` or ``interval_s <= 0``.
    """

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None],
        interval_s: float = 1.0,
        machine_busy: Callable[[], float | None] = read_machine_busy_s,
        own_busy: Callable[[], float] = read_own_busy_s,
        clock: Callable[[], float] = time.monotonic,
        num_cores: int | None = None,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.max_threads = max_threads
        if num_cores is None:
            num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self.num_cores = max(1, num_cores)
        self.threads = max_threads
        self._set = set_threads
        self._interval = interval_s
        self._machine_busy = machine_busy
        self._own_busy = own_busy
        self._clock = clock
        self._last: tuple[float, float, float] | None = None
        self._proposal: int | None = None
        self.other_load = 0.0  # cores used by other processes at the last reading

    def tick(self) -> int:
        """Call before each step: re-reads the load when ``interval_s`` passed and applies
        a new thread count when two readings agree. Returns the current count."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < self._interval:
            return self.threads
        machine = self._machine_busy()
        if machine is None:
            return self.threads
        own = self._own_busy()
        last, self._last = self._last, (now, machine, own)
        if last is None:
            return self.threads
        wall = now - last[0]
        other = max(0.0, (machine - last[1]) - (own - last[2])) / wall
        self.other_load = other
        free = self.num_cores - other + TAKEN_CORE_LOAD  # other <= 0.6 takes no core
        want = max(1, min(self.max_threads, int(free)))
        if want == self.threads:
            self._proposal = None
        elif want == self._proposal:
            self.threads = want
            self._proposal = None
            self._set(want)
        else:
            self._proposal = want
        return self.threads
