"""A record resumed with ``max_steps`` set from a ``ModelCheckpoint`` file saved in
``on_train_epoch_end`` (its ``last.ckpt``) replays bit for bit.

With ``max_steps`` set Lightning restarts its loops from that file inside the epoch's end: it
runs that epoch's end hooks again and no batch, and counts the epoch as processed twice. The
record used to note that epoch end as an epoch of all the batches the fit had run before it
(a replay then reported it short), to leave every later checkpoint unmarked as taken between
epochs (a replay from one started an epoch later than the record), and a replay that memoized
the epoch after it validated on a restarted validation loop (one batch instead of all).
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import ModelCheckpoint

import stalwart
from tests.helpers import QUIET, EpochProbe, EveryEpoch, GradProbe

BATCHES = 4  # 512 training samples / 128
#: The resumed fit trains epochs 2, 3 and 4 (after the restarted end of epoch 1).
MAX_STEPS = 5 * BATCHES


def fresh():
    L.seed_everything(5)
    return DigitsClassifier(width=16), DigitsDataModule(batch_size=128, train_size=512)


def replayer(dirpath) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=6, max_steps=MAX_STEPS, callbacks=[EveryEpoch(dirpath=dirpath)],
        deterministic=True, **QUIET,
    )  # fmt: skip


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """Epochs 0-1 by a plain Lightning fit saving ``last.ckpt``; then a record resumed from it
    with ``max_steps``, checkpointing every epoch end (the restarted one's too)."""
    root = tmp_path_factory.mktemp("restarted")
    saving = {**QUIET, "enable_checkpointing": True}
    last = ModelCheckpoint(dirpath=root / "lightning", save_last=True)
    L.Trainer(max_epochs=2, callbacks=[last], deterministic=True, **saving).fit(*fresh())
    with warnings.catch_warnings():  # the resumed fit goes on without the ModelCheckpoint
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
        trainer = replayer(root / "record")
        trainer.fit(*fresh(), ckpt_path=root / "lightning/last.ckpt")
    assert trainer.global_step == MAX_STEPS
    return root / "record"


def test_the_restarted_epoch_end_is_recorded_as_an_epoch_that_ran_no_batch(record):
    work = stalwart.hindsight.open(record).run().epoch_work()
    assert dict(zip(work.epoch, work.batches, strict=True)) == {1: 0, 2: 4, 3: 4, 4: 4}


def test_an_inner_loop_replay_reproduces_it_in_parallel(record):
    result = replayer(record).replay(*fresh(), probe=GradProbe(), epochs=[1, 2, 3, 4], workers=2)
    assert result.mismatches == []
    assert result.batch_epochs == [2] * BATCHES + [3] * BATCHES + [4] * BATCHES


def test_an_outer_loop_replay_memoizes_its_epochs(record):
    result = replayer(record).replay(*fresh(), probe=EpochProbe())
    assert result.mismatches == []  # val_loss of every memoized epoch: all its batches
    assert result.metrics("w_norm").epoch.tolist() == [1, 2, 3, 4]
