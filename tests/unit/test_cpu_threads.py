"""ThreadGovernor: fewer torch threads while other processes keep cores busy."""

from __future__ import annotations

import pytest

from pagedserve.worker.cpu_threads import ThreadGovernor, read_machine_busy_s


class FakeCpu:
    def __init__(self) -> None:
        self.now = 0.0
        self.machine = 0.0
        self.own = 0.0

    def advance(self, seconds: float, other_cores: float, own_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.machine += (other_cores + own_cores) * seconds


def governor(cpu: FakeCpu, applied: list[int]) -> ThreadGovernor:
    return ThreadGovernor(
        2,
        applied.append,
        interval_s=1.0,
        machine_busy=lambda: cpu.machine,
        own_busy=lambda: cpu.own,
        clock=lambda: cpu.now,
        num_cores=2,
    )


def test_a_busy_core_takes_a_thread_after_two_agreeing_readings_and_gives_it_back():
    cpu, applied = FakeCpu(), []
    g = governor(cpu, applied)
    assert g.tick() == 2  # baseline
    cpu.advance(1.0, other_cores=0.4, own_cores=1.6)  # our own frontend-sized load: keep 2
    assert g.tick() == 2 and applied == []
    cpu.advance(1.0, other_cores=1.0, own_cores=1.0)
    assert g.tick() == 2 and g.other_load == pytest.approx(1.0)  # one reading: proposal
    cpu.advance(0.5, other_cores=1.0, own_cores=1.0)
    assert g.tick() == 2  # within the interval: no reading
    cpu.advance(1.0, other_cores=1.0, own_cores=1.0)
    assert g.tick() == 1 and applied == [1]
    cpu.advance(1.0, other_cores=0.0, own_cores=1.0)
    assert g.tick() == 1
    cpu.advance(1.0, other_cores=0.1, own_cores=1.0)
    assert g.tick() == 2 and applied == [1, 2]


def test_a_single_burst_changes_nothing():
    cpu, applied = FakeCpu(), []
    g = governor(cpu, applied)
    g.tick()
    for other in (1.5, 0.0, 1.5, 0.0):
        cpu.advance(1.0, other_cores=other, own_cores=0.5)
        g.tick()
    assert applied == [] and g.threads == 2


def test_never_below_one_thread_and_proc_stat_reads():
    cpu, applied = FakeCpu(), []
    g = governor(cpu, applied)
    g.tick()
    for _ in range(2):
        cpu.advance(1.0, other_cores=8.0, own_cores=0.1)
        g.tick()
    assert applied == [1]
    busy = read_machine_busy_s()
    assert busy is None or busy > 0
    with pytest.raises(ValueError):
        ThreadGovernor(0, applied.append)
