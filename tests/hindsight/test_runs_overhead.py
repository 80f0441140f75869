"""`stalwart runs` prints the record overhead its fit's summary printed: one figure, not two.

The fit's summary counts everything the record spent (checkpoints, the slowdown their writes
caused, the record's start and finish, per-epoch bookkeeping); the listing used to sum only the
stored checkpoint decisions and printed 6.58% for a run whose summary said 20.80%.
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart.cli import main
from stalwart.hindsight.store import DB_NAME, OVERHEAD_KEY
from tests.helpers import QUIET

SUMMARY = re.compile(r"record overhead (\S+%) of training compute \(outside checkpoints (\S+%)\)")


class Summaries(logging.Handler):
    """Keeps what Lightning's rank-zero logger said (where the fit's summary line goes)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def summaries():
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level = Summaries(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def fit(dirpath, callbacks=(), **trainer_args) -> stalwart.HindsightCallback:
    record = stalwart.HindsightCallback(dirpath=dirpath)
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=3, callbacks=[record, *callbacks], **QUIET, **trainer_args)
    trainer.fit(DigitsClassifier(width=16), DigitsDataModule(batch_size=256, train_size=512))
    return record


def listing(dirpath, capsys) -> str:
    assert main(["runs", str(dirpath)]) == 0
    return capsys.readouterr().out


def test_runs_prints_the_overhead_the_fits_summary_printed(tmp_path, summaries, capsys):
    record = fit(tmp_path)
    (said,) = [SUMMARY.search(line) for line in summaries if SUMMARY.search(line)]
    overhead, outside = said.groups()
    # The record's start and finish are part of the figure: a run this short shows them.
    assert record.policy.total_fixed > 0
    assert overhead == f"{record.policy.overhead:.2%}"
    out = listing(tmp_path, capsys)
    assert f"overhead {overhead} of training compute (outside checkpoints {outside})" in out
    assert "checkpoints only" not in out
    kept = stalwart.hindsight.open(tmp_path).run().overhead
    assert kept["overhead"] == record.policy.overhead  # the same float, not a recomputation
    assert kept["epochs"] == 3 and kept["checkpoints"] == record.policy.checkpoints


def test_a_record_without_the_figure_shows_its_checkpoints_part_and_says_so(tmp_path, capsys):
    """A run recorded before the figure was kept (or whose process died before the record
    finished) has only its decisions: their sum, marked as the checkpoints' part only."""
    fit(tmp_path)
    with sqlite3.connect(tmp_path / DB_NAME) as conn:
        (text,) = conn.execute("SELECT config FROM runs").fetchone()
        config = json.loads(text)
        del config[OVERHEAD_KEY]
        conn.execute("UPDATE runs SET config = ?", (json.dumps(config),))
    conn.close()
    run = stalwart.hindsight.open(tmp_path).run()
    assert run.overhead is None
    decisions = run.decisions()
    spent = decisions.measured_cost.fillna(0).sum() + decisions.interference.sum()
    out = listing(tmp_path, capsys)
    assert f"overhead {spent / decisions.compute_time.sum():.2%} (checkpoints only)" in out
    assert "without the record's start, finish and per-epoch bookkeeping" in out


class FailsInEpoch2(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 2:
            raise RuntimeError("stop here")


def test_a_failed_fit_keeps_the_figure_it_reached(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="stop here"):
        fit(tmp_path, [FailsInEpoch2()])
    run = stalwart.hindsight.open(tmp_path).run()
    assert run.status == "failed" and run.overhead["epochs"] == 2
    out = listing(tmp_path, capsys)
    assert f"overhead {run.overhead['overhead']:.2%} of training compute" in out
