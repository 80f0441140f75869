"""Composer Hindsight: what a replay segment's Trainer sees and leaves behind.

- It runs with the record's ``max_duration`` and is stopped at its end: a schedule over the
  whole run (``t_max="1dur"``) used to see the segment's end as the run's end.
- It runs no ``CheckpointSaver`` of the factory's: one used to overwrite the run's own files.
- What it logs at the end of the fit, when it ends where the recorded fit did, is kept.
- Only the segment that ends where the recorded fit did hands ``FIT_END`` to the callbacks,
  probes and algorithms; every segment's Trainer still closes them.
- The deferred check does not compare series that time the run (``SpeedMonitor``).
"""

from __future__ import annotations

import json
import sqlite3
import warnings
from pathlib import Path

import pytest
import torch
from composer import Algorithm, Callback, Event
from composer.callbacks import CheckpointSaver, SpeedMonitor
from composer.loggers import InMemoryLogger
from composer.optim import CosineAnnealingWithWarmupScheduler
from composer_digits import WeightNormProbe, make_trainer

from stalwart.algorithms import Hindsight, replay

BATCHES = 11  # 1437 digits in batches of 128, the last short one dropped


class EveryEpoch(Hindsight):
    """Checkpoint every epoch, whatever the policy says: the tests need a fixed plan."""

    def should_checkpoint(self, state, policy_says: bool) -> bool:
        return True


def cosine(**overrides):
    """Warm-up then cosine decay over the whole run (``t_max="1dur"``), stepped every batch."""
    return make_trainer(
        epochs=4,
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="5ba"),
        step_schedulers_every_batch=True,
        **overrides,
    )


@pytest.mark.parametrize(("epochs", "workers"), [([1], 1), ([1, 2], 2)])
def test_a_schedule_over_the_whole_run_replays_bit_for_bit(tmp_path, epochs, workers):
    hindsight = EveryEpoch(tmp_path)
    factory = lambda **overrides: cosine(algorithms=[hindsight], **overrides)  # noqa: E731
    factory().fit()
    memory = InMemoryLogger()
    cosine(callbacks=[WeightNormProbe()], loggers=[memory]).fit()
    truth = [float(v) for _, v in memory.data["probe/weight_norm"]]

    result = replay(factory, probe=WeightNormProbe(), epochs=epochs, workers=workers, loggers=None)
    assert len(result.segments) == workers
    assert all(s.last_epoch < 3 for s in result.segments)  # none reaches the record's end
    start, stop = epochs[0] * BATCHES, (epochs[-1] + 1) * BATCHES
    assert result.metrics("probe/weight_norm").value.tolist() == truth[start:stop]
    assert result.mismatches == []


def _files(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_a_replay_leaves_the_factorys_checkpoint_files_as_they_are(tmp_path, caplog):
    saved = tmp_path / "checkpoints"
    hindsight = EveryEpoch(tmp_path / "record")

    def factory(**overrides):
        saver = CheckpointSaver(folder=str(saved), filename="ep{epoch}.pt", overwrite=True)
        return make_trainer(epochs=3, algorithms=[hindsight], callbacks=[saver], **overrides)

    factory().fit()
    before = _files(saved)
    assert {"ep2.pt", "ep3.pt", "latest-rank0.pt"} <= set(before)
    with caplog.at_level("INFO", logger="stalwart.algorithms.hindsight"):
        result = replay(factory, probe=WeightNormProbe(), epochs=[1], loggers=None)
    assert result.mismatches == []
    assert _files(saved) == before  # latest-rank0.pt still holds epoch 3, not the replay's 2
    assert "CheckpointSaver" in caplog.text


class Nudge(Callback):
    """Not a probe: it changes the weights before every batch, so the loss diverges."""

    def batch_start(self, state, logger) -> None:
        with torch.no_grad():
            for parameter in state.model.parameters():
                parameter.add_(1e-3)


def test_series_that_time_the_run_are_not_compared(tmp_path):
    hindsight = EveryEpoch(tmp_path)

    def factory(**overrides):
        speed = SpeedMonitor(window_size=3)
        return make_trainer(epochs=3, algorithms=[hindsight], callbacks=[speed], **overrides)

    factory().fit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a mismatch warns
        exact = replay(factory, probe=WeightNormProbe(), epochs=[1, 2], loggers=None)
    assert exact.mismatches == []
    assert exact.not_rerun > 0  # throughput/..., time/train, time/total: counted, not compared

    with pytest.warns(UserWarning, match="does not reproduce the record"):
        nudged = replay(factory, probe=Nudge(), epochs=[1], loggers=None)
    names = {m.name for m in nudged.mismatches}
    assert "loss/train/total" in names
    assert not any(n.startswith(("throughput/", "time/t", "time/val")) for n in names)


class FinalSum(Callback):
    """A probe that logs once, when the fit ends."""

    def fit_end(self, state, logger) -> None:
        total = float(sum(p.sum() for p in state.model.parameters()))
        logger.log_metrics({"probe/final_sum": total})


@pytest.fixture(scope="module")
def named_record(tmp_path_factory):
    """A two-epoch record under Composer's run name ``"alpha"``, and its factory."""
    root = tmp_path_factory.mktemp("composer-named")
    hindsight = EveryEpoch(root)

    def factory(**overrides):
        return make_trainer(epochs=2, algorithms=[hindsight], run_name="alpha", **overrides)

    factory().fit()
    return root, factory


def test_what_a_probe_logs_when_the_fit_ends_is_kept(named_record):
    _, factory = named_record
    memory = InMemoryLogger()
    make_trainer(epochs=2, callbacks=[FinalSum()], loggers=[memory]).fit()
    truth = [float(v) for _, v in memory.data["probe/final_sum"]]

    result = replay(factory, probe=FinalSum(), epochs=[1], loggers=None)
    final = result.metrics("probe/final_sum")
    assert final.value.tolist() == truth
    # Tagged as the record tags what its fit logs after the last epoch (the epoch after it).
    recorded_end = result.run.metrics("time/epoch", source="record").epoch.max()
    assert final.epoch.tolist() == [recorded_end] == [2]
    assert result.mismatches == []

    # A segment that stops before the record's end logs nothing the recorded fit logged there.
    middle = replay(factory, probe=FinalSum(), epochs=[0], loggers=None)
    assert middle.metrics("probe/final_sum").empty


class Noting(Callback):
    """Notes, in a file (segments run in worker processes), each end-of-fit hook it gets."""

    def __init__(self, path: Path, who: str) -> None:
        self.path, self.who = path, who

    def _note(self, what: str, epoch: int | None = None) -> None:
        with open(self.path, "a") as file:
            file.write(f"{self.who} {what} {epoch}\n")

    def fit_end(self, state, logger) -> None:
        self._note("fit_end", int(state.timestamp.epoch))

    def close(self, state, logger) -> None:
        self._note("close")

    def post_close(self) -> None:
        self._note("post_close")


class NotingAlgorithm(Algorithm):
    def __init__(self, path: Path) -> None:
        self.path = path

    def match(self, event, state) -> bool:
        return event == Event.FIT_END

    def apply(self, event, state, logger) -> None:
        with open(self.path, "a") as file:
            file.write(f"algorithm fit_end {int(state.timestamp.epoch)}\n")


def test_only_the_segment_that_ends_where_the_record_did_runs_the_end_of_fit(tmp_path):
    # Each segment's fit used to end with FIT_END although the recorded fit went on there: a
    # probe's fit_end ran at every segment's end, once per worker.
    notes = tmp_path / "notes.txt"
    hindsight = EveryEpoch(tmp_path / "record")

    def factory(**overrides):
        return make_trainer(
            epochs=3, algorithms=[hindsight, NotingAlgorithm(notes)],
            callbacks=[Noting(notes, "callback")], **overrides,
        )  # fmt: skip

    trainer = factory()
    trainer.fit()
    trainer.close()
    ended = ["algorithm fit_end 3", "callback fit_end 3"]
    closed = ["callback close None", "callback post_close None"]
    assert notes.read_text().splitlines() == [*ended, *closed]  # the record's

    def replayed(epochs, workers):
        notes.unlink()
        probe = Noting(notes, "probe")
        result = replay(factory, probe=probe, epochs=epochs, workers=workers, loggers=None)
        assert result.mismatches == [] and len(result.segments) == workers
        return sorted(notes.read_text().splitlines())

    probe_closed = ["probe close None", "probe post_close None"]
    # Two segments (the reference Trainer the replay builds closes too, without a fit).
    assert replayed([0, 1, 2], 2) == sorted(
        [*ended, "probe fit_end 3", *closed * 3, *probe_closed * 2]
    )
    assert replayed([0], 1) == sorted([*closed * 2, *probe_closed])  # no fit end at all


class FailsInEpoch1(Callback):
    def batch_end(self, state, logger) -> None:
        if int(state.timestamp.epoch) == 1 and int(state.timestamp.batch_in_epoch) == 5:
            raise RuntimeError("boom")


def test_no_segment_of_a_failed_record_runs_the_end_of_fit(tmp_path):
    # The fit failed inside epoch 1 and never ended: the segment ending after epoch 0 (the last
    # the record noted) used to hand its probes a FIT_END there.
    hindsight = EveryEpoch(tmp_path / "record")
    factory = lambda **overrides: make_trainer(epochs=3, algorithms=[hindsight], **overrides)  # noqa: E731
    trainer = factory(callbacks=[FailsInEpoch1()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    trainer.close()
    notes = tmp_path / "notes.txt"
    with pytest.warns(UserWarning, match="epoch 1"):  # it cannot be replayed
        result = replay(factory, probe=Noting(notes, "probe"), loggers=None)
    assert [s.last_epoch for s in result.segments] == [0] and result.mismatches == []
    assert notes.read_text().splitlines() == ["probe close None", "probe post_close None"]


def test_a_run_is_found_by_its_composer_run_name(named_record):
    _, factory = named_record
    result = replay(factory, probe=WeightNormProbe(), run="alpha", epochs=[1], loggers=None)
    assert result.run.name == "run_0001"
    assert len(result.metrics("probe/weight_norm")) == BATCHES


def test_a_record_without_its_max_duration_replays_as_before_with_a_warning(tmp_path):
    hindsight = EveryEpoch(tmp_path)
    factory = lambda **overrides: make_trainer(epochs=3, algorithms=[hindsight], **overrides)  # noqa: E731
    factory().fit()
    with sqlite3.connect(tmp_path / "hindsight.db") as conn:  # as an older version recorded it
        (text,) = conn.execute("SELECT config FROM runs").fetchone()
        config = json.loads(text)
        del config["max_duration"]
        conn.execute("UPDATE runs SET config = ?", (json.dumps(config),))
    conn.close()
    with pytest.warns(UserWarning, match="max_duration"):
        result = replay(factory, probe=WeightNormProbe(), epochs=[1], loggers=None)
    assert len(result.metrics("probe/weight_norm")) == BATCHES
    assert result.mismatches == []  # StepLR counts epochs, not the run's length
