"""What a background checkpoint really costs the training loop.

A forked writer is not free for the parent: every page of parameters and optimizer state the next
optimizer step writes is copied on first write (copy-on-write faults, ~0.7 ms per MB here), and the
child competes for cores, memory bandwidth and the disk while it serializes, checksums and fsyncs.
None of that shows in the main thread's fork time; measured side by side it is 20x the fork.

A writer thread's cost depends on the training: its serialization holds the interpreter lock
that the training loop's Python needs, while its checksum and writes run on another core, free
or not. So the cost is measured where it lands: an epoch during which a writer was alive
("shadowed") is compared with the lower quartile of clean epochs (no writer alive at any point),
and the difference is charged to checkpointing. Whole epochs, validation included, so slowdowns
spread over many batches count as much as the copy-on-write spike of the first one.

A machine can also slow down as a whole, mid-run (here: epochs moving from ~0.10 s to ~0.14 s for
the rest of a fit, with or without a writer). A quartile of the last 32 clean epochs would hold
the earlier speed for a dozen more clean epochs and charge the move to every checkpoint in
between (27-59 ms each on 0.1 s epochs), pricing checkpoints 3-5x too high; so the baseline
follows once the last few clean epochs are all slower than it.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque

#: Clean epochs in a row, all slower than the clean epochs' lower quartile, that move the
#: baseline to the fastest of them: the machine has slowed as a whole.
FOLLOW_AFTER = 3


class InterferenceMeter:
    """Charges shadowed epochs' excess over clean epochs (lower quartile) to checkpointing.

    Noise averages out: the excess is summed with its sign (a shadowed epoch that happened to run
    fast refunds), and only the running total is kept non-negative. Shadowed epochs seen before any
    clean one wait until a baseline exists.

    Args:
        window: how many recent clean epochs form the baseline.

    Example::

        meter = InterferenceMeter()
        meter.observe(10.0, shadowed=False)
        meter.observe(10.6, shadowed=True)
        meter.take()  # 0.6 seconds charged to the writer
    """

    def __init__(self, window: int = 32) -> None:
        self._clean: deque[float] = deque(maxlen=window)
        self._waiting: list[float] = []
        self._charged = 0.0

    @property
    def baseline(self) -> float | None:
        """The lower quartile of clean epochs: noise (and after-effects of a writer that has just
        exited) only ever slows an epoch down, so a low quantile is the fairer "no writer" time,
        and erring low over-charges checkpoints rather than exceeding the budget. Unless the last
        :data:`FOLLOW_AFTER` clean epochs were all slower: then the machine has slowed as a whole
        and the fastest of them is the baseline (one slow clean epoch among fast ones is noise
        and moves nothing; a machine that speeds up lowers the quartile by itself)."""
        if not self._clean:
            return None
        if len(self._clean) < 4:
            return min(self._clean)
        quartile = statistics.quantiles(self._clean, n=4)[0]
        recent = min(itertools.islice(reversed(self._clean), FOLLOW_AFTER))
        return max(quartile, recent)

    @property
    def settled(self) -> bool:
        """Enough clean epochs that the baseline is their lower quartile, not one noisy epoch."""
        return len(self._clean) >= 4

    def observe(self, epoch_seconds: float, *, shadowed: bool, warmup: bool = False) -> None:
        """One epoch's compute time. ``warmup`` epochs (the fit's first, which allocates state
        and warms caches) never form the baseline."""
        if shadowed:
            self._waiting.append(epoch_seconds)
        elif not warmup:
            self._clean.append(epoch_seconds)

    def take(self) -> float:
        """Seconds to charge now (negative: a refund of earlier over-charging, never below 0)."""
        base = self.baseline
        if base is None or not self._waiting:
            return 0.0
        excess = sum(t - base for t in self._waiting)
        self._waiting.clear()
        charge = max(excess, -self._charged)
        self._charged += charge
        return charge
