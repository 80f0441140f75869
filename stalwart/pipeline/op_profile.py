"""Per-step time breakdown of one worker by kind of instruction (``PipelineJob.profile``).

Each :meth:`OpProfile.tick` charges the CPU, wall and run-queue seconds since the previous tick
to a name (an :class:`~stalwart.pipeline.schedule.Op` value, or a phase such as ``"Commit"``).
Wall minus CPU minus run-queue time is time the thread was blocked: waiting for a message in a
receive, or for the GIL in a compute op. ``benchmarks/pipeline_overhead.py`` prints it.

Example:
    >>> profile = OpProfile(run_queue=False)
    >>> profile.restart(); profile.tick("Forward")
    >>> sorted(profile.entries)
    ['Forward']
"""

from __future__ import annotations

import time

from stalwart.pipeline.threadclock import ThreadClock


class OpProfile:
    """``{name: [cpu_s, wall_s, count, run_queue_s]}`` of the calling thread for one step.

    Args:
        run_queue: also read the thread's run-queue time (a system call per tick: only worth
            it when the profile is published).
    """

    def __init__(self, run_queue: bool) -> None:
        self._runq = ThreadClock(enabled=run_queue)
        self.entries: dict[str, list] = {}
        self._start = self._now()

    def _now(self) -> tuple[float, float, float]:
        return time.perf_counter(), time.thread_time(), self._runq.read()[1]

    def reset(self) -> None:
        """Forget the entries (a new step)."""
        self.entries = {}

    def restart(self) -> None:
        """Start timing from now (time before this is charged to nothing)."""
        self._start = self._now()

    def tick(self, name: str) -> None:
        """Charge the time since the last tick (or restart) to ``name``."""
        wall0, cpu0, runq0 = self._start
        now = self._now()
        entry = self.entries.setdefault(name, [0.0, 0.0, 0, 0.0])
        entry[0] += now[1] - cpu0
        entry[1] += now[0] - wall0
        entry[2] += 1
        entry[3] += now[2] - runq0
        self._start = now

    def add(self, name: str, values: list) -> None:
        """Add time measured elsewhere (the idle FRC thread's own clock) to ``name``."""
        entry = self.entries.setdefault(name, [0.0, 0.0, 0, 0.0])
        for i, value in enumerate(values):
            entry[i] += value
