"""User code reading ``trainer.checkpoint_callback`` replays what the record saw, and a replay
writes none of the checkpoints (Lightning).

A replay must never write, rotate or delete the user's checkpoint files, so it used to leave
Lightning's checkpointing out altogether: a module or callback reading
``trainer.checkpoint_callback.best_model_score`` (``best_model_path``, ...) failed with
``AttributeError``. The replay's Trainer now has the record's ``ModelCheckpoint`` (or
Lightning's default one) with its state from the segment's start, writing no file.
"""

from __future__ import annotations

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger

import stalwart
from tests.helpers import EpochProbe, EveryEpoch, GradProbe

#: (epoch, best_model_path, last_model_path, k best paths) as each fit's module read them,
#: record and replay alike (the replays below run in this process: workers=1).
READ: list[tuple] = []


class ReadsCheckpointCallback(DigitsClassifier):
    """Reads the checkpoint callback at every epoch end; logs its best score once it has one."""

    def on_train_epoch_end(self) -> None:
        saved = self.trainer.checkpoint_callback
        best = sorted(getattr(saved, "best_k_models", {}))
        READ.append((self.current_epoch, saved.best_model_path, saved.last_model_path, best))
        if saved.best_model_score is not None:
            self.log("best_score", saved.best_model_score)


def fresh():
    L.seed_everything(7)
    return ReadsCheckpointCallback(width=8), DigitsDataModule(batch_size=128, train_size=512)


def trainer_for(root, kind: str) -> stalwart.Trainer:
    quiet = {"enable_progress_bar": False, "enable_model_summary": False, "log_every_n_steps": 1}
    callbacks = [EveryEpoch(dirpath=root / "runs")]
    # A logger: Lightning's default ModelCheckpoint saves in its folder (csv/version_0), where
    # a replay's Trainer has a temporary one of its own.
    logger = CSVLogger(root, name="csv")
    if kind == "given":
        saved = ModelCheckpoint(root / "saved", monitor="val_loss", save_top_k=2, save_last=True)
        callbacks.append(saved)
    return stalwart.Trainer(max_epochs=4, callbacks=callbacks, logger=logger, **quiet)


def checkpoint_files(root) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in root.rglob("*.ckpt")
        if "runs" not in path.parts
    }


@pytest.fixture(scope="module", params=["given", "default"])
def record(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    READ.clear()
    trainer_for(root, request.param).fit(*fresh())
    recorded = {entry[0]: entry for entry in READ}
    assert recorded[3][1]  # the record saw checkpoints saved
    return root, request.param, recorded, checkpoint_files(root)


@pytest.mark.parametrize("probe", [GradProbe, EpochProbe], ids=["inner", "outer"])
def test_a_replay_sees_the_records_checkpoint_callback_and_writes_no_file(record, probe):
    root, kind, recorded, files = record
    READ.clear()
    result = trainer_for(root, kind).replay(*fresh(), probe=probe(), epochs=[2, 3])
    assert result.mismatches == []  # best_score, as the record logged it
    assert READ and all(recorded[entry[0]] == entry for entry in READ)
    assert checkpoint_files(root) == files  # none written, rewritten or removed


class BestOnly(ModelCheckpoint):
    """A user's own subclass: a replay cannot know what its overrides write."""


@pytest.mark.parametrize("beside", ["on_exception", "subclass"])
def test_a_model_checkpoint_beside_another_checkpoint_callback_replays(tmp_path, beside):
    # Beside an OnExceptionCheckpoint (no ModelCheckpoint) Lightning's is kept, and the module
    # reads it; beside a subclass of it the replay has none (the module here reads none). Both
    # replays run and write no file.
    def callbacks():
        other = (
            OnExceptionCheckpoint(tmp_path / "exception")
            if beside == "on_exception"
            else BestOnly(tmp_path / "best", monitor="val_loss")
        )
        return [EveryEpoch(dirpath=tmp_path / "runs"), ModelCheckpoint(tmp_path / "saved"), other]

    def model_and_data():
        model, data = fresh()
        return (model if beside == "on_exception" else DigitsClassifier(width=8)), data

    quiet = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
    stalwart.Trainer(max_epochs=3, callbacks=callbacks(), **quiet).fit(*model_and_data())
    files = checkpoint_files(tmp_path)
    READ.clear()
    replayer = stalwart.Trainer(max_epochs=3, callbacks=callbacks(), **quiet)
    result = replayer.replay(*model_and_data(), probe=GradProbe(), epochs=[1, 2], workers=2)
    assert result.mismatches == []
    assert checkpoint_files(tmp_path) == files
