"""A stateless worker's trail: the running sum of the gradients it pushed while the PS was down.

While the PS is down a stateless worker keeps walking its own SGD trajectory and queues every
gradient in the store; the recovered PS merges the backlog as one update
(:mod:`stalwart.ps.update`). Fetching an outage's gradients one by one (~1,000 default-CNN
gradients of 304 KB: 0.35-0.42 s on the 2-core machine) held back the merged weights while
checkpoint-async had already published its checkpoint, and let the workers pile up more lag on
the old weights. So once a worker has taken :data:`TRAIL_AFTER` local steps without seeing a
commit it also keeps the float32 running sum of its gradients from then on and writes it to the
store (``trail/W``); the PS reads one vector per worker instead. The audit record lists which of
its ids came as a trail, and :func:`stalwart.ps.update.gradient_sum_with_trails` sums them the
same way, so the replay stays bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from stalwart.ps import layout
from stalwart.ps.store import KeyValueStore
from stalwart.ps.wire import pack, unpack_header, vector_view

#: Local steps without a new commit after which a stateless worker starts its trail: well past
#: the few gradients an ordinary asynchronous update lags by, so only a PS that stopped
#: committing (an outage) makes workers pay for writing it.
TRAIL_AFTER = 8
#: Gradients between two writes of a trail: the recovered PS fetches the (at most this many
#: minus one) gradients pushed after the last write one by one.
TRAIL_EVERY = 4


class WorkerTrail:
    """Worker ``index``'s trail in ``store``.

    Args:
        store: the shared store.
        index: the worker's id.

    Example:
        >>> trail = WorkerTrail(store, 0)  # doctest: +SKIP
        >>> trail.add(step, grad, local_steps)  # after each local step; reset() on a new commit
    """

    def __init__(self, store: KeyValueStore, index: int) -> None:
        self.store = store
        self.index = index
        #: The running sum of gradients ``start, ...`` (None: no trail since the last commit).
        self.total: np.ndarray | None = None
        self.start = 0

    def reset(self) -> None:
        """The PS committed new weights: what was summed is applied (or queued before them)."""
        self.total = None

    def add(self, step: int, grad: torch.Tensor, local_steps: int) -> None:
        """Add gradient ``step`` (already queued and counted) once ``local_steps`` exceeds
        :data:`TRAIL_AFTER`; write the trail every :data:`TRAIL_EVERY` gradients.

        The sum is taken exactly as :func:`stalwart.ps.update.gradient_sum` takes it (a float32
        copy of the first, then in-place adds in push order), so the PS's update from the trail
        and the audit's replay from the single gradients agree bit for bit. It is written after
        the gradients and the count it covers, so a PS that reads it finds them all queued.
        """
        if local_steps <= TRAIL_AFTER:
            return
        vector = grad.detach().contiguous().numpy()
        if self.total is None:
            self.total, self.start = vector.copy(), step
        else:
            np.add(self.total, vector, out=self.total)
        if (step + 1 - self.start) % TRAIL_EVERY == 0:
            header = {"w": self.index, "from": self.start, "to": step + 1}
            self.store.set(layout.trail(self.index), pack(header, torch.from_numpy(self.total)))


def pending_trails(
    store: KeyValueStore, cursors: list[int], counts: list[int]
) -> dict[int, tuple[int, int, bytes]]:
    """The workers' trails (``{worker: (from, to, blob)}``) that cover only gradients still
    pending (at or past ``cursors``), and ``counts`` raised to the end of each (a worker counts
    its gradients before it writes the trail that covers them, so they are all queued).

    A trail that starts before the cursor holds gradients already applied (a trail from an
    earlier outage, or a commit the worker had not seen): its gradients are fetched one by one
    instead.
    """
    found: dict[int, tuple[int, int, bytes]] = {}
    for w, cursor in enumerate(cursors):
        blob = store.get(layout.trail(w))
        if blob is None:
            continue
        header = unpack_header(blob)
        start, end = int(header["from"]), int(header["to"])
        if cursor <= start < end:
            found[w] = (start, end, blob)
            counts[w] = max(counts[w], end)
    return found


def with_trails(
    singles: Callable[[list[str]], Iterator[np.ndarray]],
    trails: dict[int, tuple[int, int, bytes]],
    cursors: list[int],
    counts: list[int],
    ids: list[list[int]],
    sums: list[list[int]],
) -> Iterator[np.ndarray]:
    """The pending gradients of every worker in queue order, a trail's as its one vector.

    ``singles`` fetches the gradients under a list of keys (and appends their ids to ``ids``);
    a trail's gradient ids are appended here, and their ``[start, end)`` span of ``ids`` to
    ``sums``, so the audit record lists them all and says which came pre-summed.
    """
    for w, (cursor, count) in enumerate(zip(cursors, counts, strict=True)):
        start, end, blob = trails.get(w, (count, count, b""))
        yield from singles([layout.gradient(w, k) for k in range(cursor, start)])
        if blob:
            sums.append([len(ids), len(ids) + end - start])
            ids.extend([w, k] for k in range(start, end))
            yield vector_view(blob)
        yield from singles([layout.gradient(w, k) for k in range(end, count)])
