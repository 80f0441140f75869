"""A record resumed from a ``ModelCheckpoint`` file saved at validation end (inside the epoch's
last batch: ``save_on_train_epoch_end=False``) replays its epochs outside the inner loop.

Lightning restarts that epoch from the file mid-epoch: the record runs none of its batches and
its checkpoint of the epoch holds no state after a last batch. An outer-loop replay used to
memoize it all the same and failed with ``KeyError: 'stalwart_inner_loop_end'``.
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import ModelCheckpoint

import stalwart
from tests.helpers import QUIET, EpochProbe, EveryEpoch


def fresh():
    L.seed_everything(5)
    return DigitsClassifier(width=16), DigitsDataModule(batch_size=128, train_size=512)


def replayer(dirpath) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=4, callbacks=[EveryEpoch(dirpath=dirpath)], deterministic=True, **QUIET
    )


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """Epochs 0-1 by a plain Lightning fit saving ``last.ckpt`` at validation end; then a record
    resumed from it, checkpointing every epoch end (the restarted one's too)."""
    root = tmp_path_factory.mktemp("restarted-mid-epoch")
    saving = {**QUIET, "enable_checkpointing": True}
    last = ModelCheckpoint(root / "lightning", save_last=True, save_on_train_epoch_end=False)
    L.Trainer(max_epochs=2, callbacks=[last], deterministic=True, **saving).fit(*fresh())
    with warnings.catch_warnings():  # the resumed fit goes on without the ModelCheckpoint
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
        replayer(root / "record").fit(*fresh(), ckpt_path=root / "lightning/last.ckpt")
    return root / "record"


@pytest.mark.parametrize("workers", [1, 2])
def test_an_outer_loop_replay_runs_the_restarted_epoch_as_lightning_does(record, workers):
    work = stalwart.hindsight.open(record).run().epoch_work()
    assert dict(zip(work.epoch, work.batches, strict=True)) == {1: 0, 2: 4, 3: 4}
    result = replayer(record).replay(*fresh(), probe=EpochProbe(), workers=workers)
    assert result.mismatches == []
    assert result.metrics("w_norm").epoch.tolist() == [1, 2, 3]
