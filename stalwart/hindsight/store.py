"""The hindsight store: one embedded SQLite database (WAL mode) per run directory.

It holds every value a run logs (one row per ``log`` call, tagged record or replay), and each run's
manifest: hyperparameters, hook fingerprints, the policy's decision per epoch (n, k, M, C) and the
checkpoint index (epoch -> file, size, CRC-32). Checkpoint rows are written by whichever process
wrote the file, after the rename, so a row always names a complete file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from stalwart.durable import TEMP_MARKER, WrittenFile, is_temp
from stalwart.errors import CorruptStoreError, RunDirectoryError, RunNotFoundError
from stalwart.hindsight.checkpoint_file import read_checkpoint

DB_NAME = "hindsight.db"
#: SQLite's application_id header field: marks a database as ours ("STWL").
APPLICATION_ID = 0x5354574C
SCHEMA_VERSION = 1
#: The checkpoint index's epoch for the state before the first epoch (``init.ckpt``).
INITIAL_EPOCH = -1
#: A run's config key for the file a resumed fit started from: path, nbytes and crc32 then.
RESUMED_FILE_KEY = "resumed_from_file"
#: A run's config key for the record's own overhead figure, as its fit's summary printed it
#: (see :attr:`Run.overhead`); written when the record finishes.
OVERHEAD_KEY = "record_overhead"
_SQLITE_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_MS = 30_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    started REAL NOT NULL,
    finished REAL,
    status TEXT NOT NULL,
    resumed_from TEXT,
    hparams TEXT NOT NULL,
    fingerprints TEXT NOT NULL,
    config TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
    run_id INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    step INTEGER NOT NULL,
    name TEXT NOT NULL,
    value REAL,
    hook TEXT,
    source TEXT NOT NULL,
    replay_id TEXT
);
CREATE INDEX IF NOT EXISTS metrics_by_name ON metrics (run_id, name, source);
CREATE TABLE IF NOT EXISTS decisions (
    run_id INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    n INTEGER NOT NULL,
    k INTEGER NOT NULL,
    materialize_cost REAL NOT NULL,
    compute_time REAL NOT NULL,
    threshold REAL NOT NULL,
    checkpoint INTEGER NOT NULL,
    measured_cost REAL,
    interference REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, epoch)
);
CREATE TABLE IF NOT EXISTS epoch_work (
    run_id INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    batches INTEGER NOT NULL,
    epoch_level_seconds REAL NOT NULL,
    PRIMARY KEY (run_id, epoch)
);
CREATE TABLE IF NOT EXISTS replay_work (
    replay_id TEXT NOT NULL,
    run_id INTEGER NOT NULL,
    segment INTEGER NOT NULL,
    resume_from INTEGER NOT NULL,
    last_epoch INTEGER NOT NULL,
    batches INTEGER NOT NULL,
    batch_epochs TEXT NOT NULL,
    seconds REAL NOT NULL,
    PRIMARY KEY (replay_id, segment)
);
CREATE TABLE IF NOT EXISTS replays (
    replay_id TEXT PRIMARY KEY,
    run_id INTEGER NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started REAL NOT NULL,
    finished REAL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    crc32 INTEGER NOT NULL,
    write_seconds REAL NOT NULL,
    written_at REAL NOT NULL,
    PRIMARY KEY (run_id, epoch)
);
"""


def _connect(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    # Per connection: in WAL mode NORMAL survives any process crash and keeps the database
    # consistent on power loss; FULL's fsync per commit costs a checkpoint's index row ~4 ms.
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


def _check_ours(db: Path) -> None:
    """Read the SQLite header with plain file I/O: opening a foreign database, even read-only,
    could leave -wal/-shm files beside it. An empty file is ours, caught before its first write."""
    with open(db, "rb") as f:
        header = f.read(100)
    if not header:
        return
    if len(header) < 100 or header[:16] != _SQLITE_MAGIC:
        raise RunDirectoryError(
            f"{db} exists but is not a stalwart hindsight database (not SQLite); "
            "point dirpath at a new or empty directory."
        )
    app_id = int.from_bytes(header[68:72], "big")
    if app_id != APPLICATION_ID:
        raise RunDirectoryError(
            f"{db} is a SQLite database of another application; stalwart will not touch it. "
            "Point dirpath at a new or empty directory."
        )


#: SQLite's primary result codes for a file that is no longer a whole database.
_DAMAGED_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})


def damaged_store_error(db: Path, why: str) -> CorruptStoreError:
    """The error for a damaged ``hindsight.db``: what it is, and what is still usable."""
    return CorruptStoreError(
        f"{db} is damaged ({why}): the record in it cannot be read. The checkpoint files in the "
        "run_* folders beside it are files of their own that this does not touch (a fit can "
        "still resume from one of them). To record again, use a new directory, or "
        f"move this {DB_NAME} (and any -wal/-shm file beside it) away first."
    )


def _sqlite_damage(exc: BaseException) -> sqlite3.DatabaseError | None:
    """The SQLite error saying the file is damaged behind ``exc`` (pandas wraps the ones its
    queries raise), or None: a locked database or a bad query is no damage."""
    for error in (exc, exc.__cause__):
        code = getattr(error, "sqlite_errorcode", None)
        if isinstance(error, sqlite3.DatabaseError) and code is not None:
            return error if code & 0xFF in _DAMAGED_CODES else None
    return None


def _reads_the_store(method):
    """Say a damaged database as such: SQLite finds the damage only on the pages a query reads,
    so any read of a store that opened fine can meet it (otherwise a raw sqlite3 traceback)."""

    @functools.wraps(method)
    def read(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            damage = _sqlite_damage(exc)
            if damage is None:
                raise
            store = self if isinstance(self, HindsightStore) else self.store
            raise damaged_store_error(store.db_path, f"SQLite: {damage}") from exc

    return read


def _check_readable(db: Path) -> None:
    """Refuse, before SQLite opens it, a ``hindsight.db`` to read that is missing, empty or not
    ours. An empty file holds no record (a creation cut short, or a file emptied): opening it
    would make it a new, empty database."""
    if not db.is_file():
        raise RunNotFoundError(
            f"no hindsight record in {db.parent} (no {DB_NAME}); record a run there first "
            "(HindsightCallback(dirpath=...) in Lightning, Hindsight(dirpath) in Composer)."
        )
    if db.stat().st_size == 0:
        raise damaged_store_error(db, "it is empty: 0 bytes")
    _check_ours(db)


def prepare_directory(dirpath: str | os.PathLike) -> Path:
    """Create or validate a run directory for writing; never modifies anything that is not ours."""
    root = Path(dirpath).expanduser()
    if root.exists() and not root.is_dir():
        raise RunDirectoryError(f"dirpath {root} exists and is not a directory; pass a directory.")
    db = root / DB_NAME
    if root.is_dir():
        if db.exists():
            _check_ours(db)
        elif any(root.iterdir()):
            raise RunDirectoryError(
                f"dirpath {root} already holds files and no {DB_NAME}: it is not a stalwart run "
                "directory. Pass a new or empty directory (or one stalwart created)."
            )
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".stalwart-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise RunDirectoryError(
            f"dirpath {root} is not writable ({exc.strerror or exc}); pass a directory you can "
            "write to."
        ) from None
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_torn_files(root: Path) -> list[Path]:
    """Delete temp files a killed writer left in ``root/run_*`` (never indexed, never whole).

    Only ``.NAME.tmp-PID`` files whose writer PID is gone are removed; nothing else is touched.
    """
    removed = []
    for temp in filter(is_temp, root.glob("run_*/.*")):
        pid = temp.name.rsplit(TEMP_MARKER, 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            temp.unlink(missing_ok=True)
            removed.append(temp)
    return removed


@dataclass(frozen=True)
class CheckpointEntry:
    """One row of a run's checkpoint index."""

    run_id: int
    epoch: int
    step: int
    path: Path
    nbytes: int
    crc32: int

    def load(self, map_location: Any = "cpu", *, weights_only: bool = True) -> dict:
        """The checkpoint's contents, verified against its recorded size and CRC-32
        (``weights_only`` as in :func:`~stalwart.hindsight.checkpoint_file.read_checkpoint`)."""
        return read_checkpoint(
            self.path, self.nbytes, self.crc32, map_location=map_location, weights_only=weights_only
        )


class HindsightStore:
    """A run directory's database. Use :func:`stalwart.hindsight.open` to read one.

    Args:
        dirpath: the run directory holding ``hindsight.db`` and the runs' checkpoint folders.
        create: create the directory and database if missing (for recording).

    Example::

        store = HindsightStore("runs")
        run = store.runs()[-1]
        run.metrics("val_loss")
    """

    def __init__(self, dirpath: str | os.PathLike, create: bool = False) -> None:
        if create:
            self.root = prepare_directory(dirpath)
        else:
            self.root = Path(dirpath).expanduser()
            _check_readable(self.root / DB_NAME)
        self.db_path = self.root / DB_NAME
        self._conn = self._open(create)

    @_reads_the_store
    def _open(self, create: bool) -> sqlite3.Connection:
        conn = _connect(self.db_path)  # its first statements read the file: damage shows here
        try:
            self._conn = conn
            self._create_or_check(create)
        except BaseException:
            conn.close()
            raise
        return conn

    def _create_or_check(self, create: bool) -> None:
        if create:
            # The id, the schema version and the tables in one transaction while still in
            # rollback-journal mode, so they land in the main file together: a crash right after
            # creation must not leave a database we disown. One commit, not three: each costs
            # its fsyncs, ~2 ms, part of every record's fixed start.
            self._conn.executescript(
                f"BEGIN; PRAGMA application_id = {APPLICATION_ID}; "
                f"PRAGMA user_version = {SCHEMA_VERSION}; {_SCHEMA} COMMIT;"
            )
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = NORMAL")
            sweep_torn_files(self.root)
        # The runs table is read at once: a file damaged there is said now, not at first use.
        self._conn.execute("SELECT count(*) FROM runs").fetchone()

    def close(self) -> None:
        self._conn.close()

    @_reads_the_store
    def add_missing_tables(self) -> None:
        """Add the tables a database made by an older version lacks (every table is created
        only if missing), as opening it to record does; a replay writes to some of them."""
        self._conn.executescript(_SCHEMA)

    def __enter__(self) -> HindsightStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------

    def begin_run(
        self,
        *,
        hparams: dict,
        fingerprints: dict,
        config: dict,
        resumed_from: str | None = None,
    ) -> int:
        with self.batch():  # the row and its name, one commit
            cur = self._conn.execute(
                "INSERT INTO runs (name, started, status, resumed_from, hparams, fingerprints,"
                " config) VALUES ('', ?, 'running', ?, ?, ?, ?)",
                (
                    time.time(),
                    resumed_from,
                    json.dumps(hparams, default=repr, sort_keys=True),
                    json.dumps(fingerprints, sort_keys=True),
                    json.dumps(config, default=repr, sort_keys=True),
                ),
            )
            run_id = int(cur.lastrowid)
            self._conn.execute(
                "UPDATE runs SET name = ? WHERE run_id = ?", (f"run_{run_id:04d}", run_id)
            )
        self.run_dir(run_id).mkdir(exist_ok=True)
        return run_id

    def run_dir(self, run_id: int) -> Path:
        return self.root / f"run_{run_id:04d}"

    def mark_resumed(self, run_id: int, resumed_from: str) -> None:
        self._conn.execute(
            "UPDATE runs SET resumed_from = ? WHERE run_id = ?", (resumed_from, run_id)
        )

    def note_resumed_file(
        self, run_id: int, path: str | os.PathLike, nbytes: int, crc32: int
    ) -> None:
        """Keep the file a resumed fit started from, with its size and CRC-32 before training.

        A resumed fit writes no ``init.ckpt``: a replay of its first epochs starts from this file,
        which may lie outside the record (a ``ModelCheckpoint``'s), and which the checksums tell
        apart from a later file of the same name (a ``last.ckpt`` the fit went on to overwrite).
        """
        with self.batch():
            (text,) = self._conn.execute(
                "SELECT config FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            config = json.loads(text)
            config[RESUMED_FILE_KEY] = {
                "path": os.fspath(Path(path).resolve()), "nbytes": nbytes, "crc32": crc32,
            }  # fmt: skip
            self._conn.execute(
                "UPDATE runs SET config = ? WHERE run_id = ?",
                (json.dumps(config, default=repr, sort_keys=True), run_id),
            )

    def finish_run(self, run_id: int, status: str, overhead: dict | None = None) -> None:
        """Close the run with ``status``; ``overhead``: the record's final overhead figure and
        its parts (see :attr:`Run.overhead`), kept in the run's config.

        Kept in the config's JSON rather than a new column: a database written before stays
        readable as it is, and a version that predates the key ignores it."""
        with self.batch():
            if overhead is not None:
                (text,) = self._conn.execute(
                    "SELECT config FROM runs WHERE run_id = ?", (run_id,)
                ).fetchone()
                config = {**json.loads(text), OVERHEAD_KEY: overhead}
                self._conn.execute(
                    "UPDATE runs SET config = ? WHERE run_id = ?",
                    (json.dumps(config, default=repr, sort_keys=True), run_id),
                )
            self._conn.execute(
                "UPDATE runs SET finished = ?, status = ? WHERE run_id = ?",
                (time.time(), status, run_id),
            )

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Commit every write inside the block at once (a commit costs ~0.3 ms; an epoch's end
        writes several rows). Nested blocks join the outer one; an error rolls the block back."""
        if self._conn.in_transaction:
            yield
            return
        with self._conn:
            self._conn.execute("BEGIN")
            yield

    def add_metrics(self, rows: Iterable[Sequence]) -> None:
        """Insert ``(run_id, epoch, step, name, value, hook, source, replay_id)`` rows at once."""
        with self.batch():
            self._conn.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def add_decision(
        self, run_id: int, decision: dict, measured_cost: float | None, interference: float
    ) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO decisions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                run_id,
                decision["epoch"],
                decision["n"],
                decision["k"],
                decision["materialize_cost"],
                decision["compute_time"],
                decision["threshold"],
                int(decision["checkpoint"]),
                measured_cost,
                interference,
            ),
        )

    def add_epoch_work(
        self, run_id: int, epoch: int, batches: int, epoch_level_seconds: float
    ) -> None:
        """What one recorded epoch did: its training batches, and the seconds it spent after
        the last one (validation, epoch-end hooks), which a memoized replay epoch still spends."""
        self._conn.execute(
            "INSERT OR REPLACE INTO epoch_work VALUES (?, ?, ?, ?)",
            (run_id, epoch, batches, epoch_level_seconds),
        )

    def add_replay_work(
        self, replay_id: str, run_id: int, segment: int, resume_from: int, last_epoch: int,
        batch_epochs: list[int], seconds: float,
    ) -> None:  # fmt: skip
        """What one replay segment executed: its training batches, by epoch."""
        self._conn.execute(
            "INSERT OR REPLACE INTO replay_work VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (replay_id, run_id, segment, resume_from, last_epoch, len(batch_epochs),
             json.dumps(batch_epochs), seconds),
        )  # fmt: skip

    def discard_replay(self, replay_id: str) -> None:
        """Delete every row a replay wrote (its values and work), in one commit: a replay that
        failed part-way holds some batches' values only, which no reader may take for its
        result."""
        with self.batch():
            self._conn.execute("DELETE FROM metrics WHERE replay_id = ?", (replay_id,))
            self._conn.execute("DELETE FROM replay_work WHERE replay_id = ?", (replay_id,))
            self._conn.execute("DELETE FROM replays WHERE replay_id = ?", (replay_id,))

    def begin_replay(self, replay_id: str, run_id: int) -> list[str]:
        """Register ``replay_id`` as under way in this process, first discarding the rows of
        replays whose process died before it finished them (SIGKILL, the out-of-memory killer:
        no ``except`` ran to discard them). Returns the ids discarded.

        Until :meth:`finish_replay`, readers do not serve the replay's values
        (:meth:`Run.metrics`): they are some batches' only. A replay registered on another
        host is never discarded here (its process cannot be looked up), only not served.
        """
        host = socket.gethostname()
        unfinished = self._conn.execute(
            "SELECT replay_id, host, pid FROM replays WHERE finished IS NULL"
        ).fetchall()
        abandoned = [rid for rid, on, pid in unfinished if on == host and not _alive(pid)]
        for rid in abandoned:
            self.discard_replay(rid)
        self._conn.execute(
            "INSERT INTO replays VALUES (?, ?, ?, ?, ?, NULL)",
            (replay_id, run_id, host, os.getpid(), time.time()),
        )
        return abandoned

    def finish_replay(self, replay_id: str) -> None:
        """Mark ``replay_id``'s rows complete: readers serve them from now on."""
        self._conn.execute(
            "UPDATE replays SET finished = ? WHERE replay_id = ?", (time.time(), replay_id)
        )

    def served(self) -> str:
        """An SQL condition on a metrics row that leaves out the rows of replays not finished
        (under way, or abandoned by a killed process). A store made before replays were
        registered has no such table: every row is served there."""
        has = self._conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'replays'"
        ).fetchone()
        if has is None:
            return "1"
        return (
            "(replay_id IS NULL OR replay_id NOT IN"
            " (SELECT replay_id FROM replays WHERE finished IS NULL))"
        )

    # -- reading ---------------------------------------------------------------------------

    @_reads_the_store
    def runs(self) -> list[Run]:
        """Every recorded run, oldest first."""
        ids = self._conn.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()
        return [Run(self, run_id) for (run_id,) in ids]

    @_reads_the_store
    def run(self, run: int | str | None = None) -> Run:
        """A run by id or name (``"run_0003"``); the latest when ``run`` is None."""
        if run is None:
            row = self._conn.execute("SELECT max(run_id) FROM runs").fetchone()
        elif isinstance(run, str):
            row = self._conn.execute("SELECT run_id FROM runs WHERE name = ?", (run,)).fetchone()
        else:
            row = self._conn.execute("SELECT run_id FROM runs WHERE run_id = ?", (run,)).fetchone()
        if row is None or row[0] is None:
            known = ", ".join(r.name for r in self.runs())
            if not known:
                raise RunNotFoundError(
                    f"{self.root} holds no recorded run yet; record one there first "
                    "(HindsightCallback(dirpath=...) in Lightning, Hindsight(dirpath) in Composer)."
                )
            raise RunNotFoundError(f"no run {run!r} in {self.root} (recorded runs: {known}).")
        return Run(self, int(row[0]))

    @_reads_the_store
    def query(self, sql: str, params: Sequence = ()) -> pd.DataFrame:
        return pd.read_sql_query(sql, self._conn, params=params)


def format_overhead(figure: dict) -> str:
    """``"20.80% of training compute (outside checkpoints 14.21%)"``: how the fit's summary and
    ``stalwart runs`` both write a run's :attr:`Run.overhead`, so they cannot disagree."""
    return (
        f"{figure['overhead']:.2%} of training compute "
        f"(outside checkpoints {figure['outside_checkpoints']:.2%})"
    )


def checkpoint_recorder(db_path: Path, run_id: int, epoch: int, step: int):
    """A function that indexes a written checkpoint; it runs in the writing (child) process.

    It opens its own connection: a connection must never cross a ``fork``.
    """

    def record(written: WrittenFile) -> None:
        conn = _connect(db_path)
        try:
            conn.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    epoch,
                    step,
                    os.path.relpath(written.path, db_path.parent),
                    written.nbytes,
                    written.crc32,
                    written.seconds,
                    time.time(),
                ),
            )
        finally:
            conn.close()

    return record


class Run:
    """One recorded run: its manifest, logged values and checkpoints."""

    @_reads_the_store
    def __init__(self, store: HindsightStore, run_id: int) -> None:
        self.store = store
        self.run_id = run_id
        row = store._conn.execute(
            "SELECT name, started, finished, status, resumed_from, hparams, fingerprints, config"
            " FROM runs WHERE run_id = ?",
            (run_id,),
        ).fetchone()
        self.name, self.started, self.finished, self.status, self.resumed_from = row[:5]
        self.hparams: dict = json.loads(row[5])
        self.fingerprints: dict = json.loads(row[6])
        self.config: dict = json.loads(row[7])

    def __repr__(self) -> str:
        return f"Run({self.name!r}, status={self.status!r})"

    @property
    def overhead(self) -> dict | None:
        """The record's own overhead figure, as the fit's summary line printed it: ``overhead``
        (everything the record spent, over the training compute), ``outside_checkpoints`` (the
        part no checkpoint caused: start, finish, per-epoch bookkeeping), and the seconds and
        counts they come from (``spent_seconds``, ``fixed_seconds``, ``compute_seconds``,
        ``epochs``, ``checkpoints``, ``epsilon``). A fit resumed from a record's checkpoint
        continues that record's policy, and so its figure: it counts the epochs before too.

        None for a run whose record did not finish (its process died) or was made before
        stalwart kept the figure; :meth:`decisions` then still has each checkpoint's measured
        cost and the slowdown it caused, which leave those fixed costs out.
        """
        return self.config.get(OVERHEAD_KEY)

    @_reads_the_store
    def metric_names(self) -> list[str]:
        rows = self.store._conn.execute(
            "SELECT DISTINCT name FROM metrics WHERE run_id = ? AND "
            f"{self.store.served()} ORDER BY name",
            (self.run_id,),
        ).fetchall()
        return [name for (name,) in rows]

    def metrics(self, name: str, source: str | None = None) -> pd.DataFrame:
        """Every value logged under ``name``: columns epoch, step, value, source (and hook).

        One row per ``log`` call, in the order they were logged; ``source`` is ``"record"`` or
        ``"replay"``. Pass ``source=`` to keep one of them. A replay's values are served once it
        finished: not while it runs, nor ever those of a replaying process killed part-way.
        """
        sql = (
            "SELECT epoch, step, value, source, hook, replay_id FROM metrics"
            f" WHERE run_id = ? AND name = ? AND {self.store.served()}"
        )
        params: list = [self.run_id, name]
        if source is not None:
            sql += " AND source = ?"
            params.append(source)
        frame = self.store.query(sql + " ORDER BY rowid", params)
        if frame.empty and name not in self.metric_names():
            raise RunNotFoundError(
                f"{self.name} logged no metric {name!r}; "
                f"it logged: {', '.join(self.metric_names())}."
            )
        return frame

    def decisions(self) -> pd.DataFrame:
        """The checkpoint policy's decision per epoch.

        Columns: epoch, n, k, materialize_cost (the M estimate decided on), measured_cost (main
        thread, when a checkpoint was taken), interference (slowdown of this epoch's batches by
        background writes), compute_time (C), threshold, checkpoint.
        """
        return self.store.query(
            "SELECT epoch, n, k, materialize_cost, measured_cost, interference, compute_time,"
            " threshold, checkpoint FROM decisions WHERE run_id = ? ORDER BY epoch",
            (self.run_id,),
        )

    def epoch_work(self) -> pd.DataFrame:
        """Per recorded epoch: batches (training batches run) and epoch_level_seconds (time
        after the last batch: validation and epoch-end hooks). Empty for runs recorded before
        stalwart kept it."""
        return self.store.query(
            "SELECT epoch, batches, epoch_level_seconds FROM epoch_work WHERE run_id = ?"
            " ORDER BY epoch",
            (self.run_id,),
        )

    @_reads_the_store
    def checkpoints(self, include_initial: bool = False) -> list[CheckpointEntry]:
        """The complete checkpoints of this run, by epoch (each one's state after that epoch).

        Args:
            include_initial: also list the state before the first epoch (epoch -1).
        """
        rows = self.store._conn.execute(
            "SELECT epoch, step, path, nbytes, crc32 FROM checkpoints WHERE run_id = ?"
            " AND epoch >= ? ORDER BY epoch",
            (self.run_id, INITIAL_EPOCH if include_initial else 0),
        ).fetchall()
        return [
            CheckpointEntry(self.run_id, epoch, step, self.store.root / path, nbytes, crc32)
            for epoch, step, path, nbytes, crc32 in rows
        ]

    def checkpoint(self, epoch: int) -> CheckpointEntry:
        for entry in self.checkpoints(include_initial=True):
            if entry.epoch == epoch:
                return entry
        have = [entry.epoch for entry in self.checkpoints()]
        raise RunNotFoundError(f"{self.name} has no checkpoint of epoch {epoch} (it has {have}).")
