"""Replay's deferred correctness check, pseudoresume, and its refusal of bad input."""

from __future__ import annotations

import hashlib

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart import ConfigurationError, HindsightCallback, ReplayError
from tests.helpers import QUIET, GradProbe


class EveryEpoch(HindsightCallback):
    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return True


class HiddenState(DigitsClassifier):
    """Keeps a loss scale in a plain attribute: stateful, but outside every checkpoint."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.scale = 1.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y) * self.scale
        self.log("scaled_loss", loss)
        return loss

    def on_train_epoch_end(self) -> None:
        self.scale *= 0.5


def make_trainer(dirpath, epochs=6) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=epochs,
        callbacks=[EveryEpoch(dirpath=dirpath)],
        deterministic=True,
        **QUIET,
    )


def fresh(cls=HiddenState, **kwargs):
    L.seed_everything(5)
    return cls(width=32, **kwargs), DigitsDataModule(batch_size=128, train_size=512)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    make_trainer(root).fit(*fresh())
    return root


def test_state_left_out_of_the_checkpoint_is_reported_by_the_deferred_check(record):
    with pytest.warns(UserWarning, match="does not reproduce"):
        result = make_trainer(record).replay(*fresh(), probe=GradProbe(), epochs=[4, 5])
    names = {(m.name, m.epoch) for m in result.mismatches}
    assert ("scaled_loss", 4) in names and ("scaled_loss", 5) in names
    first = next(m for m in result.mismatches if (m.name, m.epoch) == ("scaled_loss", 4))
    assert len(first.recorded) == len(first.replayed) == 4
    assert first.recorded != first.replayed


def test_strong_init_rebuilds_what_the_checkpoint_missed(record):
    result = make_trainer(record).replay(*fresh(), probe=GradProbe(), epochs=[4, 5], init="strong")
    assert result.mismatches == []
    assert sorted(set(result.batch_epochs)) == [4, 5]  # epochs 0-3 memoized, not re-trained


def snapshot(root):
    return {
        p.relative_to(root): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith("hindsight.db")
    }


def recorded_rows(root):
    return stalwart.hindsight.open(root).query(
        "SELECT * FROM metrics WHERE source = 'record' ORDER BY rowid"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"run": "run_0042"}, stalwart.RunNotFoundError, "no run 'run_0042'"),
        ({"epochs": [5, 6, 7]}, ReplayError, "epochs [6, 7] are not in run_0001"),
        ({"epochs": [-2]}, ReplayError, "not in run_0001"),
        ({"probe": "grad_norm"}, ConfigurationError, "is not a Lightning Callback"),
        ({"probe": [GradProbe(), print]}, ConfigurationError, "FunctionProbe"),
        ({"workers": 0}, ConfigurationError, "workers=0"),
        ({"init": "medium"}, ConfigurationError, "init='medium'"),
    ],
)
def test_bad_replay_requests_fail_before_any_work(record, kwargs, error, says):
    before, rows = snapshot(record), recorded_rows(record)
    with pytest.raises(error) as info:
        make_trainer(record).replay(*fresh(), **{"probe": GradProbe(), **kwargs})
    assert says in str(info.value)
    assert snapshot(record) == before
    assert recorded_rows(record).equals(rows)
    assert stalwart.hindsight.open(record).query("SELECT * FROM replay_work WHERE 0").empty


def test_a_different_model_is_refused(record):
    before = snapshot(record)
    model, data = fresh(DigitsClassifier, depth=2)
    with pytest.raises(ReplayError, match="recorded from a different model"):
        make_trainer(record).replay(model, data, probe=GradProbe())
    assert snapshot(record) == before


def test_replay_without_a_hindsight_callback_says_what_to_add():
    trainer = stalwart.Trainer(logger=False, enable_checkpointing=False)
    with pytest.raises(ConfigurationError, match="add HindsightCallback"):
        trainer.replay(*fresh())


def test_replay_adds_rows_and_never_changes_the_record(record):
    before, rows = snapshot(record), recorded_rows(record)
    with pytest.warns(UserWarning, match="does not reproduce"):  # the hidden scale, as above
        make_trainer(record).replay(*fresh(), probe=GradProbe(), epochs=[1])
    assert snapshot(record) == before
    assert recorded_rows(record).equals(rows)
