"""A replay segment's Trainer has the record's run length, and stops at its own last epoch.

Segments used to run with ``max_epochs`` set to their last epoch + 1, so a module that reads the
run's length while it trains (``trainer.max_epochs``, ``trainer.estimated_stepping_batches``, as
a warm-up or annealing schedule does) computed other values in every segment ending before the
record did: every replayed gradient differed, and the recorded losses were reported as
mismatches.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from torch import nn

import stalwart
from tests.helpers import QUIET, EveryEpoch, GradProbe

EPOCHS = 4
BATCHES = 3  # 384 training samples / 128


class LengthAware(DigitsClassifier):
    """Weighs its loss by how much of the run is done, read from the Trainer's run length; logs
    at each epoch end whether a stop is requested (nothing in the record requests one)."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        trainer = self.trainer
        done = self.current_epoch / trainer.max_epochs
        stepped = self.global_step / trainer.estimated_stepping_batches
        loss = nn.functional.cross_entropy(self(x), y) * (1 + done + stepped)
        self.log("train_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("stop_requested", float(self.trainer.should_stop))


def fresh():
    L.seed_everything(7)
    return LengthAware(width=16), DigitsDataModule(batch_size=128, train_size=384)


def trainer_for(dirpath, probes=(), **limits) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=EPOCHS,
        callbacks=[EveryEpoch(dirpath=dirpath), *probes],
        deterministic=True,
        **limits,
        **QUIET,
    )


def values(frame, epochs):
    frame = frame[frame.epoch.isin(epochs)]
    return frame[["epoch", "step", "value"]].sort_values("step", ignore_index=True)


@pytest.fixture(scope="module", params=[{}, {"min_epochs": EPOCHS}], ids=["plain", "min_epochs"])
def runs(request, tmp_path_factory):
    """The record, and the same seeded fit with the probe there from the start."""
    limits = request.param
    record = tmp_path_factory.mktemp("record")
    trainer_for(record, **limits).fit(*fresh())
    truth = tmp_path_factory.mktemp("truth")
    trainer_for(truth, [GradProbe()], **limits).fit(*fresh())
    return limits, record, stalwart.hindsight.open(truth).run()


@pytest.mark.parametrize("workers", [1, 2])
def test_segments_ending_before_the_record_replay_bit_for_bit(runs, workers):
    limits, record, truth = runs
    result = trainer_for(record, **limits).replay(
        *fresh(), probe=GradProbe(), epochs=[1, 2], workers=workers, loggers=None
    )
    assert len(result.segments) == workers
    assert all(segment.last_epoch < EPOCHS - 1 for segment in result.segments)
    # Each segment stopped at its last epoch's end, also where min_epochs would hold it.
    assert sorted(result.batch_epochs) == [1] * BATCHES + [2] * BATCHES
    replayed = values(result.metrics("grad_norm"), [1, 2])
    assert replayed.equals(values(truth.metrics("grad_norm"), [1, 2]))
    # train_loss, val_loss, and no stop requested at the epoch ends, as recorded.
    assert result.mismatches == []
