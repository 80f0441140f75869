"""Capture every ``self.log`` call of a LightningModule into the hindsight store."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from stalwart.callbacks.lightning_internals import (
    current_hook,
    intercept_log,
    log_position,
    release_log,
)
from stalwart.hindsight.store import HindsightStore


class LogCapture:
    """Sees every ``pl_module.log`` call (``log_dict`` goes through it too) for a fit.

    CPU scalars are read at once, device tensors detached and read at flush (reading them at the
    call would wait for the device); all are written in one commit per
    :meth:`flush`. Sanity-check values are skipped: Lightning discards them too.

    Args:
        store: where rows go.
        run_id: the run the rows belong to.
        source: ``"record"`` or ``"replay"``.
        replay_id: tags replayed rows.
        keep: which epochs' values to keep (replay keeps only the requested ones).
        flush_every: commit from inside a ``log`` call once this many seconds have passed since
            the last commit, so that a crash loses at most that much; ``None``: only when the
            owner calls :meth:`flush`.
    """

    def __init__(
        self,
        store: HindsightStore,
        run_id: int,
        source: str,
        replay_id: str | None = None,
        keep: Callable[[int], bool] = lambda epoch: True,
        flush_every: float | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.source = source
        self.replay_id = replay_id
        self.keep = keep
        self.flush_every = flush_every
        self._flushed = time.perf_counter()
        self._pending: list[tuple] = []
        self._module: LightningModule | None = None
        #: Seconds spent capturing values inside ``log`` calls (not in Lightning's own ``log``),
        #: commits from there included, which the record charges to its overhead; the owner's
        #: own calls of :meth:`flush` it times itself.
        self.spent = 0.0

    def attach(self, pl_module: LightningModule, trainer: Trainer) -> None:
        position = log_position(trainer, pl_module)

        def seen(name: str, value: Any) -> None:
            started = time.perf_counter()
            where = position()  # (epoch, global step); None in the sanity check
            if where is not None and self.keep(where[0]):
                if isinstance(value, torch.Tensor):
                    # A CPU scalar is read now, cheaper than a detached tensor read at flush; a
                    # device's at flush, since reading it here waits for the device every call.
                    captured: Any = (
                        value.item() if value.is_cpu and value.numel() == 1 else value.detach()
                    )
                elif isinstance(value, (int, float)):
                    captured = float(value)
                else:  # e.g. a torchmetrics Metric: its value exists once Lightning computes it
                    captured = None
                if captured is not None:
                    self._pending.append(
                        (self.run_id, *where, name, captured, current_hook(pl_module),
                         self.source, self.replay_id)
                    )  # fmt: skip
            if self.flush_every is not None and started - self._flushed >= self.flush_every:
                self.flush()
            self.spent += time.perf_counter() - started

        intercept_log(pl_module, seen)
        self._module = pl_module

    def detach(self) -> None:
        if self._module is not None:
            release_log(self._module)
            self._module = None

    def flush(self) -> None:
        self._flushed = time.perf_counter()
        if not self._pending:
            return
        rows = [
            (*row[:4], row[4].item() if isinstance(row[4], torch.Tensor) else row[4], *row[5:])
            for row in self._pending
        ]
        self._pending.clear()
        self.store.add_metrics(rows)
