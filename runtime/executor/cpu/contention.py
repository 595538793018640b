"""The CPU forward's thread count, kept to the cores other processes leave it.

torch splits a CPU op over an OpenMP team whose threads meet at the end of every op, thousands of
times a forward. When another process keeps one of the same cores busy, a member of the team is
often descheduled, and its peers wait at the barrier (spinning, then sleeping) until the kernel
runs it again: a decode step then takes many times its quiet time, where one thread fewer would
only lose that core's share. `ThreadGovernor.check`, called before each CPU forward and acting at
most every INTERVAL_S, reads how much CPU time the whole machine spent idle and this process spent
working since its last look (/proc/stat, /proc/self/stat), and sizes the team to the cores those
add up to: what other processes left this one, at least one thread and at most the count the
runner started with. A team's size can move float32 and fp16 results in their last bits (some of
torch's kernels split a reduction by thread; int4's do not), as a batch's composition does, so
--enable-deterministic-inference keeps the count it started with (tests/test_cpu_threads.py).
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5  # how often the machine's load is read (two small /proc reads)
SLACK = 0.35  # a core counts as free when this much of it is: background noise keeps a thread
CONFIRM = 2  # consecutive readings that must agree before the team changes size
OFF_ENV = "RADIXLM_THREAD_GOVERNOR"


class ThreadGovernor:
    """Sizes torch's thread team to the cores left free. Call `check` on the thread that runs the
    forward (the compute thread): torch.set_num_threads applies to the team that thread starts."""

    def __init__(self, threads: int):
        self.max_threads = threads
        self.threads = threads
        self._tick = os.sysconf("SC_CLK_TCK")
        self._last = _read()
        self._at = time.monotonic()
        self._want: int | None = None
        self._seen = 0

    @classmethod
    def for_this_machine(cls) -> ThreadGovernor | None:
        """A governor when there is a team to size and /proc tells the machine's load (Linux), else
        None; `RADIXLM_THREAD_GOVERNOR=off` keeps the count torch started with (for comparisons)."""
        threads = torch.get_num_threads()
        if threads < 2 or os.environ.get(OFF_ENV, "").lower() in ("0", "off") or _read() is None:
            return None
        return cls(threads)

    def check(self) -> None:
        now = time.monotonic()
        if now - self._at < INTERVAL_S:
            return
        reading = _read()
        if reading is None or self._last is None:
            return
        (idle0, ours0), (idle1, ours1) = self._last, reading
        ticks = (now - self._at) * self._tick
        self._last, self._at = reading, now
        free = ((idle1 - idle0) + (ours1 - ours0)) / ticks  # cores idle or ours over the interval
        want = max(1, min(self.max_threads, int(free + SLACK)))
        self._seen = self._seen + 1 if want == self._want else 1
        self._want = want
        if want != self.threads and self._seen >= CONFIRM:
            logger.info("CPU threads %d -> %d (%.1f of the machine's cores idle or ours over %.1f s)",
                        self.threads, want, free, ticks / self._tick)
            torch.set_num_threads(want)
            self.threads = want


def _read() -> tuple[int, int] | None:
    """(the machine's idle + iowait ticks, this process's user + system ticks), or None off Linux."""
    try:
        with open("/proc/stat", "rb") as f:
            cpu = f.readline().split()
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    if not cpu or cpu[0] != b"cpu" or len(cpu) < 6:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # past the command name, which may hold spaces
    return int(cpu[4]) + int(cpu[5]), int(fields[11]) + int(fields[12])
