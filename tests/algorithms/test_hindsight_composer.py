"""Composer Hindsight: record, then replay a probe after the fact, bit for bit (sklearn digits)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from composer import Callback
from composer.loggers import InMemoryLogger
from composer_digits import WeightNormProbe, make_trainer

import stalwart.hindsight
from stalwart.algorithms import Hindsight, replay
from stalwart.algorithms.hindsight import CallbackDispatch, StoreDestination
from stalwart.hindsight.policy import DEFAULT_EPSILON, DEFAULT_RESTORE_RATIO

EPOCHS = 6
BATCHES = 11  # 1437 digits in batches of 128, the last short one dropped


class EveryEpoch(Hindsight):
    """Checkpoint every epoch, whatever the policy says: the test needs a fixed plan."""

    def should_checkpoint(self, state, policy_says: bool) -> bool:
        return True


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("composer-record")
    hindsight = EveryEpoch(root)  # one instance for the record and every replay

    def factory(**overrides):
        return make_trainer(epochs=EPOCHS, algorithms=[hindsight], **overrides)

    factory().fit()
    return root, factory


@pytest.fixture(scope="module")
def ground_truth():
    """The run with the probe attached from the start (no Hindsight at all)."""
    memory = InMemoryLogger()
    make_trainer(epochs=EPOCHS, callbacks=[WeightNormProbe()], loggers=[memory]).fit()
    values = [float(v) for _, v in memory.data["probe/weight_norm"]]
    assert len(values) == EPOCHS * BATCHES
    return values


def test_record_holds_every_logged_value_and_composer_checkpoints(recorded):
    root, _ = recorded
    run = stalwart.hindsight.open(root).run()
    assert run.status == "completed" and run.config["framework"] == "composer"
    assert [c.epoch for c in run.checkpoints(include_initial=True)] == list(range(-1, EPOCHS))
    assert run.decisions().n.tolist() == list(range(1, EPOCHS + 1))
    loss = run.metrics("loss/train/total")
    assert loss.groupby("epoch").size().to_dict() == dict.fromkeys(range(EPOCHS), BATCHES)
    # Epoch-end evaluation belongs to the epoch it evaluated, not the next one.
    assert run.metrics("metrics/eval/MulticlassAccuracy").epoch.tolist() == list(range(EPOCHS))
    state = torch.load(run.checkpoint(2).path, weights_only=False)
    assert state["state"]["timestamp"]["Timestamp"]["epoch"] == 3 and "rng" in state  # Composer


def test_middle_epochs_replayed_in_two_workers_equal_the_ground_truth(recorded, ground_truth):
    _, factory = recorded
    result = replay(factory, probe=WeightNormProbe(), epochs=[2, 3, 4], workers=2)
    assert len(result.segments) == 2
    assert result.mismatches == []  # every recorded value of epochs 2..4 was reproduced
    loss = result.run.metrics("loss/train/total")
    recorded_loss = loss[(loss.source == "record") & loss.epoch.isin([2, 3, 4])]
    assert len(recorded_loss) == 3 * BATCHES
    assert result.metrics("loss/train/total").value.tolist() == recorded_loss.value.tolist()
    replayed = result.metrics("probe/weight_norm")
    assert replayed.value.tolist() == ground_truth[2 * BATCHES : 5 * BATCHES]  # bit for bit
    assert replayed.epoch.tolist() == [e for e in (2, 3, 4) for _ in range(BATCHES)]
    # Composer cannot skip epochs: each segment resumes from the checkpoint right before it.
    assert sorted(result.batch_epochs) == [e for e in (2, 3, 4) for _ in range(BATCHES)]


def test_whole_run_replayed_from_the_initial_checkpoint(recorded, ground_truth):
    root, factory = recorded
    result = replay(factory, probe=WeightNormProbe(), workers=1)
    assert [s.resume_from for s in result.segments] == [-1]
    assert result.metrics("probe/weight_norm").value.tolist() == ground_truth
    assert result.mismatches == []
    assert len(stalwart.hindsight.open(root).runs()) == 1  # replays record no run of their own


def test_a_factory_that_autoresumes_replays_from_the_records_checkpoint(
    recorded, ground_truth, tmp_path
):
    # Composer's documented resume: autoresume=True needs a save_folder, which a replay (it
    # writes no checkpoint) leaves out; it used to fail ("save_folder must be specified").
    _, factory = recorded

    def autoresuming(**overrides):
        return factory(
            **{"save_folder": str(tmp_path), "autoresume": True, "run_name": "ar", **overrides}
        )

    result = replay(autoresuming, probe=WeightNormProbe(), epochs=[3])
    assert result.mismatches == [] and [s.resume_from for s in result.segments] == [2]
    replayed = result.metrics("probe/weight_norm").value.tolist()
    assert replayed == ground_truth[3 * BATCHES : 4 * BATCHES]
    assert list(tmp_path.iterdir()) == []  # nothing written to the save folder


def test_lightning_and_composer_record_the_same_epochs_and_decisions(tmp_path):
    """The same 3-epoch digits training, recorded by each adapter with a checkpoint forced every
    epoch: the same checkpoints, the same decision table, and in both each decision prices a
    checkpoint at the low median of the costs measured so far (the core's feedback loop)."""
    from stalwart import HindsightCallback
    from tests.helpers import fit_digits

    class EveryEpochLightning(HindsightCallback):
        def should_checkpoint(self, trainer, policy_says: bool) -> bool:
            return True

    epochs = 3
    fit_digits([EveryEpochLightning(tmp_path / "lightning", materializer="inline")], epochs=epochs)
    make_trainer(
        epochs=epochs, algorithms=[EveryEpoch(tmp_path / "composer", materializer="inline")]
    ).fit()
    runs = [stalwart.hindsight.open(tmp_path / side).run() for side in ("lightning", "composer")]
    tables = [run.decisions() for run in runs]
    assert list(tables[0].columns) == list(tables[1].columns)
    budget = min(1 / (1 + DEFAULT_RESTORE_RATIO), DEFAULT_EPSILON)
    for run, decisions in zip(runs, tables, strict=True):
        assert run.status == "completed"
        assert [c.epoch for c in run.checkpoints(include_initial=True)] == list(range(-1, epochs))
        assert decisions.epoch.tolist() == list(range(epochs))
        assert decisions.n.tolist() == list(range(1, epochs + 1))
        assert decisions.k.tolist() == list(range(epochs))  # every earlier epoch checkpointed
        assert decisions.checkpoint.astype(bool).all()
        expected = (decisions.n / (decisions.k + 1) * budget).tolist()
        assert decisions.threshold.tolist() == pytest.approx(expected, rel=1e-12)
        measured = (decisions.measured_cost + decisions.interference).tolist()
        prior = decisions.materialize_cost.iloc[0]  # the probe measured before epoch 0
        priced = [statistics.median_low([prior, *measured[:e]]) for e in range(epochs)]
        assert decisions.materialize_cost.tolist() == pytest.approx(priced, rel=1e-12)


class Boom(Callback):
    """Fails the fit in the middle of epoch 2."""

    def batch_end(self, state, logger) -> None:
        if int(state.timestamp.epoch) == 2 and int(state.timestamp.batch_in_epoch) == 5:
            raise RuntimeError("boom")


def test_a_failed_fit_keeps_its_checkpoints_and_the_record_resumes_from_them(tmp_path):
    trainer = make_trainer(epochs=4, algorithms=[EveryEpoch(tmp_path)], callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    trainer.close()
    run = stalwart.hindsight.open(tmp_path).run()
    assert run.status == "failed"
    assert [c.epoch for c in run.checkpoints(include_initial=True)] == [-1, 0, 1]
    assert run.checkpoint(1).nbytes > 0  # indexed with its size and CRC-32
    make_trainer(
        epochs=4, algorithms=[EveryEpoch(tmp_path)], load_path=str(run.checkpoint(1).path)
    ).fit()
    again = stalwart.hindsight.open(tmp_path).run()
    assert again.run_id == 2 and again.status == "completed"
    assert again.resumed_from.endswith("#run_0001@epoch=1")
    assert [c.epoch for c in again.checkpoints(include_initial=True)] == [2, 3]  # no init.ckpt
    assert sorted(set(again.metrics("loss/train/total").epoch)) == [2, 3]


def test_composers_dispatch_of_every_event_to_the_record_is_charged(tmp_path):
    # The record's destination is a callback: Composer hands it every event of every batch.
    # Priced at 2 ms an event, that must show, event for event, in the record's figure.
    hindsight = Hindsight(tmp_path)
    dispatched = []
    handle = hindsight._destination.run_event

    def slow_run_event(event, state, logger):
        dispatched.append(event)
        time.sleep(0.002)
        handle(event, state, logger)

    hindsight._destination.run_event = slow_run_event
    make_trainer(epochs=2, algorithms=[hindsight]).fit()
    assert len(dispatched) > 2 * BATCHES * 10  # ~13 events a batch
    assert hindsight.recorder.policy.total_fixed >= 0.9 * 0.002 * len(dispatched)


def test_the_dispatch_cost_is_sampled_where_training_runs_it():
    # Measured warm at the fit's start, Composer's loop body costs about half what it costs
    # between training steps: samples taken in place replace the warm figure.
    trainer = make_trainer(epochs=1)
    destination = StoreDestination("record")
    delay = [0.0]

    def run_event(event, state, logger):
        time.sleep(delay[0])

    destination.run_event = run_event
    dispatch = CallbackDispatch(trainer.state, trainer.logger, destination, every=5)
    assert dispatch.per_event < 1e-3
    delay[0] = 0.002
    assert dispatch.event() < 1e-3  # not sampled yet
    for _ in range(9):
        cost = dispatch.event()
    assert cost >= 0.002
    trainer.close()
