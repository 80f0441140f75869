"""A memoized epoch offers what its training batches logged, as the recorded epoch had it.

Its batches do not run in an outer-loop replay, so Lightning never sees their ``self.log``
calls: the record keeps what the training loop's result collection held at the inner loop's end,
and the replay puts it back. Without that, ``trainer.callback_metrics`` lacked the epoch's
training metrics (a probe reading one raised KeyError, one using ``.get`` logged nothing and the
replay reported no mismatch) and a ``ReduceLROnPlateau`` monitoring one stopped the replay.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from torch import nn
from torchmetrics import MeanMetric

import stalwart
from stalwart import HindsightCallback
from stalwart.callbacks import hindsight as hindsight_callback
from stalwart.callbacks.loop_state import INNER_LOOP_END_KEY, LOGGED_KEY
from tests.helpers import QUIET

EPOCHS = 5
REPLAYED = [1, 2, 3, 4]
#: What the module logs from its training batches, as callback_metrics names it at epoch end.
TRAINING_METRICS = (
    "train_loss",  # on_step and on_epoch: also train_loss_step and train_loss_epoch
    "train_loss_step",
    "train_loss_epoch",
    "train_err",  # on_epoch only, monitored by the plateau scheduler
    "train_mean",  # a torchmetrics Metric
    "batch_loss_sum",  # the module's on_train_batch_end, after every callback's
)


class FirstThreeEpochs(HindsightCallback):
    """Epochs 0-2 checkpointed, 3 and 4 not: a replay of 1-4 resumes from epoch 0's checkpoint,
    memoizes 1 and 2 and runs the batches of 3 and 4."""

    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return trainer.current_epoch < 3


class TrainMetrics(DigitsClassifier):
    """Logs training metrics of every kind, and lowers its LR on the plateaus of one of them."""

    def __init__(self, width: int = 16) -> None:
        super().__init__(width=width)
        self.train_mean = MeanMetric()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        err = (logits.argmax(-1) != y).float().mean()
        self.log("train_err", err, on_step=False, on_epoch=True)
        self.train_mean(loss)
        self.log("train_mean", self.train_mean, on_step=False, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        loss = outputs["loss"].detach()
        self.log("batch_loss_sum", loss, on_step=False, on_epoch=True, reduce_fx="sum")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        # Mode "max" on an error that mostly falls: the LR halves at most epoch ends, and the
        # scheduler's state (its best value so far) is the recorded values'.
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="max", patience=0, factor=0.5, threshold=0.0
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": plateau, "monitor": "train_err"},
        }


class CallbackMetricsProbe(L.Callback):
    """Outer-loop: what the epoch end sees of the training metrics, and the plateau's state."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        pl_module.log("lr_at_start", trainer.optimizers[0].param_groups[0]["lr"])
        pl_module.log("plateau_best", trainer.lr_scheduler_configs[0].scheduler.best)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        for name in TRAINING_METRICS:
            pl_module.log(f"seen_{name}", metrics[name])  # KeyError where one is missing
        pl_module.log("seen_pbar_train_loss", trainer.progress_bar_metrics["train_loss_epoch"])


class LenientProbe(L.Callback):
    """Outer-loop: reads the training metrics where they are there."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("w_norm", pl_module.net[0].weight.norm())
        if "train_loss" in trainer.callback_metrics:
            pl_module.log("seen_train_loss", trainer.callback_metrics["train_loss"])


def trainer_for(dirpath, probes=()) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=EPOCHS,
        callbacks=[FirstThreeEpochs(dirpath=dirpath), *probes],
        deterministic=True,
        **QUIET,
    )


def fresh():
    L.seed_everything(5)
    return TrainMetrics(), DigitsDataModule(batch_size=128, train_size=640)


def values(frame, epochs=None):
    if epochs is not None:
        frame = frame[frame.epoch.isin(epochs)]
    return frame[["epoch", "step", "value"]].reset_index(drop=True)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    trainer_for(root).fit(*fresh())
    return root


def test_memoized_epochs_offer_the_recorded_training_metrics(record, tmp_path):
    result = trainer_for(record).replay(*fresh(), probe=CallbackMetricsProbe(), epochs=REPLAYED)
    assert result.level == "outer"
    assert sorted(set(result.batch_epochs)) == [3, 4]  # 1 and 2 memoized
    # The truth: the same seeded training with the probe there from the start.
    trainer_for(tmp_path, [CallbackMetricsProbe()]).fit(*fresh())
    truth = stalwart.hindsight.open(tmp_path).run()
    names = [f"seen_{name}" for name in TRAINING_METRICS]
    for name in [*names, "seen_pbar_train_loss", "lr_at_start", "plateau_best"]:
        assert values(result.metrics(name)).equals(values(truth.metrics(name), REPLAYED)), name
    # Epochs 3 and 4 trained with the LR the plateau set from the restored values: their
    # training metrics match the record's, value for value.
    assert result.mismatches == []
    assert result.metrics("lr_at_start").value.nunique() > 1  # the plateau did lower the LR


def test_the_record_stays_loadable_with_weights_only(record):
    checkpoints = stalwart.hindsight.open(record).run().checkpoints()
    assert [c.epoch for c in checkpoints] == [0, 1, 2]
    for entry in checkpoints:
        checkpoint = torch.load(entry.path, weights_only=True)
        logged = {e["key"] for e in checkpoint[INNER_LOOP_END_KEY][LOGGED_KEY]}
        assert {
            "training_step.train_loss",
            "training_step.train_err",
            "training_step.train_mean",
            "on_train_batch_end.batch_loss_sum",
        } <= logged


class PlainModule(DigitsClassifier):
    def __init__(self) -> None:
        super().__init__(width=16)


def test_a_record_made_without_it_replays_as_before(tmp_path, monkeypatch):
    """Records made before the training results were captured: a probe that reads them where
    they are there logs nothing for a memoized epoch, the rest replays exactly."""
    monkeypatch.setattr(hindsight_callback, "capture_logged", lambda inner, trainer: None)

    def plain():
        L.seed_everything(5)
        return PlainModule(), DigitsDataModule(batch_size=128, train_size=640)

    trainer_for(tmp_path).fit(*plain())
    checkpoint = stalwart.hindsight.open(tmp_path).run().checkpoints()[1].load()
    assert LOGGED_KEY not in checkpoint[INNER_LOOP_END_KEY]
    result = trainer_for(tmp_path).replay(*plain(), probe=LenientProbe(), epochs=REPLAYED)
    assert sorted(set(result.batch_epochs)) == [3, 4]
    assert result.metrics("seen_train_loss").epoch.tolist() == [3, 4]
    assert result.metrics("w_norm").epoch.tolist() == REPLAYED
    assert result.mismatches == []
