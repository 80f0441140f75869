"""A dry run shows what a replay will cost, from the record's own timings, and runs nothing."""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart import HindsightCallback
from stalwart.hindsight.estimate import ReplayEstimate
from tests.helpers import QUIET, EpochProbe, GradProbe

EPOCHS = 6
BATCHES = 5  # 640 training samples / 128


class EveryThirdEpoch(HindsightCallback):
    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return trainer.current_epoch % 3 == 2


class CountingClassifier(DigitsClassifier):
    steps = 0  # training_step calls in this process

    def training_step(self, batch, batch_idx):
        type(self).steps += 1
        return super().training_step(batch, batch_idx)


def trainer_for(dirpath) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=EPOCHS, callbacks=[EveryThirdEpoch(dirpath=dirpath)], deterministic=True, **QUIET
    )


def fresh():
    L.seed_everything(3)
    return CountingClassifier(width=48), DigitsDataModule(batch_size=128, train_size=640)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    trainer_for(root).fit(*fresh())
    return root


def snapshot(root) -> dict:
    """Every file under the record (size, mtime, content hash) and the database's rows.

    SQLite's -wal/-shm files are left out: any reader of a WAL database marks its reads there.
    The database file is compared by its rows: its bytes change whenever SQLite moves the WAL
    into it, which the last connection to close does (a connection of an earlier test collected
    during this one, under load on CI), without any row written.
    """
    files = {
        str(p.relative_to(root)): (
            p.stat().st_size,
            p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.endswith(("-wal", "-shm")) and p.name != "hindsight.db"
    }
    with contextlib.closing(sqlite3.connect(root / "hindsight.db")) as db:
        rows = list(db.iterdump())
    return {"files": files, "rows": rows}


def test_the_record_keeps_each_epochs_batches_and_epoch_level_time(record):
    work = stalwart.hindsight.open(record).run().epoch_work()
    assert work.epoch.tolist() == list(range(EPOCHS))
    assert work.batches.tolist() == [BATCHES] * EPOCHS
    assert (work.epoch_level_seconds > 0).all()  # validation runs after the last batch


@pytest.mark.parametrize(
    ("probe", "epochs", "workers", "executed"),
    [
        (GradProbe, range(1, 6), 2, [0, 1, 2, 3, 4, 5]),  # inner: 0 runs to reach 1
        (EpochProbe, None, 1, [0, 1, 3, 4]),  # outer: 2 and 5 memoized from their checkpoints
        (EpochProbe, None, 2, [0, 1, 3, 4]),
    ],
    ids=["inner-2-workers", "outer-1-worker", "outer-2-workers"],
)
def test_a_dry_run_runs_and_writes_nothing_and_counts_the_batches_the_replay_runs(
    record, probe, epochs, workers, executed
):
    before = snapshot(record)
    CountingClassifier.steps = 0
    estimate = trainer_for(record).replay(
        *fresh(), probe=probe(), epochs=epochs, workers=workers, dry_run=True
    )
    assert isinstance(estimate, ReplayEstimate)
    assert CountingClassifier.steps == 0
    assert snapshot(record) == before
    assert estimate.batches_known
    assert estimate.batches == len(executed) * BATCHES
    assert estimate.seconds > 0
    text = str(estimate)
    assert f"{estimate.batches} training batches" in text and "estimated" in text
    assert len(text.splitlines()) == 2 + len(estimate.segments)

    result = trainer_for(record).replay(*fresh(), probe=probe(), epochs=epochs, workers=workers)
    assert result.batches_executed == estimate.batches
    assert sorted(set(result.batch_epochs)) == executed
    assert [s.segment for s in estimate.segments] == result.segments
    assert result.estimate is not None and result.estimate.batches == estimate.batches
    assert "estimated" in result.summary()


def test_a_dry_run_of_a_run_that_is_not_there_says_so(record):
    with pytest.raises(stalwart.errors.RunNotFoundError):
        trainer_for(record).replay(*fresh(), probe=EpochProbe(), run="run_0099", dry_run=True)


def test_the_estimate_is_made_of_what_the_record_measured(record):
    """Executed epochs cost their recorded compute time; a memoized one a restore (c x the
    checkpoint's write time) plus its recorded epoch-level time; the start a restore."""
    run = stalwart.hindsight.open(record).run()
    compute = run.decisions().set_index("epoch").compute_time
    epoch_level = run.epoch_work().set_index("epoch").epoch_level_seconds
    written = (
        run.store.query(
            "SELECT epoch, write_seconds FROM checkpoints WHERE run_id = ?", (run.run_id,)
        )
        .set_index("epoch")
        .write_seconds
    )
    c = run.config["restore_ratio"]

    outer = trainer_for(record).replay(*fresh(), probe=EpochProbe(), dry_run=True)
    expected = (
        c * written[-1]
        + compute[[0, 1, 3, 4]].sum()
        + sum(c * written[e] + epoch_level[e] for e in (2, 5))
    )
    assert outer.seconds == pytest.approx(expected, rel=1e-9)

    inner = trainer_for(record).replay(*fresh(), probe=GradProbe(), epochs=[4, 5], dry_run=True)
    assert inner.seconds == pytest.approx(c * written[2] + compute[[3, 4, 5]].sum(), rel=1e-9)
    assert inner.batches == 3 * BATCHES  # epoch 3 re-executed to reach 4 from checkpoint 2
