"""How many threads torch runs on, re-decided while the engine runs on the CPU.

A decode step is hundreds of small ops, each split over torch's OpenMP threads. On a quiet
machine every core should work and idle threads should spin briefly between ops (the OpenMP
runtime's default; sleeping at once made steps 2.6x slower on a quiet 2-core machine). When
another process holds a core, a thread scheduled onto it stalls every op waiting for it: steps
got 2.4x slower with two threads, 1.3x with one. So the engine samples, about once a second,
how much CPU the rest of the machine uses (/proc/stat minus this process) and runs on the cores
left free, never more than it started with.

`QRUN_THREADS=N` (or OMP_NUM_THREADS) fixes the count and turns this off.
"""

from __future__ import annotations

import os
import time

import torch

# A core counts as taken by others once they use more than this share of it.
BUSY_SHARE = 0.5
INTERVAL_S = 1.0


def threads_for(max_threads: int, cores: int, others_busy_cores: float) -> int:
    """Threads to run given how many cores other processes keep busy."""
    free = cores - others_busy_cores
    return max(1, min(max_threads, int(free + (1 - BUSY_SHARE))))


def _cores_busy_s(cores: set[int]) -> float:
    """CPU seconds all processes have spent busy on `cores` since boot (/proc/stat)."""
    busy = 0
    with open("/proc/stat") as stat:
        for line in stat:
            name, *values = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
                continue
            fields = [int(v) for v in values[:8]]
            busy += sum(fields) - fields[3] - fields[4]  # less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    times = os.times()
    return times.user + times.system


class CpuThreads:
    """Adjusts torch's thread count to the cores other processes leave free (see module doc)."""

    def __init__(self) -> None:
        chosen = os.environ.get("QRUN_THREADS")
        if chosen:
            if not chosen.isdigit() or int(chosen) < 1:
                raise ValueError(f"QRUN_THREADS={chosen!r} must be a positive whole number of threads")
            torch.set_num_threads(int(chosen))
        fixed = chosen or os.environ.get("OMP_NUM_THREADS")
        self.adaptive = not fixed and os.path.exists("/proc/stat")
        self.max_threads = torch.get_num_threads()
        self.cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self._last = self._sample() if self.adaptive else None

    def _sample(self) -> tuple[float, float, float]:
        return time.monotonic(), _cores_busy_s(self.cores), _own_busy_s()

    def update(self) -> None:
        """Call between steps; re-decides at most once per INTERVAL_S."""
        if not self.adaptive or time.monotonic() - self._last[0] < INTERVAL_S:
            return
        now = self._sample()
        elapsed = now[0] - self._last[0]
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / elapsed
        self._last = now
        wanted = threads_for(self.max_threads, len(self.cores), others)
        if wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)
