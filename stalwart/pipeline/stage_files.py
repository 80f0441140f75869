"""The pipeline's own checkpoint: one durable, sealed file per stage per step.

``<directory>/step-<step>/stage-<s>.pt`` holds the module and optimizer state of stage ``s``
after ``step`` optimizer steps. The first pipeline's owners write them (every pipeline holds
the same weights); the survivors load the newest complete step when no pipeline is whole any
more, and the Lightning driver loads them to pull the trained weights back.

Each file is written through :mod:`stalwart.durable` (temp file, fsync, rename, seal), so a
writer killed mid-write leaves the previous file intact and only a hidden temp file behind,
which :func:`latest_checkpoint` never counts; a file truncated or changed afterwards fails
:func:`load_stage` with :class:`~stalwart.errors.CorruptCheckpointError`.

Example:
    >>> save_stage(module, optimizer, stage_path(root, step=3, stage=1))   # doctest: +SKIP
    >>> latest_checkpoint(root, num_stages=4)                              # doctest: +SKIP
    3
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stalwart import durable


def stage_path(directory: str | os.PathLike, step: int, stage: int) -> Path:
    """The file of ``stage`` after ``step`` optimizer steps."""
    return Path(directory) / f"step-{step:06d}" / f"stage-{stage}.pt"


def save_stage(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike
) -> None:
    """Write one stage's module and optimizer state to ``path``, atomically and sealed."""
    path = Path(path)
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        durable.fsync_directory(path.parent.parent)  # the new step folder survives a crash too
    state = {
        "module": module.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else {},
    }
    durable.save_torch(state, path)


def load_stage(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """The ``{"module": ..., "optimizer": ...}`` state of one stage file, verified first.

    Raises:
        CorruptCheckpointError: the file is missing, torn or changed.
    """
    return durable.load_torch(path, map_location=map_location)


def latest_checkpoint(directory: str | os.PathLike, num_stages: int) -> int | None:
    """The newest step for which every stage's file is complete (sealed), or None.

    A temp file left by a killed writer has another name and is never counted; a truncated
    file fails the seal check and makes its step incomplete.
    """
    steps = (int(folder.name.split("-")[1]) for folder in Path(directory).glob("step-*"))
    for step in sorted(steps, reverse=True):
        if all(durable.has_seal(stage_path(directory, step, s)) for s in range(num_stages)):
            return step
    return None
