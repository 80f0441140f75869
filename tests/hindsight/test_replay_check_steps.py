"""The deferred check compares values by step, counts what memoized epochs do not re-run, reports
epochs that ran short, and names the likely cause of a mismatch."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from torch.utils.data import DataLoader, Dataset

import stalwart
from stalwart.hindsight.check import BatchMismatch, Mismatch
from tests.helpers import QUIET, EpochProbe, EveryEpoch, GradProbe

BATCHES = 4  # 512 training samples / 128


def trainer(dirpath, **kwargs) -> stalwart.Trainer:
    kwargs = {"max_epochs": 3, "deterministic": True, **QUIET, **kwargs}
    return stalwart.Trainer(callbacks=[EveryEpoch(dirpath=dirpath)], **kwargs)


def fresh(cls=DigitsClassifier, data=DigitsDataModule):
    L.seed_everything(4)
    return cls(width=32), data(batch_size=128, train_size=512)


def reproduce_warning(caught) -> str:
    """The deferred check's warning among those caught (Lightning may warn about loaders)."""
    return next(str(w.message) for w in caught if "does not reproduce" in str(w.message))


def record(dirpath, *made, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a persistent-workers record is warned about)
        trainer(dirpath, **kwargs).fit(*made)


def test_mid_epoch_validation_of_a_memoized_epoch_is_counted_not_a_mismatch(tmp_path):
    record(tmp_path, *fresh(), val_check_interval=0.5)  # validates after batch 2 and batch 4
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*does not reproduce")
        result = trainer(tmp_path, val_check_interval=0.5).replay(
            *fresh(), probe=EpochProbe(), epochs=[1]
        )
    assert result.batches_executed == 0 and result.mismatches == []
    recorded = result.run.metrics("val_loss", source="record")
    recorded = recorded[recorded.epoch == 1]
    end = recorded.step.max()
    assert sorted(set(recorded.step)) == [end - BATCHES // 2, end]
    replayed = result.metrics("val_loss")
    assert replayed.step.tolist() == [end] * 2  # the epoch end's validation, 2 batches
    assert replayed.value.tolist() == recorded[recorded.step == end].value.tolist()
    # val_loss and val_acc of the mid-epoch validation: 2 batches each.
    assert result.not_rerun == 4
    assert "4 recorded value(s) not compared" in result.summary()


class HiddenState(DigitsClassifier):
    """Two plain attributes no checkpoint holds: a scale halved at each epoch end (epoch-level
    work, which init='strong' re-runs) and a count of training batches (which it does not)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.scale, self.seen = 1.0, 0

    def training_step(self, batch, batch_idx):
        self.seen += 1
        self.log("batches_seen", float(self.seen))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx) -> None:
        super().validation_step(batch, batch_idx)
        self.log("val_scaled", self.scale * torch.ones(()))

    def on_train_epoch_end(self) -> None:
        self.scale *= 0.5


def test_the_hint_offers_init_strong_only_where_it_can_help(tmp_path):
    record(tmp_path, *fresh(HiddenState))

    with pytest.warns(UserWarning, match="does not reproduce") as caught:
        weak = trainer(tmp_path).replay(*fresh(HiddenState), probe=EpochProbe(), epochs=[2])
    # A memoized epoch's end is still compared: the scale starts from 1.0, not 0.25.
    assert [(m.name, m.epoch) for m in weak.mismatches] == [("val_scaled", 2)]
    assert "first at step 12 (0.25 recorded, 1.0 replayed)" in str(weak.mismatches[0])
    assert "try init='strong'" in reproduce_warning(caught)

    strong = trainer(tmp_path).replay(
        *fresh(HiddenState), probe=EpochProbe(), epochs=[2], init="strong"
    )
    assert strong.mismatches == []  # epochs 0 and 1 re-ran their epoch ends

    with pytest.warns(UserWarning, match="does not reproduce") as caught:
        inner = trainer(tmp_path).replay(
            *fresh(HiddenState), probe=GradProbe(), epochs=[2], init="strong"
        )
    assert [(m.name, m.epoch) for m in inner.mismatches] == [("batches_seen", 2)]
    said = reproduce_warning(caught)
    assert "init='strong' did not rebuild it either" in said and "try init" not in said


def test_an_epoch_that_ran_short_or_not_at_all_is_a_mismatch(tmp_path):
    record(tmp_path, *fresh(), max_epochs=4)

    with pytest.warns(UserWarning, match="does not reproduce") as caught:
        short = trainer(tmp_path, max_epochs=4, limit_train_batches=2).replay(
            *fresh(), probe=GradProbe(), epochs=[2, 3]
        )
    assert short.mismatches[:2] == [
        BatchMismatch("training batches", 2, [4.0], [2.0]),
        BatchMismatch("training batches", 3, [4.0], [2.0]),
    ]
    assert str(short.mismatches[0]) == (
        "Mismatch(epoch 2 ran 2 of the 4 training batches the record ran in it)"
    )
    assert "(epoch(s) 2, 3 ran 4 of the 8 training batches the record ran in them)" in (
        short.summary()
    )
    said = reproduce_warning(caught)
    assert "limit_train_batches" in said and "init='strong'" not in said

    # Nothing ran at all (in 2 workers): before, 0 batches and 0 mismatches, a silent success.
    with pytest.warns(UserWarning, match="does not reproduce"):
        empty = trainer(tmp_path, max_epochs=4, limit_train_batches=0).replay(
            *fresh(), probe=GradProbe(), epochs=[2, 3], workers=2
        )
    assert empty.batches_executed == 0 and len(empty.segments) == 2
    assert {(m.name, m.epoch) for m in empty.mismatches} >= {
        ("training batches", 2), ("training batches", 3), ("train_loss", 2), ("val_loss", 3),
    }  # fmt: skip
    assert "ran 0 of the 8 training batches" in empty.summary()
    missing = next(m for m in empty.mismatches if (m.name, m.epoch) == ("train_loss", 2))
    assert f"{BATCHES} recorded value(s) at steps 8..11 not replayed" in str(missing)


class Jittered(Dataset):
    """Digits with random noise drawn in the worker that loads each sample."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        x, y = self.base[index]
        return x + 0.1 * torch.rand(x.shape), y


class PersistentWorkers(DigitsDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            Jittered(self.train), batch_size=self.batch_size, shuffle=True, num_workers=1,
            persistent_workers=True,
        )  # fmt: skip


def test_persistent_workers_are_named_as_the_cause_not_init_strong(tmp_path):
    record(tmp_path, *fresh(data=PersistentWorkers))
    with pytest.warns(UserWarning, match="does not reproduce") as caught:
        result = trainer(tmp_path).replay(
            *fresh(data=PersistentWorkers), probe=GradProbe(), epochs=[2]
        )
    assert any(m.differing.size for m in result.mismatches)
    said = reproduce_warning(caught)
    assert "The training DataLoader keeps its worker processes" in said
    assert "persistent_workers=False" in said and "try init='strong'" not in said


def test_a_mismatch_by_step_says_which_steps_one_side_lacks():
    recorded, replayed = [0.5] * 6, [0.5] * 8
    apart = Mismatch("train_loss", 3, recorded, replayed, list(range(24, 30)), list(range(16, 24)))
    assert repr(apart) == (
        "Mismatch('train_loss' epoch 3: 6 recorded value(s) at steps 24..29 not replayed, "
        "8 replayed value(s) at steps 16..23 not recorded)"
    )
    assert apart.differing.size == 0 and not apart.reproduced
    # Values pair up by step, the k-th at a step with the k-th: a value missing in between
    # does not shift the comparison of those after it.
    gap = Mismatch("val_loss", 1, [1.0, 2.0, 3.0], [1.0, 3.5], [4, 8, 12], [4, 12])
    assert gap.differing.tolist() == [2]
    assert "1 of 2 differ, first at step 12 (3.0 recorded, 3.5 replayed)" in repr(gap)
    assert "1 recorded value(s) at step 8 not replayed" in repr(gap)
