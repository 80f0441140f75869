"""A memoized epoch that ``max_steps`` ended before its last batch validates as the record did.

The record's last epoch stops after 2 of its 4 batches: Lightning runs no validation there (that
batch is no validation check batch). An outer-loop replay memoizing that epoch used to validate
as at a full epoch's end: an extra ``val_loss`` and a ``ModelCheckpoint`` ranking it, unflagged.
"""

from __future__ import annotations

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from tests.helpers import QUIET, EpochProbe, EveryEpoch

BATCHES = 4  # 512 training samples / 128
MAX_STEPS = 4 * BATCHES + 2  # epoch 4 stops after 2 batches


class ValidationProbe(L.Callback):
    """Outer-loop: logs at every validation's end (so only where one ran)."""

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("validated", float(trainer.global_step))


def fresh():
    L.seed_everything(5)
    return DigitsClassifier(width=16), DigitsDataModule(batch_size=128, train_size=512)


def trainer_for(dirpath, probes=()) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=-1, max_steps=MAX_STEPS, callbacks=[EveryEpoch(dirpath=dirpath), *probes],
        deterministic=True, **QUIET,
    )  # fmt: skip


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = tmp_path_factory.mktemp("max-steps-validation")
    trainer = trainer_for(root)
    trainer.fit(*fresh())
    assert trainer.global_step == MAX_STEPS
    return root


def test_the_memoized_last_epoch_runs_no_validation(record):
    run = stalwart.hindsight.open(record).run()
    assert sorted(set(run.metrics("val_loss").epoch)) == [0, 1, 2, 3]  # none in epoch 4
    result = trainer_for(record).replay(*fresh(), probe=[EpochProbe(), ValidationProbe()])
    assert result.mismatches == []
    assert result.metrics("w_norm").epoch.tolist() == [0, 1, 2, 3, 4]
    assert result.metrics("validated").epoch.tolist() == [0, 1, 2, 3]
