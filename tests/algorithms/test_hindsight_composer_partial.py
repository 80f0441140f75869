"""Composer Hindsight: a fit that ends in the middle of an epoch (``max_duration`` in batches)
records that epoch as one, and a replay re-runs it up to the batch where the record stopped.

With ``max_duration="30ba"`` and 11 batches an epoch, Composer trains epochs 0 and 1 and 8 batches
of epoch 2, and never fires epoch 2's end events. The record used to note no decision for that
epoch, so a replay of "every epoch" silently returned 22 of the 30 probe values, and
``epochs=[2]`` was refused as not recorded.
"""

from __future__ import annotations

import shutil
import sqlite3

import pytest
from composer import Callback
from composer.loggers import InMemoryLogger
from composer_digits import WeightNormProbe, make_trainer

import stalwart.hindsight
from stalwart.algorithms import Hindsight, replay
from stalwart.errors import ReplayError

BATCHES = 11  # 1437 digits in batches of 128, the last short one dropped
STOP = 30  # 2 whole epochs and 8 batches of epoch 2
RAN = {0: BATCHES, 1: BATCHES, 2: STOP - 2 * BATCHES}


class EveryEpoch(Hindsight):
    """Checkpoint every epoch, whatever the policy says: the test needs a fixed plan."""

    def should_checkpoint(self, state, policy_says: bool) -> bool:
        return True


def factory_for(hindsight: Hindsight):
    """The run's Trainer factory (one Hindsight instance for the record and every replay)."""

    def factory(**overrides):
        return make_trainer(algorithms=[hindsight], **{"max_duration": f"{STOP}ba", **overrides})

    return factory


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("composer-partial")
    factory = factory_for(EveryEpoch(root))
    factory().fit()
    return root, factory


@pytest.fixture(scope="module")
def ground_truth():
    """The same fit with the probe attached from the start (no Hindsight at all)."""
    memory = InMemoryLogger()
    make_trainer(max_duration=f"{STOP}ba", callbacks=[WeightNormProbe()], loggers=[memory]).fit()
    values = [float(v) for _, v in memory.data["probe/weight_norm"]]
    assert len(values) == STOP
    return values


def test_the_epoch_the_fit_stopped_in_is_recorded_with_the_batches_it_ran(recorded):
    root, _ = recorded
    run = stalwart.hindsight.open(root).run()
    assert run.status == "completed"
    assert run.metrics("loss/train/total").groupby("epoch").size().to_dict() == RAN
    assert run.decisions().epoch.tolist() == [0, 1, 2]
    assert run.epoch_work().set_index("epoch").batches.to_dict() == RAN
    # Not checkpointed, although should_checkpoint forces every epoch: the state it ended in is
    # not an epoch's end, and no replay starts after the fit's last epoch.
    assert not run.decisions().checkpoint.iloc[-1]
    assert [c.epoch for c in run.checkpoints(include_initial=True)] == [-1, 0, 1]


@pytest.mark.parametrize("workers", [1, 2])
def test_every_epoch_replays_up_to_where_the_record_stopped(recorded, ground_truth, workers):
    _, factory = recorded
    result = replay(factory, probe=WeightNormProbe(), workers=workers, loggers=None)
    assert len(result.segments) == workers
    replayed = result.metrics("probe/weight_norm")
    assert replayed.value.tolist() == ground_truth  # bit for bit, all 30
    assert replayed.step.tolist() == list(range(1, STOP + 1))
    assert sorted(result.batch_epochs) == [e for e, n in RAN.items() for _ in range(n)]
    assert result.mismatches == []  # epoch 2's 8 recorded losses included


def test_the_partial_epoch_alone_replays_from_the_checkpoint_before_it(recorded, ground_truth):
    _, factory = recorded
    result = replay(factory, probe=WeightNormProbe(), epochs=[2], loggers=None)
    assert [(s.resume_from, s.last_epoch) for s in result.segments] == [(1, 2)]
    assert result.batch_epochs == [2] * RAN[2]
    assert result.metrics("probe/weight_norm").value.tolist() == ground_truth[2 * BATCHES :]
    assert result.mismatches == []


def test_an_epoch_with_recorded_values_but_no_recorded_end_is_refused(recorded, tmp_path):
    # A record made before the epoch a fit stopped in was noted: its values are there, where
    # the fit stopped is not. A replay says so rather than return the other epochs alone.
    root, _ = recorded
    old = tmp_path / "old"
    shutil.copytree(root, old)
    with sqlite3.connect(old / "hindsight.db") as db:
        db.execute("DELETE FROM decisions WHERE epoch = 2")
        db.execute("DELETE FROM epoch_work WHERE epoch = 2")
    factory = factory_for(EveryEpoch(old))
    with pytest.raises(ReplayError, match=r"epoch 2 .*epochs=\[0, 1\]"):
        replay(factory, probe=WeightNormProbe(), epochs=[2], dry_run=True)
    # "Every epoch": the ones it can run, and a warning naming the one it cannot.
    with pytest.warns(UserWarning, match=r"epoch 2 .*epochs=\[0, 1\]"):
        plan = replay(factory, probe=WeightNormProbe(), dry_run=True)
    assert [s.segment.last_epoch for s in plan.segments] == [1]
    plan = replay(factory, probe=WeightNormProbe(), epochs=[0, 1], dry_run=True)
    assert [s.segment.last_epoch for s in plan.segments] == [1]


class Boom(Callback):
    """Fails the fit in the middle of epoch 1."""

    def batch_end(self, state, logger) -> None:
        if int(state.timestamp.epoch) == 1 and int(state.timestamp.batch_in_epoch) == 5:
            raise RuntimeError("boom")


def test_the_epoch_a_failed_fit_stopped_in_is_not_replayed_silently(tmp_path):
    factory = factory_for(EveryEpoch(tmp_path))
    trainer = factory(callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    trainer.close()
    run = stalwart.hindsight.open(tmp_path).run()
    assert run.status == "failed" and run.decisions().epoch.tolist() == [0]
    assert sorted(set(run.metrics("loss/train/total").epoch)) == [0, 1]
    with pytest.raises(ReplayError, match=r"epoch 1 .*failed.*epochs=\[0\]"):
        replay(factory, probe=WeightNormProbe(), epochs=[1], dry_run=True)
    with pytest.warns(UserWarning, match=r"epoch 1 .*failed.*epochs=\[0\]"):
        plan = replay(factory, probe=WeightNormProbe(), dry_run=True)
    assert [s.segment.last_epoch for s in plan.segments] == [0]
