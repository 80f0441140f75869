"""A replay runs the recorded Trainer's callbacks afresh, without what stops a fit by wall clock.

Lightning appends its default callbacks (ModelCheckpoint, progress bar, ModelSummary, Timer) to
the very list a Trainer is given, and a fit leaves state in each instance. A replay on the
Trainer that recorded used to copy those used instances: the progress bar's reference to the
Trainer reached the record's open store ("cannot pickle 'sqlite3.Connection' object"), a used
StochasticWeightAveraging replayed with its averaging already started, and a used Timer
stopped the replay before its first batch. A fit that ``max_time`` stopped replayed under its
own wall clock, and a ``LearningRateMonitor`` refused the replay's Trainer without a logger.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import LearningRateMonitor, StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger

import stalwart
from stalwart.errors import ConfigurationError
from stalwart.hindsight.replay import requested_epochs
from tests.helpers import QUIET, GradProbe


def data() -> DigitsDataModule:
    return DigitsDataModule(batch_size=128, train_size=512)


def test_a_replay_on_the_recording_trainer_with_its_progress_bar(tmp_path):
    L.seed_everything(0)
    trainer = stalwart.Trainer(
        max_epochs=3, callbacks=[stalwart.HindsightCallback(dirpath=str(tmp_path))],
        logger=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(DigitsClassifier(width=8), data())
    result = trainer.replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=[1, 2])
    assert result.mismatches == []
    assert sorted(set(result.metrics("grad_norm").epoch)) == [1, 2]


def test_a_callback_the_fit_used_is_replayed_fresh(tmp_path):
    def swa():
        return StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)

    L.seed_everything(0)
    record = stalwart.HindsightCallback(dirpath=str(tmp_path), materializer="inline")
    trainer = stalwart.Trainer(max_epochs=4, callbacks=[swa(), record], **QUIET)
    trainer.fit(DigitsClassifier(width=8), data())
    result = trainer.replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=range(4))
    assert result.mismatches == []  # 4 used to differ: the copied SWA had already begun


class SlowSteps(DigitsClassifier):
    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


class SlowProbe(GradProbe):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        time.sleep(0.03)
        super().on_before_optimizer_step(trainer, pl_module, optimizer)


def test_a_fit_stopped_by_max_time_replays_to_where_it_stopped(tmp_path):
    kwargs = {"max_epochs": 50, "max_time": timedelta(milliseconds=500), **QUIET}
    L.seed_everything(0)
    trainer = stalwart.Trainer(callbacks=[stalwart.HindsightCallback(str(tmp_path))], **kwargs)
    trainer.fit(SlowSteps(width=8), data())
    assert trainer.current_epoch < 49  # the clock stopped it
    # A fresh Trainer as for the recorded fit, and a probe that slows every step: the replay
    # has no clock of its own and stops after the batch the record's last epoch ended with.
    fresh = stalwart.Trainer(callbacks=[stalwart.HindsightCallback(str(tmp_path))], **kwargs)
    result = fresh.replay(SlowSteps(width=8), data(), probe=SlowProbe())
    assert result.mismatches == []
    assert result.batches_executed == trainer.global_step


def test_a_run_recorded_with_a_learning_rate_monitor_replays(tmp_path):
    def build() -> stalwart.Trainer:
        return stalwart.Trainer(
            max_epochs=3,
            callbacks=[LearningRateMonitor(), stalwart.HindsightCallback(str(tmp_path / "runs"))],
            logger=CSVLogger(tmp_path / "logs"), enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        )  # fmt: skip

    L.seed_everything(0)
    build().fit(DigitsClassifier(width=8), data())
    result = build().replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=[2])
    assert result.mismatches == []
    # The replayed series still reach the recorded run's CSV logger, and only that way.
    assert result.logged_to and "replay/grad_norm" in (tmp_path / "logs").joinpath(
        "lightning_logs", "version_0", "metrics.csv"
    ).read_text().splitlines()[0].split(",")


class Unpicklable(L.Callback):
    def __init__(self) -> None:
        self.lock = threading.Lock()


def test_a_callback_that_cannot_be_copied_is_named_at_replay(tmp_path):
    L.seed_everything(0)
    record = stalwart.HindsightCallback(dirpath=str(tmp_path))
    trainer = stalwart.Trainer(max_epochs=2, callbacks=[Unpicklable(), record], **QUIET)
    trainer.fit(DigitsClassifier(width=8), data())  # a Trainer that never replays still works
    with pytest.raises(ConfigurationError, match="Unpicklable cannot be copied"):
        trainer.replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=[1])


def test_epochs_takes_one_epoch_number(tmp_path):
    L.seed_everything(0)
    trainer = stalwart.Trainer(
        max_epochs=2, callbacks=[stalwart.HindsightCallback(str(tmp_path))], **QUIET
    )
    trainer.fit(DigitsClassifier(width=8), data())
    result = trainer.replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=1)
    assert result.mismatches == []
    assert sorted(set(result.metrics("grad_norm").epoch)) == [1]
    assert requested_epochs(range(3, 1, -1)) == [2, 3]
    for wrong in (2.5, "3", True):
        with pytest.raises(ConfigurationError, match="pass an epoch number or several"):
            requested_epochs(wrong)


class NoteLoss(L.Callback):
    def __init__(self, shared: dict) -> None:
        self.shared = shared

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.shared["loss"] = float(loss)


class ScaleByLoss(L.Callback):
    def __init__(self, shared: dict) -> None:
        self.shared = shared

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for parameter in pl_module.parameters():
            parameter.grad.mul_(self.shared.get("loss", 1.0))


def test_callbacks_sharing_an_object_still_share_it_in_a_replay(tmp_path):
    def sharing() -> list[L.Callback]:
        shared: dict = {}
        return [NoteLoss(shared), ScaleByLoss(shared)]

    L.seed_everything(0)
    record = stalwart.HindsightCallback(str(tmp_path), materializer="inline")
    trainer = stalwart.Trainer(max_epochs=3, callbacks=[*sharing(), record], **QUIET)
    trainer.fit(DigitsClassifier(width=8), data())
    result = trainer.replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=[1, 2])
    assert result.mismatches == []  # copied one by one, each had its own dict: it differed


class ScaleGradients(L.Callback):
    def __init__(self, factor: float = 1.0) -> None:
        self.factor = factor

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for parameter in pl_module.parameters():
            parameter.grad.mul_(self.factor)


@pytest.mark.parametrize("change", ["append", "reconfigure"])
def test_callbacks_changed_after_the_trainer_was_built_are_replayed(tmp_path, change):
    L.seed_everything(0)
    scale = ScaleGradients()
    record = stalwart.HindsightCallback(str(tmp_path), materializer="inline")
    trainer = stalwart.Trainer(max_epochs=3, callbacks=[scale, record], **QUIET)
    if change == "append":
        trainer.callbacks.append(ScaleGradients(3.0))
    else:
        scale.factor = 3.0
    trainer.fit(DigitsClassifier(width=8), data())
    result = trainer.replay(DigitsClassifier(width=8), data(), probe=GradProbe(), epochs=[1, 2])
    assert result.mismatches == []  # copied at construction: without the change, it differed


def test_a_trainer_that_records_copies_its_callbacks_once_before_its_first_fit(tmp_path):
    L.seed_everything(0)
    record = stalwart.HindsightCallback(str(tmp_path), materializer="inline")
    trainer = stalwart.Trainer(max_epochs=1, callbacks=[ScaleGradients(), record], **QUIET)
    assert trainer._replay_callbacks is None  # nothing copied at construction
    trainer.fit(DigitsClassifier(width=8), data())
    first = trainer._replay_callbacks
    assert [type(c) for c in first.copies] == [ScaleGradients]
    trainer.fit_loop.max_epochs = 2
    trainer.fit(DigitsClassifier(width=8), data())
    assert trainer._replay_callbacks is first  # a second fit's callbacks are used ones
