"""A Composer fit resumed from a record checkpoint keeps a figure of its own epochs,
checkpoints and seconds, not the parent run's totals its policy continues from."""

from __future__ import annotations

import pytest
from composer_digits import make_trainer

import stalwart.hindsight
from stalwart.algorithms import Hindsight


class EveryEpoch(Hindsight):
    def should_checkpoint(self, state, policy_says: bool) -> bool:
        return True


def test_a_resumed_composer_run_keeps_its_own_figure(tmp_path):
    make_trainer(epochs=2, algorithms=[EveryEpoch(tmp_path)]).fit()
    parent = stalwart.hindsight.open(tmp_path).run()
    start = parent.checkpoint(0).path
    make_trainer(epochs=4, algorithms=[EveryEpoch(tmp_path)], load_path=str(start)).fit()
    run = stalwart.hindsight.open(tmp_path).run()
    assert run.resumed_from.endswith("#run_0001@epoch=0")
    decisions, kept = run.decisions(), run.overhead
    assert decisions.epoch.tolist() == [1, 2, 3]
    assert (kept["epochs"], kept["checkpoints"]) == (3, len(run.checkpoints()))
    assert kept["compute_seconds"] == pytest.approx(decisions.compute_time.sum(), rel=1e-9)
    assert kept["fixed_seconds"] > 0  # its own start, charged before the parent's totals loaded
