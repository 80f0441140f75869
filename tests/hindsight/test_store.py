"""The hindsight store: every logged value, the run manifest, and the query API."""

from __future__ import annotations

import sqlite3

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart import HindsightCallback
from stalwart.hindsight.fingerprint import hook_fingerprints
from tests.helpers import QUIET, fit_digits


class CountingClassifier(DigitsClassifier):
    """Also logs through log_dict and from an epoch-level hook, and counts its calls."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = {"train": 0, "val": 0}

    def training_step(self, batch, batch_idx):
        self.calls["train"] += 1
        loss = super().training_step(batch, batch_idx)
        self.log_dict({"batch_idx": float(batch_idx), "double_loss": loss * 2})
        return loss

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self.calls["val"] += 1
        super().validation_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.log("epoch_marker", float(self.current_epoch))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    L.seed_everything(0)
    model = CountingClassifier(width=32, lr=0.05)
    trainer = L.Trainer(
        max_epochs=3,
        callbacks=[HindsightCallback(dirpath=root)],
        num_sanity_val_steps=2,
        **QUIET,
    )
    trainer.fit(model, DigitsDataModule(batch_size=200, train_size=1000))
    return root, model


def test_every_log_call_is_stored_once_with_epoch_and_step(recorded):
    root, model = recorded
    run = stalwart.hindsight.open(root).run()
    train = run.metrics("train_loss")
    assert len(train) == model.calls["train"] == 15  # 5 batches x 3 epochs
    assert train.step.tolist() == list(range(15))
    assert train.epoch.tolist() == [e for e in range(3) for _ in range(5)]
    assert set(train.source) == {"record"} and set(train.hook) == {"training_step"}
    # log_dict goes through log; values are what was passed, bit for bit.
    doubled = run.metrics("double_loss").value.to_numpy()
    losses = torch.tensor(train.value.to_numpy(), dtype=torch.float32)
    assert (doubled == (losses * 2).numpy()).all()
    # Validation: 2 values per batch, sanity check excluded (Lightning discards it too).
    assert len(run.metrics("val_loss")) == model.calls["val"] == 6
    assert run.metrics("epoch_marker").value.tolist() == [0.0, 1.0, 2.0]


def test_manifest_holds_hparams_fingerprints_decisions_and_checkpoints(recorded):
    root, model = recorded
    store = stalwart.hindsight.open(root)
    (run,) = store.runs()
    assert run.status == "completed" and run.name == "run_0001"
    assert run.hparams == {"width": 32, "depth": 1, "lr": 0.05}
    assert run.fingerprints["module"] == hook_fingerprints(model)
    assert {"training_step", "validation_step", "on_train_epoch_end"} <= set(
        run.fingerprints["module"]
    )
    assert "setup" in run.fingerprints["datamodule"]
    decisions = run.decisions()
    assert decisions.epoch.tolist() == [0, 1, 2]
    assert decisions.n.tolist() == [1, 2, 3]
    taken = decisions[decisions.checkpoint == 1]
    assert taken.measured_cost.notna().all()
    assert [c.epoch for c in run.checkpoints()] == taken.epoch.tolist()
    assert run.config["epsilon"] == pytest.approx(1 / 15)


def test_store_is_wal_sqlite_marked_as_ours(recorded):
    root, _ = recorded
    conn = sqlite3.connect(root / "hindsight.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA application_id").fetchone()[0] == 0x5354574C


def test_module_is_left_as_it_was(recorded):
    _, model = recorded
    assert "log" not in vars(model)  # the recording wrapper is removed at teardown


def test_a_second_fit_adds_a_run(recorded):
    root, _ = recorded
    fit_digits([HindsightCallback(dirpath=root)], epochs=1)
    store = stalwart.hindsight.open(root)
    assert [r.name for r in store.runs()] == ["run_0001", "run_0002"]
    assert store.run().name == "run_0002" and store.run("run_0001").run_id == 1


def test_fingerprints_change_only_with_the_edited_hook():
    class Edited(DigitsClassifier):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * 1.0

    base, edited = hook_fingerprints(DigitsClassifier()), hook_fingerprints(Edited())
    assert base["training_step"] != edited["training_step"]
    assert {k: v for k, v in base.items() if k != "training_step"} == {
        k: v for k, v in edited.items() if k != "training_step"
    }
    assert "log" not in base and "fit" not in base  # framework methods are not the user's


def test_one_callback_instance_records_two_fits_as_two_full_runs(tmp_path):
    callback = HindsightCallback(dirpath=tmp_path)
    for _ in range(2):
        fit_digits([callback], epochs=2)
    runs = stalwart.hindsight.open(tmp_path).runs()
    assert [len(run.decisions()) for run in runs] == [2, 2]
    assert [sorted(set(run.metrics("train_loss").epoch)) for run in runs] == [[0, 1], [0, 1]]
