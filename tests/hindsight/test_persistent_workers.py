"""A record whose DataLoader keeps its workers (``persistent_workers=True``) warns at its start:
the workers' random state runs on from epoch to epoch where no checkpoint holds it, so a replay
from the record cannot reproduce the data bit for bit."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from digits import DigitsClassifier
from torch.utils.data import DataLoader, TensorDataset

from stalwart import HindsightCallback
from tests.helpers import QUIET

DATA = TensorDataset(torch.rand(32, 64), torch.randint(0, 10, (32,)))


def loader(persistent: bool) -> DataLoader:
    return DataLoader(DATA, batch_size=16, num_workers=1, persistent_workers=persistent)


def record(tmp_path, train: bool, val: bool, **trainer_args) -> list[str]:
    """The messages of the warnings a recorded fit gave that name persistent workers."""
    trainer_args = {"max_epochs": 1, **trainer_args}
    trainer = L.Trainer(callbacks=[HindsightCallback(dirpath=tmp_path)], **trainer_args, **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(DigitsClassifier(width=8), loader(train), loader(val))
    return [str(w.message) for w in caught if "persistent_workers" in str(w.message)]


@pytest.mark.parametrize(
    ("train", "val", "named"),
    [
        (True, False, "the training DataLoader"),
        (False, True, "the validation DataLoader"),
        (True, True, "the training and validation DataLoader"),
    ],
    ids=["training", "validation", "both"],
)
def test_a_record_with_persistent_workers_warns_once_what_to_do(tmp_path, train, val, named):
    (message,) = record(tmp_path, train, val)
    assert message.startswith(f"HindsightCallback: {named} uses persistent_workers=True")
    assert "pass persistent_workers=False" in message
    assert "\n" not in message


def test_validation_loaders_built_after_training_starts_are_checked_too(tmp_path):
    # No sanity check, and the first epoch does not validate: the loaders are built in epoch 1.
    (message,) = record(
        tmp_path, False, True, max_epochs=2, num_sanity_val_steps=0, check_val_every_n_epoch=2
    )
    assert "the validation DataLoader uses persistent_workers=True" in message


def test_workers_started_afresh_every_epoch_give_no_warning(tmp_path):
    assert record(tmp_path, False, False) == []
