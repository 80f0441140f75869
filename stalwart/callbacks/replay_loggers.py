"""The Lightning side of writing replayed values back: describing a run's loggers, and its steps.

At record time the run's loggers are described in the manifest (where their files are); at
replay time a replay's new series are placed on the step axis Lightning's loggers used for the
record: a value logged per training batch at the step it was logged at, a value logged in an
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


def lightning_points(rows: pd.DataFrame) -> pd.DataFrame:
    """Replayed rows (name, epoch, step, value, hook) on the record's logger step axis."""
    per_batch = rows.hook.isin(BATCH_LEVEL_HOOKS)
    batch = rows.loc[per_batch, ["name", "epoch", "step", "value"]]
    epoch = (
        rows.loc[~per_batch]
        .groupby(["name", "epoch"], as_index=False, sort=True)
        .agg(step=("step", "max"), value=("value", "mean"))
    )
    epoch["step"] = (epoch.step - 1).clip(lower=0)
    return pd.concat([batch, epoch[["name", "epoch", "step", "value"]]], ignore_index=True)


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
