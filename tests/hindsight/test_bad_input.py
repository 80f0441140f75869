"""Bad input: every case raises a clear StalwartError that says what to do, and touches nothing.

Each test snapshots the names and bytes of everything involved beforehand and compares afterwards:
stalwart must never delete, overwrite or add to what is not its own.
"""

from __future__ import annotations

import math
import os
import shutil
import sqlite3
from pathlib import Path

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart import (
    ConfigurationError,
    CorruptCheckpointError,
    HindsightCallback,
    RunDirectoryError,
    RunNotFoundError,
    StalwartError,
)
from tests.helpers import QUIET


class EveryEpoch(HindsightCallback):
    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return True


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Names (hidden ones included) and bytes of everything under ``root``; None for folders."""
    if root.is_file():
        return {".": root.read_bytes()}
    return {
        str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def _assert_says(exc: BaseException, *fragments: str) -> None:
    assert isinstance(exc, StalwartError)
    message = str(exc)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in message: {message}"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A short real recording: 2 epochs of the digits workload, a checkpoint after each."""
    dirpath = tmp_path_factory.mktemp("recorded") / "runs"
    trainer = L.Trainer(
        max_epochs=2,
        callbacks=[EveryEpoch(dirpath=dirpath)],
        accelerator="cpu",
        **QUIET,
    )
    trainer.fit(DigitsClassifier(width=32), DigitsDataModule())
    return dirpath


@pytest.fixture
def recorded_copy(recorded, tmp_path) -> Path:
    return Path(shutil.copytree(recorded, tmp_path / "runs"))


# -- the run directory -------------------------------------------------------------------------


def _empty_unwritable_proc_dir() -> str:
    path = "/proc/sys/fs/binfmt_misc"  # an empty procfs folder in which no file can be created
    return path if os.path.isdir(path) and not os.listdir(path) else ""


@pytest.mark.parametrize(
    "dirpath",
    [
        "/proc/stalwart-hindsight-test",
        "/proc/stalwart-hindsight-test/nested/runs",
        pytest.param(
            _empty_unwritable_proc_dir(),
            id="existing-empty-procfs-dir",
            marks=pytest.mark.skipif(
                not _empty_unwritable_proc_dir(), reason="no empty procfs folder here"
            ),
        ),
    ],
)
def test_unwritable_dirpath(dirpath):
    existed = os.path.exists(dirpath)
    before = sorted(os.listdir(dirpath)) if existed else None
    with pytest.raises(RunDirectoryError) as info:
        HindsightCallback(dirpath=dirpath)
    _assert_says(info.value, dirpath, "is not writable", "pass a directory you can write to")
    assert isinstance(info.value, OSError)
    assert os.path.exists(dirpath) == existed
    if existed:
        assert sorted(os.listdir(dirpath)) == before


def test_dirpath_is_a_regular_file(tmp_path):
    target = tmp_path / "runs"
    target.write_bytes(b"my notes, not a run directory\n")
    before = _snapshot(tmp_path)
    with pytest.raises(RunDirectoryError) as info:
        HindsightCallback(dirpath=target)
    _assert_says(info.value, str(target), "is not a directory", "pass a directory")
    with pytest.raises(RunNotFoundError) as info:
        stalwart.hindsight.open(target)
    _assert_says(info.value, "no hindsight record", "HindsightCallback(dirpath=...)")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("below", ["runs", "a/b/runs"])
def test_dirpath_under_a_regular_file(tmp_path, below):
    blocker = tmp_path / "notes.txt"
    blocker.write_bytes(b"a regular file where a folder would have to be\n")
    before = _snapshot(tmp_path)
    dirpath = blocker / below
    with pytest.raises(RunDirectoryError) as info:
        HindsightCallback(dirpath=dirpath)
    _assert_says(info.value, str(dirpath), "is not writable", "pass a directory you can write to")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["runs#1", "runs?x=1", "runs%41"])
def test_dirpath_with_uri_characters_stays_usable(tmp_path, name):
    dirpath = tmp_path / name
    L.Trainer(
        max_epochs=1,
        callbacks=[HindsightCallback(dirpath=dirpath)],
        accelerator="cpu",
        **QUIET,
        limit_train_batches=2,
        limit_val_batches=1,
    ).fit(DigitsClassifier(width=16), DigitsDataModule())
    before = _snapshot(tmp_path)
    problems = []
    try:
        with stalwart.hindsight.open(dirpath) as store:
            assert [run.name for run in store.runs()] == ["run_0001"]
        HindsightCallback(dirpath=dirpath)  # a second fit into the same directory
    except StalwartError as exc:
        problems.append(f"its own record is refused: {type(exc).__name__}: {exc}")
    appeared = sorted(set(_snapshot(tmp_path)) - set(before))
    if appeared:
        problems.append(f"files appeared next to the run directory: {appeared}")
    assert not problems, problems


def test_foreign_directory_without_database(tmp_path):
    foreign = tmp_path / "project"
    (foreign / "data").mkdir(parents=True)
    (foreign / "data" / "train.csv").write_bytes(b"x,y\n1,2\n")
    (foreign / ".config").write_bytes(b"secret=1\n")
    (foreign / "run_0001").mkdir()  # looks like ours, is not: there is no hindsight.db
    (foreign / "run_0001" / "epoch=0000.ckpt").write_bytes(b"someone else's file")
    before = _snapshot(foreign)
    with pytest.raises(RunDirectoryError) as info:
        HindsightCallback(dirpath=foreign)
    _assert_says(
        info.value,
        str(foreign),
        "already holds files and no hindsight.db",
        "Pass a new or empty directory",
    )
    with pytest.raises(RunNotFoundError) as info:
        stalwart.hindsight.open(foreign)
    _assert_says(info.value, "no hindsight record", "record a run there")
    assert _snapshot(foreign) == before


def _foreign_database(path: Path, journal_mode: str, application_id: int) -> None:
    conn = sqlite3.connect(path)
    try:
        assert conn.execute(f"PRAGMA journal_mode = {journal_mode}").fetchone()[0] == journal_mode
        conn.execute(f"PRAGMA application_id = {application_id}")
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, amount REAL)")
        conn.executemany("INSERT INTO invoices (amount) VALUES (?)", [(9.5,), (12.0,)])
        conn.commit()
    finally:
        conn.close()  # the last connection: a WAL database folds its -wal back in and removes it


@pytest.mark.parametrize(
    ("journal_mode", "application_id"),
    [
        pytest.param("delete", 0, id="rollback-journal"),
        pytest.param("delete", 0x4D594150, id="other-application-id"),
        pytest.param("wal", 0, id="wal"),
    ],
)
def test_foreign_sqlite_database(tmp_path, journal_mode, application_id):
    foreign = tmp_path / "app"
    foreign.mkdir()
    _foreign_database(foreign / "hindsight.db", journal_mode, application_id)
    (foreign / "run_0001").mkdir()
    (foreign / "run_0001" / "data.bin").write_bytes(b"\x00\x01")
    before = _snapshot(foreign)
    assert set(before) == {"hindsight.db", "run_0001", "run_0001/data.bin"}

    with pytest.raises(RunDirectoryError) as info:
        HindsightCallback(dirpath=foreign)
    _assert_says(
        info.value,
        "SQLite database of another application",
        "will not touch it",
        "Point dirpath at a new or empty directory",
    )
    with pytest.raises(RunDirectoryError) as info:
        stalwart.hindsight.open(foreign)
    _assert_says(info.value, "SQLite database of another application")

    assert _snapshot(foreign) == before
    conn = sqlite3.connect(f"file:{foreign / 'hindsight.db'}?immutable=1", uri=True)
    try:
        assert conn.execute("SELECT amount FROM invoices ORDER BY id").fetchall() == [
            (9.5,),
            (12.0,),
        ]
    finally:
        conn.close()


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"just some text, not a database\n" * 64, id="text"),
        pytest.param(b"SQLite format 3\x00" + b"\xff" * 4080, id="sqlite-header-then-garbage"),
        pytest.param(bytes(range(256)) * 32, id="binary"),
    ],
)
def test_database_file_that_is_not_sqlite(tmp_path, content):
    dirpath = tmp_path / "runs"
    dirpath.mkdir()
    (dirpath / "hindsight.db").write_bytes(content)
    before = _snapshot(dirpath)
    db = str(dirpath / "hindsight.db")
    for attempt in (
        lambda: HindsightCallback(dirpath=dirpath),
        lambda: stalwart.hindsight.open(dirpath),
    ):
        with pytest.raises(RunDirectoryError) as info:
            attempt()
        _assert_says(info.value, db)
        assert "point dirpath at a new or empty directory" in str(info.value).lower()
        if not content.startswith(b"SQLite format 3\x00"):
            _assert_says(info.value, "is not a stalwart hindsight database")
    assert _snapshot(dirpath) == before


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [0, 1, -0.1, 1.5, "x", math.nan, None, True])
def test_epsilon_outside_zero_one(tmp_path, epsilon):
    dirpath = tmp_path / "runs"
    with pytest.raises(ConfigurationError) as info:
        HindsightCallback(dirpath=dirpath, epsilon=epsilon)
    _assert_says(info.value, f"epsilon={epsilon!r}", "pass a fraction in (0, 1)")
    assert isinstance(info.value, ValueError)
    assert not dirpath.exists(), "a rejected configuration must not create the run directory"


@pytest.mark.parametrize("ratio", [-1.0, math.inf, math.nan])
def test_a_restore_ratio_that_is_no_finite_cost_is_refused_before_the_fit(tmp_path, ratio):
    # inf was accepted and the fit crashed at its first epoch end (a division by zero).
    dirpath = tmp_path / "runs"
    with pytest.raises(ConfigurationError) as info:
        HindsightCallback(dirpath=dirpath, restore_ratio=ratio)
    _assert_says(info.value, f"restore_ratio={ratio!r}", "finite number >= 0")
    assert not dirpath.exists()


def test_bad_epsilon_leaves_an_existing_record_alone(recorded_copy):
    before = _snapshot(recorded_copy)
    with pytest.raises(ConfigurationError):
        HindsightCallback(dirpath=recorded_copy, epsilon=2.0)
    assert _snapshot(recorded_copy) == before


@pytest.mark.parametrize("kind", ["bogus", "Fork", "thread", ""])
def test_unknown_materializer(tmp_path, kind):
    dirpath = tmp_path / "runs"
    dirpath.mkdir()
    with pytest.raises(ConfigurationError) as info:
        HindsightCallback(dirpath=dirpath, materializer=kind)
    _assert_says(info.value, f"materializer={kind!r} is not known", "'fork'", "'inline'")
    assert list(dirpath.iterdir()) == []


def test_unknown_materializer_creates_nothing(tmp_path):
    dirpath = tmp_path / "runs"
    with pytest.raises(ConfigurationError):
        HindsightCallback(dirpath=dirpath, materializer="bogus")
    assert not dirpath.exists(), "a rejected configuration must not create the run directory"


# -- reading a record --------------------------------------------------------------------------


def test_corrupted_checkpoint_is_refused_and_left_as_it_was(recorded_copy):
    with stalwart.hindsight.open(recorded_copy) as store:
        first, last = store.run().checkpoints()
    data = bytearray(last.path.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    last.path.write_bytes(bytes(data))
    before = _snapshot(recorded_copy)

    with stalwart.hindsight.open(recorded_copy) as store:
        (entry,) = [e for e in store.run().checkpoints() if e.epoch == last.epoch]
        assert (entry.nbytes, entry.crc32) == (last.nbytes, last.crc32)
        with pytest.raises(CorruptCheckpointError) as info:
            entry.load()
        _assert_says(
            info.value,
            str(last.path),
            "is corrupted",
            f"expected {last.nbytes} bytes",
            "CRC-32",
            "use an earlier checkpoint",
        )
        assert first.load()["global_step"] == first.step  # the intact one still loads
        assert [e.epoch for e in store.run().checkpoints()] == [first.epoch, last.epoch]

    assert _snapshot(recorded_copy) == before, "loading must neither repair nor remove anything"
    assert last.path.read_bytes() == bytes(data)


@pytest.mark.parametrize("make", [False, True], ids=["missing", "empty"])
def test_open_a_directory_without_a_record(tmp_path, make):
    dirpath = tmp_path / "nothing-here"
    if make:
        dirpath.mkdir()
    with pytest.raises(RunNotFoundError) as info:
        stalwart.hindsight.open(dirpath)
    _assert_says(info.value, str(dirpath), "no hindsight record", "HindsightCallback(dirpath=...)")
    assert isinstance(info.value, LookupError)
    assert dirpath.exists() == make
    if make:
        assert list(dirpath.iterdir()) == []


def test_unknown_metric_run_and_checkpoint(recorded_copy):
    before = _snapshot(recorded_copy)
    with stalwart.hindsight.open(recorded_copy) as store:
        run = store.run()
        with pytest.raises(RunNotFoundError) as info:
            run.metrics("nope")
        _assert_says(info.value, "'nope'", "it logged: train_loss, val_acc, val_loss")
        assert isinstance(info.value, LookupError)
        with pytest.raises(RunNotFoundError) as info:
            store.run("run_0042")
        _assert_says(info.value, "'run_0042'", "recorded runs: run_0001")
        with pytest.raises(RunNotFoundError) as info:
            run.checkpoint(99)
        _assert_says(info.value, "no checkpoint of epoch 99", "it has [0, 1]")
        assert not run.metrics("train_loss").empty  # what exists is still readable
    assert _snapshot(recorded_copy) == before
