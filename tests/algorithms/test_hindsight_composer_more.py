"""Composer Hindsight: persistent DataLoader workers are named, and a continued fit replays."""

from __future__ import annotations

import warnings

import pytest
import torch
from composer.loggers import InMemoryLogger
from composer_digits import WeightNormProbe, digits_loaders, make_trainer
from torch.utils.data import DataLoader, Dataset

import stalwart.hindsight
from stalwart.algorithms import Hindsight, replay

BATCHES = 11  # 1437 digits in batches of 128, the last short one dropped


class EveryEpoch(Hindsight):
    """Checkpoint every epoch, whatever the policy says: the tests need a fixed plan."""

    def should_checkpoint(self, state, policy_says: bool) -> bool:
        return True


class Augmented(Dataset):
    """The digits with random noise added in the worker that loads them."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        x, y = self.dataset[index]
        return x + torch.rand(x.shape) * 0.1, y


def persistent_loader() -> DataLoader:
    train, _ = digits_loaders()
    return DataLoader(
        Augmented(train.dataset),
        batch_size=128,
        shuffle=True,
        drop_last=True,
        num_workers=1,
        persistent_workers=True,
    )


def test_a_persistent_worker_loader_is_warned_of_when_the_fit_starts(tmp_path):
    trainer = make_trainer(
        epochs=1, train_dataloader=persistent_loader(), algorithms=[Hindsight(tmp_path / "a")]
    )
    with pytest.warns(UserWarning, match="training DataLoader uses persistent_workers=True"):
        trainer.fit()
    trainer.close()
    # A loader whose workers start afresh each epoch is not warned of.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(epochs=1, algorithms=[Hindsight(tmp_path / "b")]).fit()
    assert not [w for w in caught if "persistent_workers" in str(w.message)]


def test_a_replays_mismatch_names_the_persistent_workers(tmp_path):
    hindsight = EveryEpoch(tmp_path)

    def factory(**overrides):
        args = {"train_dataloader": persistent_loader(), "algorithms": [hindsight]}
        return make_trainer(epochs=2, **{**args, **overrides})

    with pytest.warns(UserWarning, match="persistent_workers=True"):
        factory().fit()
    with pytest.warns(UserWarning, match="does not reproduce") as caught:
        result = replay(factory, probe=WeightNormProbe(), epochs=[1], workers=1)
    assert result.mismatches
    said = " ".join(str(w.message) for w in caught if "does not reproduce" in str(w.message))
    assert "The training DataLoader keeps its worker processes" in said
    assert "try init='strong'" not in said


def test_a_fit_continued_on_the_same_trainer_replays_its_first_epoch(tmp_path):
    hindsight = EveryEpoch(tmp_path)

    def factory(**overrides):
        return make_trainer(epochs=2, **{"algorithms": [hindsight], **overrides})

    trainer = factory()
    trainer.fit()
    trainer.fit(duration="2ep")  # on to epoch 4: a second run, starting at epoch 2
    run = stalwart.hindsight.open(tmp_path).run()
    assert run.name == "run_0002"
    initial, *after = run.checkpoints(include_initial=True)
    assert (initial.epoch, initial.step) == (-1, 2 * BATCHES)  # the continued fit's start
    assert [c.epoch for c in after] == [2, 3]

    result = replay(factory, probe=WeightNormProbe(), epochs=[2], workers=1)
    assert [s.resume_from for s in result.segments] == [-1]
    assert result.mismatches == []
    # The same two fits, seeded alike, with the probe attached from the start.
    memory = InMemoryLogger()
    rerun = make_trainer(epochs=2, callbacks=[WeightNormProbe()], loggers=[memory])
    rerun.fit()
    rerun.fit(duration="2ep")
    truth = [float(v) for _, v in memory.data["probe/weight_norm"]]
    assert result.metrics("probe/weight_norm").value.tolist() == truth[2 * BATCHES : 3 * BATCHES]
