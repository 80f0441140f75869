"""What a run did, for checking the staleness rules afterwards: every gathered row's producing
epoch and every weight version used forward and backward."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class StalenessRecord:
    """Reads and weight uses, appended by the engine from any worker thread.

    ``reads`` rows: ``(interval, epoch, layer, kind, oldest, newest, stale)`` where ``kind`` is
    ``"act"`` (forward rows of layer ``layer``) or ``"grad"`` (gradient contributions to layer
    ``layer``'s rows), ``oldest``/``newest`` are the producing epochs of what was read and
    ``stale`` how many rows (or sources) came from an epoch other than the reader's.
    ``weights`` rows: ``(interval, epoch, layer, pass, version, latest, checksum)``.

    Example:
        >>> rec = StalenessRecord()
        >>> rec.read(0, 3, 1, "act", torch.tensor([2, 3]))
        >>> rec.reads[0]
        (0, 3, 1, 'act', 2, 3, 1)
    """

    reads: list[tuple[int, int, int, str, int, int, int]] = field(default_factory=list)
    weights: list[tuple[int, int, int, str, int, int, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def read(
        self, interval: int, epoch: int, layer: int, kind: str, produced: torch.Tensor
    ) -> None:
        row = (interval, epoch, layer, kind, int(produced.min()), int(produced.max()),
               int((produced != epoch).sum()))  # fmt: skip
        with self._lock:
            self.reads.append(row)

    def weight_use(
        self,
        interval: int,
        epoch: int,
        layer: int,
        phase: str,
        version: int,
        latest: int,
        checksum: float,
    ) -> None:
        with self._lock:
            self.weights.append((interval, epoch, layer, phase, version, latest, checksum))

    def clear(self) -> None:
        with self._lock:
            self.reads.clear()
            self.weights.clear()
