"""Per-thread scheduler clocks: how long a thread ran, and how long it waited for a core.

Linux's ``/proc/<tid>/schedstat`` holds, for one thread, the nanoseconds it ran, the nanoseconds
it was runnable but waited on a run queue, and how many times it was scheduled in. With the wall
time of an interval, the rest of the interval is time the thread was *blocked* (asleep on a
lock, a socket or a condition) — for a compute op of a pipeline stage that is waiting for the
GIL, which is how the overhead benchmark tells a GIL stall from CPU contention. Reading another
thread's file gives the CPU time of threads Python cannot time itself (torch's native pool
threads that run eager FRC).

Example:
    >>> clock = ThreadClock()
    >>> before = clock.read()
    >>> ran, waited = (b - a for a, b in zip(before, clock.read()))  # seconds
"""

from __future__ import annotations

import contextlib
import os


class ThreadClock:
    """Seconds a thread has run and waited on a run queue, as ``(run, wait)``; ``(0.0, 0.0)``
    where the OS has no schedstat.

    Args:
        tid: native thread id; default: the thread that creates the clock (the file
            descriptor stays bound to that thread).
        enabled: False makes a clock that reads ``(0.0, 0.0)`` without a system call (for hot
            paths that only need the numbers when profiling).
    """

    def __init__(self, tid: int | None = None, *, enabled: bool = True) -> None:
        path = "/proc/thread-self/schedstat" if tid is None else f"/proc/self/task/{tid}/schedstat"
        self._fd: int | None = None
        if not enabled:
            return
        with contextlib.suppress(OSError):  # no schedstat on this OS: reads give (0.0, 0.0)
            self._fd = os.open(path, os.O_RDONLY)

    def read(self) -> tuple[float, float]:
        if self._fd is None:
            return 0.0, 0.0
        run, wait = os.pread(self._fd, 128, 0).split()[:2]
        return int(run) * 1e-9, int(wait) * 1e-9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
