"""A replay worker killed by a signal leaves no temporary folder behind (Lightning).

Each segment's Trainer logs into a temporary folder of its own (``trainer.log_dir``), which the
segment removes when its fit ends; a worker killed by a signal (the out-of-memory killer's
SIGKILL) ends nothing, and its folder used to stay in the system's temporary directory. The
folders are now made inside one of the replaying process's, which it removes itself.
"""

from __future__ import annotations

import os
import signal
import tempfile

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.loggers import CSVLogger

import stalwart
from stalwart.errors import ReplayError
from tests.helpers import EveryEpoch, GradProbe

QUIET = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


class KilledInEpoch3(GradProbe):
    """Its worker process is killed by SIGKILL in the middle of epoch 3's training."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == 3 and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def fresh():
    L.seed_everything(3)
    return DigitsClassifier(width=8), DigitsDataModule(batch_size=128, train_size=512)


def trainer_for(root) -> stalwart.Trainer:
    # A logger, so that each segment's Trainer has a log folder of its own.
    return stalwart.Trainer(
        max_epochs=4, callbacks=[EveryEpoch(dirpath=root / "runs")],
        logger=CSVLogger(root, name="csv"), log_every_n_steps=1, **QUIET,
    )  # fmt: skip


@pytest.fixture
def temporary(tmp_path, monkeypatch):
    """The system's temporary directory, for this test alone (forked workers inherit it)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_a_worker_killed_by_a_signal_leaves_no_temporary_folder(tmp_path, temporary):
    trainer_for(tmp_path).fit(*fresh())
    with pytest.raises(ReplayError, match="killed by SIGKILL"):
        trainer_for(tmp_path).replay(*fresh(), probe=KilledInEpoch3(), epochs=[2, 3], workers=2)
    assert list(temporary.iterdir()) == []


def test_a_parallel_replay_leaves_no_temporary_folder(tmp_path, temporary):
    trainer_for(tmp_path).fit(*fresh())
    result = trainer_for(tmp_path).replay(*fresh(), probe=GradProbe(), epochs=[2, 3], workers=2)
    assert result.mismatches == []
    assert list(temporary.iterdir()) == []
