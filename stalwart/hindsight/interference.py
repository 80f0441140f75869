"""What a background checkpoint really costs the training loop.

A forked writer is not free for the parent: every page of parameters and optimizer state the next
optimizer step writes is copied on first write (copy-on-write faults, ~1 ms per MB here), and the
child competes for cores, memory bandwidth and the disk. None of that shows in the main thread's
fork time, so the policy would underestimate ``M`` several-fold on CPU. This meter measures it:
training batches that ran while a writer was alive are compared with the median of batches that
ran without one, and the excess is charged to checkpointing.
"""

from __future__ import annotations

import statistics
from collections import deque


class InterferenceMeter:
    """Accumulates the excess duration of batches that overlapped background writes.

    First batches of an epoch (which also build the data iterator) and the others are baselined
    separately; until a clean first batch is seen, first batches use the others' median, which
    can only overstate the cost, never hide it.

    Args:
        window: how many recent clean batches of each kind form the baseline.

    Example::

        meter = InterferenceMeter()
        meter.observe(0.010, first=False, shadowed=False)
        meter.observe(0.030, first=False, shadowed=True)
        meter.take()  # ~0.020 seconds charged to the writer
    """

    def __init__(self, window: int = 256) -> None:
        self._clean = {True: deque(maxlen=window), False: deque(maxlen=window)}
        self._shadowed: list[tuple[float, bool]] = []

    def observe(
        self, duration: float, *, first: bool, shadowed: bool, warmup: bool = False
    ) -> None:
        """One training batch's duration. ``warmup`` batches (lazy allocation, first iterator) are
        ignored: they are neither a fair baseline nor a fair measure of interference."""
        if warmup:
            return
        if shadowed:
            self._shadowed.append((duration, first))
        else:
            self._clean[first].append(duration)

    def baseline(self, first: bool) -> float | None:
        samples = self._clean[first] or self._clean[not first]
        return statistics.median(samples) if samples else None

    def take(self) -> float:
        """Seconds of slowdown observed since the last call (never negative)."""
        excess = 0.0
        pending = []
        for duration, first in self._shadowed:
            base = self.baseline(first)
            if base is None:  # nothing to compare with yet: keep it for later
                pending.append((duration, first))
            else:
                excess += duration - base
        self._shadowed = pending
        return max(excess, 0.0)
