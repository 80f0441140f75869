"""A damaged hindsight.db is said as such (which file, what still works), never a raw sqlite3
error; and opening a record to read or replay never writes over the user's file."""

from __future__ import annotations

import shutil

import pytest
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart import HindsightCallback
from stalwart.errors import CorruptStoreError, RunDirectoryError
from stalwart.hindsight.store import DB_NAME, HindsightStore
from tests.helpers import QUIET


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    trainer = stalwart.Trainer(
        max_epochs=2, callbacks=[HindsightCallback(dirpath=root)], log_every_n_steps=1, **QUIET
    )
    trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=32, train_size=640))
    return root


def damaged(record, tmp_path, keep: float, overwrite: bool = False):
    """A copy of the record whose database keeps the first ``keep`` of its bytes, the rest cut
    off or ``overwrite``n with garbage (its WAL gone, as a copy made without it would be)."""
    copy = shutil.copytree(record, tmp_path / "copy")
    for side in ("-wal", "-shm"):
        (copy / f"{DB_NAME}{side}").unlink(missing_ok=True)
    db = copy / DB_NAME
    data = db.read_bytes()
    kept = int(len(data) * keep)
    db.write_bytes(data[:kept] + (b"\xff" * (len(data) - kept) if overwrite else b""))
    return copy


@pytest.mark.parametrize(
    ("keep", "overwrite"),
    [(0.0, False), (0.3, False), (0.6, True)],
    # The last: the runs table reads fine; a later read (of the checkpoint index) meets it.
    ids=["empty", "truncated", "tail_overwritten"],
)
def test_reading_a_damaged_record_says_which_file_is_damaged(record, tmp_path, keep, overwrite):
    copy = damaged(record, tmp_path, keep, overwrite)
    size = (copy / DB_NAME).stat().st_size
    with pytest.raises(CorruptStoreError) as info:
        # The damage shows on opening or on the first read of a page it reached.
        for run in stalwart.hindsight.open(copy).runs():
            run.metrics("train_loss")
            run.decisions()
            run.checkpoints()
    said = str(info.value)
    assert f"{copy / DB_NAME} is damaged" in said and "checkpoint files" in said
    assert isinstance(info.value, RunDirectoryError)  # what callers of a bad directory catch
    assert (copy / DB_NAME).stat().st_size == size  # read, never written to


def test_a_replay_of_an_empty_database_leaves_the_file_as_it_was(record, tmp_path):
    copy = damaged(record, tmp_path, 0.0)
    trainer = stalwart.Trainer(max_epochs=2, callbacks=[HindsightCallback(dirpath=copy)], **QUIET)
    with pytest.raises(CorruptStoreError, match="it is empty"):
        trainer.replay(DigitsClassifier(width=8), DigitsDataModule(batch_size=32, train_size=640))
    assert (copy / DB_NAME).stat().st_size == 0
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith(DB_NAME)) == [DB_NAME]


def test_a_new_record_still_starts_in_an_empty_directory_and_over_a_torn_creation(tmp_path):
    with HindsightStore(tmp_path / "new", create=True) as store:
        assert store.runs() == []
    # A creation cut short leaves an empty file: recording there starts the database afresh.
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / DB_NAME).write_bytes(b"")
    with HindsightStore(torn, create=True) as store:
        store.begin_run(hparams={}, fingerprints={}, config={})
        assert [run.name for run in store.runs()] == ["run_0001"]
