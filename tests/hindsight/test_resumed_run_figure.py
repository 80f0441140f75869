"""A fit resumed from a record checkpoint reports its own epochs, checkpoints and overhead.

Its policy continues the parent run's totals (its decisions weigh the whole record), and the
fit's summary, the figure the run keeps and ``stalwart runs`` used to show those totals as the
new run's: "8 epochs, 3 checkpoints" for a run of 3 epochs with 1 checkpoint, and the parent's
compute seconds in its figure.
"""

from __future__ import annotations

import logging
import re

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart.cli import main
from stalwart.hindsight.policy import JointInvariantPolicy
from tests.helpers import QUIET

SUMMARY = re.compile(r"recorded \S+ \((\d+) epochs, (\d+) checkpoints, record overhead (.*?),")


@pytest.fixture
def summaries():
    """The lines Lightning's rank-zero logger said (where the fit's summary line goes)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def fit(dirpath, epochs, ckpt_path=None) -> None:
    L.seed_everything(0)
    trainer = L.Trainer(
        max_epochs=epochs, callbacks=[stalwart.HindsightCallback(dirpath=dirpath)], **QUIET
    )
    data = DigitsDataModule(batch_size=256, train_size=512)
    trainer.fit(DigitsClassifier(width=16), data, ckpt_path=ckpt_path)


def test_a_resumed_fit_reports_its_own_epochs_checkpoints_and_seconds(tmp_path, summaries, capsys):
    fit(tmp_path, epochs=4)
    parent = stalwart.hindsight.open(tmp_path).run()
    start = parent.checkpoints()[-1]
    fit(tmp_path, epochs=start.epoch + 4, ckpt_path=start.path)  # 3 epochs of its own

    run = stalwart.hindsight.open(tmp_path).run()
    decisions, kept = run.decisions(), run.overhead
    own_checkpoints = len(run.checkpoints())  # its own files, not the one it started from
    assert run.resumed_from.endswith(f"#{parent.name}@epoch={start.epoch}")
    assert len(decisions) == 3
    assert (kept["epochs"], kept["checkpoints"]) == (3, own_checkpoints)
    assert kept["compute_seconds"] == pytest.approx(decisions.compute_time.sum(), rel=1e-9)
    assert kept["overhead"] == pytest.approx(kept["spent_seconds"] / kept["compute_seconds"])
    # Its own start (store, fingerprints) is charged, not dropped when the parent's totals load.
    assert kept["fixed_seconds"] > 0
    # The parent's seconds are not in it, although the policy that kept it decided on them. (Not
    # a comparison of the two runs' seconds: one slow epoch on a loaded machine would decide it.)
    parent_compute = parent.overhead["compute_seconds"]
    assert parent_compute > 0
    assert kept["compute_seconds"] != pytest.approx(decisions.compute_time.sum() + parent_compute)

    said = [SUMMARY.search(line) for line in summaries if SUMMARY.search(line)]
    epochs, checkpoints, figure = said[-1].groups()
    assert (int(epochs), int(checkpoints)) == (3, own_checkpoints)
    assert figure == stalwart.hindsight.store.format_overhead(kept)
    assert main(["runs", str(tmp_path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if run.name in line)
    assert re.search(rf"epochs\s+3\s+checkpoints\s+{own_checkpoints}\b", line)
    assert f"overhead {figure}" in line


def test_a_loaded_policy_keeps_deciding_on_the_whole_record_but_owns_only_its_share():
    parent = JointInvariantPolicy(epsilon=0.1)
    for _ in range(5):
        if parent.decide(compute_time=1.0, materialize_cost=0.05).checkpoint:
            parent.checkpointed(0.05)
    resumed = JointInvariantPolicy(epsilon=0.1)
    resumed.charge_fixed(0.01)  # the resumed run's start, charged before its state is loaded
    resumed.load_state_dict(parent.state_dict())
    assert resumed.epochs == 5 and resumed.total_compute == 5.0  # decisions see the whole record
    resumed.decide(compute_time=2.0, materialize_cost=0.05)
    own = resumed.own()
    assert (own.epochs, own.checkpoints, own.compute) == (1, 0, 2.0)
    assert own.fixed == pytest.approx(0.01) and own.materialize == pytest.approx(0.01)
    assert own.overhead == pytest.approx(0.01 / 2.0)
