"""A fit resumed with ``ckpt_path`` writes no ``init.ckpt``: its first epochs replay from the
checkpoint it resumed from, whether the record's own or a ModelCheckpoint's file."""

from __future__ import annotations

import json
import shutil
import warnings

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import ModelCheckpoint

import stalwart
from stalwart import HindsightCallback, ReplayError
from stalwart.hindsight.store import RESUMED_FILE_KEY
from stalwart.rng import RNG_KEY
from tests.helpers import QUIET, GradProbe

BATCHES = 4  # 512 training samples / 128


class OddEpochs(HindsightCallback):
    """Checkpoints after epochs 1, 3, ...: a resumed run's first epoch has none before it."""

    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return trainer.current_epoch % 2 == 1


def fresh():
    L.seed_everything(11)
    return DigitsClassifier(width=32), DigitsDataModule(batch_size=128, train_size=512)


def replayer(dirpath) -> stalwart.Trainer:
    return stalwart.Trainer(callbacks=[OddEpochs(dirpath=dirpath)], deterministic=True, **QUIET)


def fit(trainer_class, dirpath, epochs, ckpt_path=None, callbacks=()):
    quiet = {**QUIET, "enable_checkpointing": bool(callbacks)}
    trainer = trainer_class(
        max_epochs=epochs, callbacks=[OddEpochs(dirpath=dirpath), *callbacks],
        deterministic=True, **quiet,
    )  # fmt: skip
    trainer.fit(*fresh(), ckpt_path=ckpt_path)


def test_a_resumed_runs_first_epochs_replay_from_the_records_checkpoint(tmp_path):
    fit(stalwart.Trainer, tmp_path, epochs=3)  # run_0001: checkpoints before epoch 0, after 1
    resumed_from = stalwart.hindsight.open(tmp_path).run().checkpoint(1).path
    # A plain Lightning Trainer notes no file: the record's own checkpoint is found by the state
    # the resumed run names (run_0001 after epoch 1).
    fit(L.Trainer, tmp_path, epochs=5, ckpt_path=resumed_from)  # run_0002: epochs 2..4
    run = stalwart.hindsight.open(tmp_path).run()
    assert run.resumed_from.endswith("#run_0001@epoch=1")
    assert [c.epoch for c in run.checkpoints(include_initial=True)] == [3]

    plan = replayer(tmp_path).replay(*fresh(), probe=GradProbe(), workers=2, dry_run=True)
    assert [s.segment.resume_from for s in plan.segments] == [1, 3]
    assert "run_0001/epoch=0001.ckpt" in str(plan)

    result = replayer(tmp_path).replay(*fresh(), probe=GradProbe(), workers=2)
    assert [s.resume_from for s in result.segments] == [1, 3]  # in parallel workers
    assert result.mismatches == []  # train_loss, val_loss and val_acc of epochs 2..4 exactly
    assert sorted(set(result.batch_epochs)) == [2, 3, 4]
    grad_norm = result.metrics("grad_norm")
    assert grad_norm.groupby("epoch").size().to_dict() == dict.fromkeys([2, 3, 4], BATCHES)


@pytest.fixture(scope="module")
def resumed_from_modelcheckpoint(tmp_path_factory):
    """run_0001 fits 3 epochs beside a ModelCheckpoint; run_0002 (a stalwart.Trainer) and
    run_0003 (a Lightning Trainer) resume from its file of epoch 2, which the record lacks."""
    root = tmp_path_factory.mktemp("record")
    saved = ModelCheckpoint(dirpath=root / "lightning", filename="{epoch}", save_top_k=-1)
    fit(stalwart.Trainer, root / "record", epochs=3, callbacks=[saved])
    with warnings.catch_warnings():  # the resumed fits go on without the ModelCheckpoint
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
        for trainer_class in (stalwart.Trainer, L.Trainer):
            fit(trainer_class, root / "record", 5, ckpt_path=root / "lightning/epoch=2.ckpt")
    return root


def test_a_fit_resumed_from_a_modelcheckpoint_file_replays_from_that_file(
    resumed_from_modelcheckpoint,
):
    root = resumed_from_modelcheckpoint
    plain = root / "lightning/epoch=2.ckpt"
    assert RNG_KEY not in torch.load(plain, weights_only=False)  # Lightning's own file
    record = root / "record"

    result = replayer(record).replay(*fresh(), probe=GradProbe(), run="run_0002", epochs=[3])
    assert [s.resume_from for s in result.segments] == [2]
    assert result.mismatches == []  # bit for bit, as the resumed fit ran on
    assert result.metrics("grad_norm").epoch.tolist() == [3] * BATCHES

    # The fit noted the file's size and CRC-32: a different file under its name is refused...
    shutil.copy(root / "lightning/epoch=1.ckpt", plain)
    with pytest.raises(ReplayError, match="run_0002 resumed from the state after epoch 2") as info:
        replayer(record).replay(*fresh(), probe=GradProbe(), run="run_0002", epochs=[3])
    assert f"in {plain}, which no longer holds that state" in str(info.value)
    # ... so is a deleted one, by name; epochs after the run's own checkpoint still replay.
    plain.unlink()
    with pytest.raises(ReplayError, match="which is gone") as info:
        replayer(record).replay(*fresh(), probe=GradProbe(), run="run_0002", epochs=[3])
    assert f"in {plain}, which is gone" in str(info.value)
    assert "Replay epochs from 4 on" in str(info.value)
    later = replayer(record).replay(*fresh(), probe=GradProbe(), run="run_0002", epochs=[4])
    assert later.mismatches == [] and sorted(set(later.batch_epochs)) == [4]


def test_a_plain_lightning_trainer_notes_the_file_too(resumed_from_modelcheckpoint):
    # The recording callback notes the file, whichever Trainer runs the fit (run_0002's test
    # replays from such a note; the fixture's file may be gone by now).
    root = resumed_from_modelcheckpoint
    with stalwart.hindsight.open(root / "record") as store:
        notes = {
            name: json.loads(text).get(RESUMED_FILE_KEY)
            for name, text in store._conn.execute("SELECT name, config FROM runs")
        }
    assert notes["run_0001"] is None
    assert notes["run_0002"]["path"] == notes["run_0003"]["path"]
    assert notes["run_0003"]["path"] == str((root / "lightning/epoch=2.ckpt").resolve())
    assert notes["run_0002"]["crc32"] == notes["run_0003"]["crc32"]


def test_a_resume_from_a_file_nobody_noted_is_refused_saying_why(resumed_from_modelcheckpoint):
    # A record made before files were noted: only the state's name is known.
    record = resumed_from_modelcheckpoint / "record"
    with stalwart.hindsight.open(record) as store:
        (text,) = store._conn.execute("SELECT config FROM runs WHERE name = 'run_0003'").fetchone()
        config = json.loads(text)
        del config[RESUMED_FILE_KEY]
        store._conn.execute(
            "UPDATE runs SET config = ? WHERE name = 'run_0003'", (json.dumps(config),)
        )
    with pytest.raises(ReplayError, match="no checkpoint before epoch 3") as info:
        replayer(record).replay(*fresh(), probe=GradProbe(), run="run_0003", epochs=[3])
    said = str(info.value)
    assert "run_0003 resumed from the state after epoch 2 of run_0001" in said
    assert "holds no checkpoint of it" in said and "did not note the file" in said
