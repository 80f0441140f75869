"""The Lightning side of writing replayed values back: describing a run's loggers, and its steps.

At record time the run's loggers are described in the manifest (where their files are); at
replay time a replay's new series are placed on the step axis Lightning's loggers used for the
record: a value logged per training batch at its batch's logger step (see
:func:`batch_points`), a value logged in an
epoch-level hook (validation, ``on_train_epoch_end``) as its epoch mean one step earlier, as
Lightning's logger connector writes epoch metrics.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger

from stalwart.callbacks.replay import BATCH_LEVEL_HOOKS
from stalwart.hindsight.writeback import (
    REPLAY_PREFIX,
    csv_target,
    mlflow_target,
    tensorboard_target,
    unsupported_target,
)


def describe_loggers(loggers: Iterable[Logger]) -> list[dict[str, Any]]:
    """Where each logger of a run keeps its values (see :mod:`stalwart.hindsight.writeback`)."""
    described = []
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            described.append(tensorboard_target(logger.log_dir))
        elif isinstance(logger, CSVLogger):
            described.append(csv_target(os.path.join(logger.log_dir, "metrics.csv")))
        elif isinstance(logger, MLFlowLogger):
            described.append(mlflow_target(logger._tracking_uri, logger.run_id))
        else:
            described.append(unsupported_target(logger))
    return described


#: Batch-level hooks that run after the batch's optimizer step: a value logged there is stored
#: at the step count the optimizer step just raised, one past its batch's logger step.
AFTER_STEP_HOOKS = frozenset({"on_train_batch_end"})


def lightning_points(rows: pd.DataFrame) -> pd.DataFrame:
    """Replayed rows (name, epoch, step, value, hook) on the record's logger step axis."""
    per_batch = rows.hook.isin(BATCH_LEVEL_HOOKS)
    batch = batch_points(rows.loc[per_batch])
    epoch = (
        rows.loc[~per_batch]
        .groupby(["name", "epoch"], as_index=False, sort=True)
        .agg(step=("step", "max"), value=("value", "mean"))
    )
    epoch["step"] = (epoch.step - 1).clip(lower=0)
    return pd.concat([batch, epoch[["name", "epoch", "step", "value"]]], ignore_index=True)


def batch_points(rows: pd.DataFrame) -> pd.DataFrame:
    """Per-batch rows (in the order they were logged) at their batch's logger step.

    Lightning writes every value logged during a batch at one logger step, the count of batches
    that stepped before it, and only after a batch that steps the optimizer: under gradient
    accumulation the values of the batches that only accumulate are replaced by the stepping
    batch's (the last of its group), so one value per name and step is written, the last.

    A row is stored at the optimizer-step count at its log call. Before the step (training_step,
    backward, ``on_before_optimizer_step``) that is the logger step. After it
    (``on_train_batch_end``) a stepping batch's rows are one past it: in an epoch, the first row
    at each stored step is the batch that stepped to it (logger step one less); later rows there
    are accumulating batches, which Lightning does not write. An epoch in which a name has more
    than one such row per stored step accumulates, and its first stored step holds only
    accumulating batches (each epoch starts a new group). Rows carry no batch index: an epoch
    of at most two batches, or a probe that logs only on some batches, under accumulation, is
    read as one that steps every batch.
    """
    rows = rows[["name", "epoch", "step", "value", "hook"]]
    after = rows.loc[rows.hook.isin(AFTER_STEP_HOOKS)]
    keys = ["name", "epoch", "step"]
    stepped = ~after.duplicated(keys, keep="first")
    per_step = after.groupby(keys).step.transform("size")
    accumulating = per_step.groupby([after.name, after.epoch]).transform("max") > 1
    opening = after.step == after.groupby(["name", "epoch"]).step.transform("min")
    late = after.loc[stepped & ~(accumulating & opening)]
    late = late.assign(step=late.step - 1)
    before = rows.loc[~rows.hook.isin(AFTER_STEP_HOOKS)]
    points = pd.concat([before, late]).sort_values(["epoch", "step"], kind="stable")
    points = points.loc[points.step >= 0].drop_duplicates(["name", "step"], keep="last")
    return points[["name", "epoch", "step", "value"]].reset_index(drop=True)


def write_to_loggers(loggers: Sequence[Logger], points: pd.DataFrame) -> list[str]:
    """Write points into Lightning logger instances the user passed (``loggers=[...]``)."""
    if not loggers or points.empty:
        return []
    named = points.assign(name=REPLAY_PREFIX + points.name)
    for logger in loggers:
        for step, group in named.groupby("step", sort=True):
            logger.log_metrics(dict(zip(group.name, group.value, strict=True)), step=int(step))
        logger.save()
        logger.finalize("success")
    return [f"{type(logger).__name__} {logger.log_dir}" for logger in loggers]
