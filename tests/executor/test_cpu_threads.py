"""The CPU executor's thread governor: thread counts from other processes' measured load."""

from __future__ import annotations

import os

import pytest

from services.executor import cpu_threads
from services.executor.cpu_threads import CpuSample, CpuThreadGovernor, read_proc_sample

TICKS = os.sysconf("SC_CLK_TCK")


class FakeProc:
    """Cumulative tick counters advanced by the test; time advances by 1 s per read."""

    def __init__(self) -> None:
        self.busy = self.own = 0
        self.wall = 1000.0

    def run(self, own_cores: float, other_cores: float) -> None:  # one second of load
        self.own += round(own_cores * TICKS)
        self.busy += round((own_cores + other_cores) * TICKS)

    def read(self, cpus: frozenset[int]) -> CpuSample:
        return CpuSample(self.busy, self.own, self.wall)


@pytest.fixture
def fake(monkeypatch):
    proc = FakeProc()
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: proc.wall)
    return proc


def _governor(proc: FakeProc, max_threads: int, ncpu: int) -> tuple[CpuThreadGovernor, list[int]]:
    applied: list[int] = []
    gov = CpuThreadGovernor(max_threads, interval_s=0.5, cpus=frozenset(range(ncpu)),
                            read_sample=proc.read, set_threads=applied.append)
    return gov, applied


def test_threads_follow_the_cores_other_processes_use(fake):
    gov, applied = _governor(fake, max_threads=2, ncpu=2)
    assert applied == [2] and gov.threads == 2
    steps = [  # (our cores, other processes' cores) over the last second -> thread count
        (2.0, 0.0, 2),  # quiet: our own spinning threads never count against us
        (1.4, 0.6, 1),  # another process got 0.6 of a core -> give it one
        (1.0, 1.0, 1),  # it keeps a whole core
        (1.0, 0.4, 1),  # hysteresis: 0.4 of a core would keep 2 threads, but does not bring one back
        (1.0, 0.25, 2),  # it went (mostly) away: our other services' quarter core is tolerated
        (2.0, 0.4, 2),
        (2.0, 0.49, 2),
        (1.45, 0.55, 1),  # more than half a core costs a thread
        (1.0, 0.0, 2),
    ]
    for own, others, expected in steps:
        fake.wall += 1.0
        fake.run(own, others)
        assert gov.before_step() == expected, (own, others)
        assert gov.others_cores == pytest.approx(others, abs=2 / TICKS)
    assert applied == [2, 1, 2, 1, 2]  # set only when the count changes


def test_many_cores_and_limits(fake):
    gov, applied = _governor(fake, max_threads=8, ncpu=16)
    fake.wall += 1.0
    fake.run(8.0, 6.0)  # 16 - 6 = 10 cores free: capped at the configured 8
    assert gov.before_step() == 8
    fake.wall += 1.0
    fake.run(8.0, 11.2)  # 4.8 free -> 5
    assert gov.before_step() == 5
    fake.wall += 1.0
    fake.run(5.0, 10.4)  # 5.6 free: 6 on the way down, but up by hysteresis only at 5.7+
    assert gov.before_step() == 5
    fake.wall += 1.0
    fake.run(5.0, 9.2)  # 6.8 free -> 7
    assert gov.before_step() == 7
    fake.wall += 1.0
    fake.run(1.0, 40.0)  # more load than cores (other cpus' time): never below 1
    assert gov.before_step() == 1
    assert applied == [8, 5, 7, 1]


def test_decisions_wait_for_the_interval(fake):
    gov, applied = _governor(fake, max_threads=2, ncpu=2)
    fake.wall += 0.2
    fake.run(0.2, 1.0)
    assert gov.before_step() == 2  # 0.2 s < interval: no new sample taken
    fake.wall += 0.4
    assert gov.before_step() == 1  # 0.6 s: measured over the whole 0.6 s
    assert gov.others_cores == pytest.approx(1.0 / 0.6, rel=0.05)


def test_unreadable_proc_keeps_the_configured_threads(fake):
    applied: list[int] = []
    gov = CpuThreadGovernor(2, cpus=frozenset({0, 1}), read_sample=lambda cpus: None, set_threads=applied.append)
    fake.wall += 5
    assert gov.before_step() == 2 and applied == [2]
    with pytest.raises(ValueError, match="max_threads"):
        CpuThreadGovernor(0)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")
def test_read_proc_sample_counts_our_own_cpu_time():
    cpus = frozenset(os.sched_getaffinity(0))
    first = read_proc_sample(cpus)
    x = 0
    for i in range(3_000_000):  # ~0.2 s of CPU in this process
        x += i
    second = read_proc_sample(cpus)
    assert first is not None and second is not None
    own = second.own_ticks - first.own_ticks
    assert own >= 1
    assert second.busy_ticks - first.busy_ticks >= own - 2  # our time is part of the cores' busy time
    assert read_proc_sample(frozenset({10_000})).busy_ticks == 0  # no such core
