"""The Lightning adapter: Lightning's own fit loop, callbacks, validation and checkpoints, with
the training steps computed by pipeline workers that survive a killed or preempted stage."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from stalwart.errors import ConfigurationError
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.workloads import DigitsMLP
from stalwart.strategies import RedundantPipelineStrategy
from stalwart.strategies.redundant_pipeline import _logs_in_training_step

EPOCHS, BATCHES = 2, 6


class DigitsModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.model(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Recorder(Callback):
    """What a user's callback sees; optionally preempts stage 2's worker with a real SIGTERM
    (from this process, between two steps) after step ``sigterm_after``."""

    def __init__(self, sigterm_after: int | None = None) -> None:
        self.sigterm_after = sigterm_after
        self.losses: list[float] = []
        self.epochs = 0
        self.val_losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step == self.sigterm_after:
            os.kill(trainer.strategy.worker_pid(2), signal.SIGTERM)

    def on_train_epoch_end(self, trainer, module):
        self.epochs += 1

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))


def loaders() -> tuple[DataLoader, DataLoader]:
    digits = DigitsMLP()
    n = 32 * BATCHES
    train = TensorDataset(digits.x[:n], digits.y[:n])
    val = TensorDataset(digits.x[n : n + 128], digits.y[n : n + 128])
    return DataLoader(train, batch_size=32), DataLoader(val, batch_size=64)


def fit(tmp_path, strategy, recorder: Recorder, logger=False) -> tuple[DigitsModule, L.Trainer]:
    module = DigitsModule()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "checkpoints", monitor="val_loss", save_top_k=1)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=logger,
        callbacks=[recorder, checkpoint], enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=1, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, *loaders())
    return module, trainer


def pipeline(faults=()) -> RedundantPipelineStrategy:
    return RedundantPipelineStrategy(num_stages=4, num_microbatches=4, faults=faults)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same LightningModule trained by Lightning's default single-process strategy."""
    recorder = Recorder()
    module, _ = fit(tmp_path_factory.mktemp("reference"), "auto", recorder)
    return module, recorder


def assert_same_training(recorder: Recorder, reference: Recorder) -> None:
    assert len(recorder.losses) == EPOCHS * BATCHES and recorder.epochs == EPOCHS
    pairs = zip(recorder.losses, reference.losses, strict=True)
    assert max(abs(a - b) for a, b in pairs) <= 1e-5
    pairs = zip(recorder.val_losses, reference.val_losses, strict=True)
    assert len(recorder.val_losses) == EPOCHS and max(abs(a - b) for a, b in pairs) <= 1e-5


def logged_train_losses(log_dir: str) -> dict[int, float]:
    """Step -> ``train_loss`` as the CSVLogger wrote it."""
    with open(Path(log_dir) / "metrics.csv", newline="") as fh:
        return {
            int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(fh) if r["train_loss"]
        }


@pytest.mark.timeout(120)
def test_lightning_loop_callbacks_validation_and_checkpoint(tmp_path, reference):
    ref_module, ref_recorder = reference
    strategy = pipeline()
    recorder = Recorder()
    logger = CSVLogger(tmp_path, name="csv")
    # DigitsModule.training_step calls self.log, which cannot happen under the pipeline.
    with pytest.warns(UserWarning, match="does not call DigitsModule.training_step"):
        module, trainer = fit(tmp_path, strategy, recorder, logger)
    assert trainer.state.finished and trainer.global_step == EPOCHS * BATCHES
    # Every step's pipeline loss reached the user's logger: the values the workers recorded.
    logged = logged_train_losses(logger.log_dir)
    assert sorted(logged) == list(range(EPOCHS * BATCHES))
    recorded = strategy.result.losses
    assert len(recorded) == EPOCHS * BATCHES
    for step, loss in logged.items():
        assert loss == pytest.approx(recorded[step], rel=1e-6), step
        assert loss == pytest.approx(recorder.losses[step], rel=1e-6), step
    # The pipeline trains exactly like Lightning's own single-process loop: the same losses
    # (seen by a user callback), the same validation losses, the same final weights.
    assert_same_training(recorder, ref_recorder)
    for a, b in zip(module.parameters(), ref_module.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(recorder.losses[-1])
    # ModelCheckpoint saved the pulled, trained weights: they reproduce the best val loss.
    best = trainer.checkpoint_callback
    restored = DigitsModule()
    restored.load_state_dict(torch.load(best.best_model_path, weights_only=True)["state_dict"])
    x, y = loaders()[1].dataset.tensors
    with torch.no_grad():
        val = F.cross_entropy(restored.model(x), y)
    assert float(val) == pytest.approx(float(best.best_model_score), abs=1e-5)
    assert float(best.best_model_score) == pytest.approx(min(recorder.val_losses), abs=1e-6)
    # Replicas stayed bit-identical to their owners after every step.
    assert strategy.result.digests and all(
        pair["owner"] == pair["replica"] for pair in strategy.result.digests.values()
    )


class NoStepModule(DigitsModule):
    """A module written for the pipeline only: layers, validation, optimizer, no training_step."""

    training_step = L.LightningModule.training_step


@pytest.mark.timeout(120)
def test_a_module_without_training_step_trains_and_leaves_fit_as_it_came(tmp_path, reference):
    _, ref_recorder = reference
    module, recorder = NoStepModule(), Recorder()
    trainer = L.Trainer(
        strategy=pipeline(), accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False,
        callbacks=[recorder], enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=1, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, *loaders())
    assert_same_training(recorder, ref_recorder)
    assert "training_step" not in vars(module)  # the placeholder went back at teardown
    with pytest.raises(MisconfigurationException, match="training_step"):
        L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False).fit(
            module, loaders()[0]
        )  # other strategies still refuse it, as Lightning always did


@pytest.mark.timeout(120)
def test_sigterm_to_a_stage_worker_does_not_stop_lightning(tmp_path, reference):
    _, ref_recorder = reference
    strategy = pipeline()
    recorder = Recorder(sigterm_after=4)
    module, trainer = fit(tmp_path, strategy, recorder)
    assert strategy.result.exit_codes[2] == 128 + signal.SIGTERM  # it left, by itself
    assert not trainer.received_sigterm and trainer.state.finished
    assert [e["kind"] for e in strategy.result.events] == ["failover"]
    assert strategy.result.events[0]["resume"] == 4  # no step lost, no checkpoint load
    assert_same_training(recorder, ref_recorder)


@pytest.mark.timeout(120)
def test_sigkill_mid_backward_through_lightning(tmp_path, reference):
    _, ref_recorder = reference
    strategy = pipeline([Fault(rank=1, step=3, phase="backward")])
    recorder = Recorder()
    fit(tmp_path, strategy, recorder)
    assert strategy.result.exit_codes[1] == -signal.SIGKILL
    (event,) = strategy.result.events
    assert event["kind"] == "failover" and event["resume"] == event["step"] == 3
    assert_same_training(recorder, ref_recorder)


def test_bad_strategy_arguments_fail_before_any_process():
    with pytest.raises(ConfigurationError, match="failure_timeout"):
        RedundantPipelineStrategy(failure_timeout=0)
    with pytest.raises(ConfigurationError, match="redundancy"):
        RedundantPipelineStrategy(redundancy="maybe")
    with pytest.raises(ConfigurationError, match="accumulate"):
        trainer = L.Trainer(
            strategy=pipeline(), accumulate_grad_batches=2, max_epochs=1, logger=False,
            limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(DigitsModule(), loaders()[0])


class QuietModule(DigitsModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(torch.log(x.abs() + 1)), y)


class DictLoggingModule(DigitsModule):
    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self.model(batch[0]), batch[1])
        self.log_dict({"loss": loss})
        return loss


def test_only_a_training_step_that_logs_is_warned_about():
    assert _logs_in_training_step(DigitsModule())
    assert _logs_in_training_step(DictLoggingModule())
    assert not _logs_in_training_step(QuietModule())  # torch.log is not self.log
    assert not _logs_in_training_step(L.LightningModule())
