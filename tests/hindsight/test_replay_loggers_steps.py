"""Replayed per-batch values land on their batch's logger step, once, as Lightning writes them.

A record writes ``train_loss`` (logged in ``training_step``) through a real CSVLogger and
TensorBoardLogger; a replay adds a probe logging in ``on_train_batch_end`` (after the optimizer
step) and in ``on_before_optimizer_step``. A plain Lightning run with the same probe is the
ground truth: each value at the step it writes there, with and without gradient accumulation.
"""

from __future__ import annotations

import os

import lightning as L
import numpy as np
import pandas as pd
import pytest
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

import stalwart
from stalwart import HindsightCallback

SETTINGS = dict(
    max_epochs=2,
    log_every_n_steps=1,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    deterministic=True,
)


class StepProbe(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("end_loss", outputs["loss"].detach())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pl_module.log("grad_norm", pl_module.net[0].weight.grad.norm())


def fresh():
    L.seed_everything(5)
    # 5 batches an epoch: under accumulate_grad_batches=2 the last group has one batch.
    return DigitsClassifier(width=16), DigitsDataModule(batch_size=128, train_size=640)


def by_step(frame: pd.DataFrame, column: str) -> pd.Series:
    values = frame.dropna(subset=[column])
    assert not values.step.duplicated().any(), f"{column}: more than one value at a step"
    return values.set_index("step")[column].sort_index()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_replayed_batch_values_sit_at_their_batchs_logger_step(tmp_path, accumulate):
    model, data = fresh()
    truth_logger = CSVLogger(tmp_path / "truth")
    L.Trainer(
        callbacks=[StepProbe()], logger=truth_logger, accumulate_grad_batches=accumulate,
        **SETTINGS,
    ).fit(model, data)  # fmt: skip
    truth = pd.read_csv(os.path.join(truth_logger.log_dir, "metrics.csv"))

    model, data = fresh()
    logger = CSVLogger(tmp_path / "record")
    trainer = stalwart.Trainer(
        callbacks=[HindsightCallback(dirpath=tmp_path / "runs")], logger=logger,
        accumulate_grad_batches=accumulate, **SETTINGS,
    )  # fmt: skip
    trainer.fit(model, data)
    model, data = fresh()
    trainer.replay(model, data, probe=StepProbe())
    replayed = pd.read_csv(os.path.join(logger.log_dir, "metrics.csv"))

    for name in ["end_loss", "grad_norm"]:
        expected, got = by_step(truth, name), by_step(replayed, "replay/" + name)
        assert list(got.index) == list(expected.index), name
        np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-5)
    # On the row of its batch's train_loss (the loss the step used: divided by the group size
    # under accumulation), as Lightning writes it.
    rows = replayed.dropna(subset=["train_loss"])
    assert rows["replay/end_loss"].notna().all() and rows["replay/grad_norm"].notna().all()
    if accumulate == 1:
        np.testing.assert_allclose(rows["replay/end_loss"], rows.train_loss, rtol=1e-6)


def tensorboard_points(log_dir) -> list[tuple[str, int]]:
    points = []
    for name in os.listdir(log_dir):
        if ".replay-" in name:
            for event in EventFileLoader(os.path.join(log_dir, name)).Load():
                if event.HasField("summary"):
                    points += [(value.tag, event.step) for value in event.summary.value]
    return points


def test_replaying_a_series_again_writes_it_once(tmp_path):
    model, data = fresh()
    csv, board = CSVLogger(tmp_path / "csv"), TensorBoardLogger(tmp_path / "tb")
    trainer = stalwart.Trainer(
        callbacks=[HindsightCallback(dirpath=tmp_path / "runs")], logger=[board, csv], **SETTINGS
    )
    trainer.fit(model, data)
    path = os.path.join(csv.log_dir, "metrics.csv")
    written = []
    for _ in range(2):
        model, data = fresh()
        trainer.replay(model, data, probe=StepProbe())
        written.append((pd.read_csv(path), tensorboard_points(board.log_dir)))
    (first_csv, first_tb), (second_csv, second_tb) = written
    pd.testing.assert_frame_equal(second_csv, first_csv)
    assert by_step(second_csv, "replay/end_loss").size == 10
    assert sorted(second_tb) == sorted(first_tb)
    assert len(set(second_tb)) == len(second_tb) == 20
