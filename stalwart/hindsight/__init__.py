"""Hindsight logging (Flor), framework-neutral core.

Policy, materializers, store, RNG capture and hook fingerprints; no Lightning or Composer here.
"""

from __future__ import annotations

import os

from stalwart.hindsight.policy import Decision, JointInvariantPolicy
from stalwart.hindsight.store import CheckpointEntry, HindsightStore, Run


def open(dirpath: str | os.PathLike = "runs") -> HindsightStore:  # noqa: A001 - mirrors io.open
    """Open a run directory recorded by :class:`~stalwart.HindsightCallback` for reading.

    Example::

        store = stalwart.hindsight.open("runs")
        for run in store.runs():
            print(run.name, run.metrics("val_loss").tail())
    """
    return HindsightStore(dirpath)


__all__ = ["CheckpointEntry", "Decision", "HindsightStore", "JointInvariantPolicy", "Run", "open"]
