"""Adapting the CPU executor's intra-op thread count to the cores other processes leave free.

torch's CPU kernels (and oneDNN's) run on an OpenMP team of ``torch.get_num_threads()``
threads that spin-wait at the end of every parallel region. When another process needs one
of those cores, the team's threads are descheduled in turn and each of the few hundred
parallel regions of a decode step waits a scheduler time slice: on a 2-core machine with one
busy process beside it, single-stream decode with 2 threads falls to a third of its speed,
while 1 thread keeps two thirds (``benchmarks/single_stream.py``; benchmarks/RESULTS.md, "Figures moved out of the code").
A passive wait policy (``OMP_WAIT_POLICY=PASSIVE``) avoids the collapse but costs a third of
the quiet-machine speed, and libgomp reads it only at start-up.

:class:`CpuThreadGovernor` therefore measures, between steps, how much CPU time other
processes used on this process's allowed cores (``/proc/stat`` minus ``/proc/self/stat``)
and sets the thread count to the cores left free, between 1 and the configured maximum.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU times, in clock ticks (``os.sysconf('SC_CLK_TCK')`` per second)."""

    busy_ticks: int  # non-idle time of the allowed cores, every process together
    own_ticks: int  # user + system time of this process (all its threads)
    wall_s: float  # time.monotonic() when read


def read_proc_sample(cpus: frozenset[int]) -> CpuSample | None:
    """Read ``/proc/stat`` (per-core lines of ``cpus``) and ``/proc/self/stat``; ``None``
    where they are not available (not Linux) or cannot be parsed."""
    try:
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if int(name[3:]) not in cpus:
                    continue
                ticks = [int(x) for x in fields[:7]]  # user nice system idle iowait irq softirq
                busy += sum(ticks) - ticks[3] - ticks[4]  # not steal: fewer threads would not win it back
        with open("/proc/self/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd on (comm may hold spaces)
        own = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    except (OSError, ValueError, IndexError):
        return None
    return CpuSample(busy, own, time.monotonic())


class CpuThreadGovernor:
    """Chooses ``torch.set_num_threads`` from the load of other processes.

    Call :meth:`before_step` on the thread that runs the model, before each step. At most
    every ``interval_s`` it compares two samples: ``others = (busy - own) / elapsed`` in
    cores, and the thread count becomes ``floor(len(cpus) - others + 0.5)`` clamped to
    ``[1, max_threads]`` (more than half a core used by others costs one thread; it comes back
    below ``0.5 - up_margin``). VM steal time is not counted. The busy
    time of our own spinning threads is ``own`` and never counts against us.

    Args:
        max_threads: the thread count on a quiet machine (``torch.get_num_threads()`` or the
            ``cpu_threads`` setting).
        interval_s: seconds between two decisions.
        up_margin: hysteresis in cores: a thread comes back only when others use less than
            ``0.5 - up_margin`` of the core it needs (it goes at more than 0.5).
        read_sample: the sampler (tests pass a fake).
        set_threads: applies a thread count (default ``torch.set_num_threads``).
    """

    def __init__(
        self,
        max_threads: int,
        interval_s: float = 0.5,
        up_margin: float = 0.2,
        cpus: frozenset[int] | None = None,
        read_sample: Callable[[frozenset[int]], CpuSample | None] = read_proc_sample,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.up_margin = up_margin
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self._read = read_sample
        self._set = set_threads
        self._ticks_per_s = os.sysconf("SC_CLK_TCK")
        self.threads = max_threads
        self.others_cores = 0.0  # last measured load of other processes, in cores
        self._last = read_sample(self.cpus)
        self._set(self.threads)

    def before_step(self) -> int:
        """Re-measure if ``interval_s`` has passed and apply the thread count; returns it."""
        if self._last is None or time.monotonic() - self._last.wall_s < self.interval_s:
            return self.threads
        now = self._read(self.cpus)
        if now is None:
            return self.threads
        elapsed = now.wall_s - self._last.wall_s
        others_ticks = (now.busy_ticks - self._last.busy_ticks) - (now.own_ticks - self._last.own_ticks)
        self._last = now
        self.others_cores = max(0.0, others_ticks / self._ticks_per_s / elapsed)
        free = len(self.cpus) - self.others_cores
        threads = max(1, min(self.max_threads, math.floor(free + 0.5)))
        if threads > self.threads:  # hysteresis: take a core back only once it is clearly free
            threads = max(self.threads, min(threads, math.floor(free + 0.5 - self.up_margin)))
        if threads != self.threads:
            log.info("cpu_threads_changed", threads=threads, previous=self.threads,
                     other_processes_cores=round(self.others_cores, 2))
            self.threads = threads
            self._set(threads)
        return self.threads
