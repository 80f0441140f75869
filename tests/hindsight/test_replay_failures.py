"""A replay that fails says why, keeps nothing, and a replay never creates a record (Lightning).

The Composer side of the same behaviour is in tests/algorithms/test_hindsight_composer_failures.py.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
import pandas as pd
import pytest
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.loggers import CSVLogger

import stalwart
from stalwart import HindsightCallback
from stalwart.errors import ReplayError, RunNotFoundError
from stalwart.hindsight.store import HindsightStore

EPOCHS = 4
BATCHES = 5  # 640 training samples / 128
ROOT = Path(__file__).resolve().parents[2]


class EveryEpoch(HindsightCallback):
    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return True


class BuggyProbe(L.Callback):
    """Logs a value every batch, then fails in the third batch of epoch 2."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("probe_value", 1.0)
        if trainer.current_epoch == 2 and batch_idx == 2:
            raise RuntimeError("probe bug: no such layer")


class KilledProbe(L.Callback):
    """Its worker process dies as the out-of-memory killer would end it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("probe_value", 1.0)
        if trainer.current_epoch == 3 and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGKILL)


class Probe(L.Callback):
    """Logs a value every batch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("probe_value", 1.0)


def fresh():
    L.seed_everything(1)
    return DigitsClassifier(width=16), DigitsDataModule(batch_size=128, train_size=640)


def trainer_for(root) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=EPOCHS,
        callbacks=[EveryEpoch(dirpath=root / "runs")],
        logger=CSVLogger(root, name="csv"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    trainer_for(root).fit(*fresh())
    return root


def replay_rows(root) -> tuple[int, int]:
    """The store's replay rows: values logged by replays, and segments' work rows."""
    store = stalwart.hindsight.open(root / "runs")
    values = store.query("SELECT count(*) AS n FROM metrics WHERE source = 'replay'").n[0]
    work = store.query("SELECT count(*) AS n FROM replay_work").n[0]
    store.close()
    return int(values), int(work)


def csv_columns(root) -> set[str]:
    return {
        column
        for path in (root / "csv").rglob("metrics.csv")
        for column in pd.read_csv(path).columns
    }


def test_a_probe_raising_in_a_worker_fails_the_replay_with_its_cause_and_keeps_nothing(record):
    before = replay_rows(record)
    with pytest.raises(ReplayError) as info:
        trainer_for(record).replay(*fresh(), probe=BuggyProbe(), epochs=[2, 3], workers=2)
    said = str(info.value)
    # Which segment, and the worker's own exception with the frame that raised it.
    assert "segment 0 (epoch 2) raised RuntimeError: probe bug: no such layer" in said
    assert __file__ in said and "on_train_batch_end" in said
    assert "Nothing of this replay was kept" in said
    # The values the failed replay logged before it failed are not served as results, and
    # none reached the record's logger.
    assert replay_rows(record) == before
    with pytest.raises(RunNotFoundError):
        stalwart.hindsight.open(record / "runs").run().metrics("probe_value")
    assert not any("probe_value" in column for column in csv_columns(record))


@pytest.fixture
def temporary(tmp_path, monkeypatch):
    """The system's temporary directory, for this test alone (forked workers inherit it)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_a_worker_killed_by_a_signal_fails_the_replay_naming_the_signal(record, temporary):
    before = replay_rows(record)
    with pytest.raises(ReplayError) as info:
        trainer_for(record).replay(*fresh(), probe=KilledProbe(), epochs=[2, 3], workers=2)
    said = str(info.value)
    assert "segment 1 (epoch 3): its worker process was killed by SIGKILL" in said
    assert "out-of-memory" in said and "fewer workers" in said
    assert replay_rows(record) == before
    # The killed worker removed nothing of its own; the replaying process removed it all (the
    # segments' log folders are made inside one of its own).
    assert list(temporary.iterdir()) == []


def test_a_parallel_replay_leaves_no_temporary_folder(tmp_path, temporary):
    trainer_for(tmp_path).fit(*fresh())  # a record of its own: the module's keeps no replay
    result = trainer_for(tmp_path).replay(*fresh(), probe=BuggyProbe(), epochs=[1, 3], workers=2)
    assert result.mismatches == []
    assert list(temporary.iterdir()) == []


def test_a_probe_raising_in_this_process_raises_its_own_error_and_keeps_nothing(record):
    before = replay_rows(record)
    with pytest.raises(RuntimeError, match="probe bug"):
        trainer_for(record).replay(*fresh(), probe=BuggyProbe(), epochs=[2], workers=1)
    assert replay_rows(record) == before == (0, 0)
    # A replay after it is whole: its values, and its work, only.
    result = trainer_for(record).replay(*fresh(), probe=BuggyProbe(), epochs=[1], workers=1)
    assert len(result.metrics("probe_value")) == BATCHES
    store = stalwart.hindsight.open(record / "runs")
    replays = store.query("SELECT DISTINCT replay_id FROM replay_work")
    assert replays.replay_id.tolist() == [result.replay_id]  # the failed one left no work row


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "replay"])
def test_a_replay_of_a_directory_without_a_record_writes_nothing_there(record, tmp_path, dry_run):
    typo = tmp_path / "runs_typo"
    with pytest.raises(RunNotFoundError) as info:
        trainer_for(record).replay(
            *fresh(), probe=BuggyProbe(), epochs=[1], dirpath=typo, dry_run=dry_run
        )
    assert f"no hindsight record in {typo}" in str(info.value)
    assert not typo.exists()


def test_a_store_without_runs_says_so_without_naming_run_none(tmp_path):
    store = HindsightStore(tmp_path / "empty", create=True)
    with pytest.raises(RunNotFoundError) as info:
        store.run()
    assert "holds no recorded run yet" in str(info.value)
    assert "None" not in str(info.value)


KILLED_REPLAY = """
import sys
sys.path[:0] = [{root!r}, {examples!r}]
from pathlib import Path
from tests.hindsight.test_replay_failures import KilledProbe, fresh, trainer_for
trainer_for(Path({record!r})).replay(*fresh(), probe=KilledProbe(), epochs=[2, 3], workers=1)
"""


def test_a_replaying_process_killed_part_way_is_never_served_and_the_next_replay_deletes_it(
    tmp_path, caplog
):
    trainer_for(tmp_path).fit(*fresh())
    # The replay runs in its own process (workers=1), which its probe SIGKILLs in epoch 3:
    # no except clause runs to delete what it wrote of epoch 2.
    script = KILLED_REPLAY.format(
        root=str(ROOT), examples=str(ROOT / "examples"), record=str(tmp_path)
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    left, _ = replay_rows(tmp_path)
    assert left >= BATCHES  # epoch 2's values are in the file ...
    store = stalwart.hindsight.open(tmp_path / "runs")
    with pytest.raises(RunNotFoundError):  # ... and no reader serves them
        store.run().metrics("probe_value")
    assert "probe_value" not in store.run().metric_names()
    (killed,) = store.query("SELECT replay_id FROM replays WHERE finished IS NULL").replay_id
    store.close()

    with caplog.at_level(logging.WARNING, logger="stalwart.hindsight.replay"):
        result = trainer_for(tmp_path).replay(*fresh(), probe=Probe(), epochs=[2], workers=1)
    assert f"deleted the values of replay(s) {killed}" in caplog.text
    assert result.mismatches == []
    store = stalwart.hindsight.open(tmp_path / "runs")
    ids = store.query("SELECT DISTINCT replay_id FROM metrics WHERE source = 'replay'").replay_id
    assert ids.tolist() == [result.replay_id]
    served = store.run().metrics("probe_value", source="replay")
    assert served.epoch.tolist() == [2] * BATCHES
    store.close()
