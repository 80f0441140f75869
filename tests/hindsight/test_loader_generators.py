"""A DataLoader with its own seeded generator (PyTorch's reproducibility recipe) replays and
resumes bit for bit: the generator shuffles every epoch and seeds the loader's workers, and its
state moves on from epoch to epoch, so the record keeps it with the other RNG states.

Before, a replay of such a record started each segment with the generator as the user's code
built it: every replayed batch came in another order (16 of 16 values differed, 4 mismatches).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from torch.utils.data import DataLoader

import stalwart
from tests.helpers import EveryEpoch

QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
EPOCHS = 4


class SeededLoaderDigits(DigitsDataModule):
    def __init__(self, num_workers: int = 0) -> None:
        super().__init__(batch_size=128, train_size=640)
        self.num_workers = num_workers

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator()
        generator.manual_seed(0)
        return DataLoader(
            self.train, batch_size=self.batch_size, shuffle=True, generator=generator,
            num_workers=self.num_workers,
        )  # fmt: skip


class BatchProbe(L.Callback):
    """Inner-loop: which samples each batch holds (their labels' checksum) and its loss."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        labels = batch[1]
        pl_module.log("batch_order", (labels * torch.arange(len(labels))).sum().double())
        pl_module.log("batch_loss", outputs["loss"].detach())


def trainer_for(dirpath, callbacks=()) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=EPOCHS, callbacks=[EveryEpoch(dirpath=str(dirpath)), *callbacks],
        deterministic=True, **QUIET,
    )  # fmt: skip


def fresh(num_workers: int = 0):
    L.seed_everything(3)
    return DigitsClassifier(width=16), SeededLoaderDigits(num_workers)


def series(run_or_result, name: str, epochs):
    frame = run_or_result.metrics(name)
    frame = frame[frame.epoch.isin(epochs)]
    return list(zip(frame.epoch, frame.step, frame.value, strict=True))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_replay_draws_the_recorded_order_from_the_loaders_own_generator(tmp_path, num_workers):
    record = trainer_for(tmp_path / "record")
    record.fit(*fresh(num_workers))
    truth = trainer_for(tmp_path / "truth", [BatchProbe()])
    truth.fit(*fresh(num_workers))
    expected = series(stalwart.hindsight.open(tmp_path / "truth").run(), "batch_order", [2, 3])
    assert len(expected) == 10

    for workers in (1, 2):
        result = record.replay(
            *fresh(num_workers), probe=BatchProbe(), epochs=[2, 3], workers=workers
        )
        assert result.mismatches == [], result.summary()
        assert series(result, "batch_order", [2, 3]) == expected


def test_a_fit_resumed_from_a_record_checkpoint_continues_the_loaders_order(tmp_path):
    record = trainer_for(tmp_path / "record", [BatchProbe()])
    record.fit(*fresh())
    run = stalwart.hindsight.open(tmp_path / "record").run()
    checkpoint = next(c for c in run.checkpoints() if c.epoch == 1)

    resumed = trainer_for(tmp_path / "resumed", [BatchProbe()])
    resumed.fit(*fresh(), ckpt_path=str(checkpoint.path))
    again = stalwart.hindsight.open(tmp_path / "resumed").run()
    for name in ("batch_order", "batch_loss"):
        assert series(again, name, [2, 3]) == series(run, name, [2, 3])
