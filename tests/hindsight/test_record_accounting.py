"""What the record charges itself: the costs a user's wall clock pays that no checkpoint shows."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
from digits import DigitsClassifier, DigitsDataModule

import stalwart
import stalwart.callbacks.hindsight as hindsight_callback
from stalwart.callbacks.lightning_internals import dispatched_per_batch, hook_dispatch_seconds
from stalwart.hindsight.materializer import ForkMaterializer, Materializer
from stalwart.hindsight.recorder import Recorder
from tests.helpers import SectionNames, callback_hooks_called

EPOCHS = 3


class EveryEpoch(stalwart.HindsightCallback):
    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return True


def fit(callback: stalwart.HindsightCallback | list, **trainer_args) -> L.Trainer:
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        limit_train_batches=10,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callback if isinstance(callback, list) else [callback],
        **trainer_args,
    )
    trainer.fit(DigitsClassifier(width=32), DigitsDataModule())
    return trainer


def test_lightnings_dispatch_of_every_hook_of_every_batch_is_charged(tmp_path, monkeypatch):
    # A dispatch priced at 10 ms per hook must show, batch for batch, in the record's figure.
    monkeypatch.setattr(hindsight_callback, "hook_dispatch_seconds", lambda trainer, cb: 0.01)
    callback = stalwart.HindsightCallback(dirpath=tmp_path, epsilon=1e-6)
    fit(callback)
    batches = EPOCHS * 10
    assert dispatched_per_batch(callback, automatic_optimization=True) == 1
    assert callback.recorder.policy.total_fixed >= batches * 0.01


def test_lightning_hands_the_record_only_the_hooks_it_implements(tmp_path):
    # Every other hook of every batch, each in a profiler section, cost more than the record's
    # own per-batch work: Lightning skips them (and the test fails if it stops skipping, or
    # if an unused hook is handed to the record again).
    profiler = SectionNames()
    callback = stalwart.HindsightCallback(dirpath=tmp_path)
    fit(callback, profiler=profiler)
    called = callback_hooks_called(profiler, callback)
    assert called.count("on_train_batch_end") == EPOCHS * 10
    # Hooks the record implements, and the one Lightning calls directly on every callback
    # (when it builds a checkpoint, as the record's own snapshot does).
    expected = set(vars(stalwart.HindsightCallback)) | {"on_save_checkpoint"}
    assert set(called) <= expected, set(called) - expected
    for unused in ("on_train_batch_start", "on_before_backward", "on_validation_batch_end"):
        assert unused not in called


class CountsCommittedLosses(L.Callback):
    """Reads, from its own connection, how many train_loss values the record has committed."""

    def __init__(self, db) -> None:
        self.db = db
        self.committed: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == 0 and batch_idx == 5:
            with contextlib.closing(sqlite3.connect(self.db)) as db:
                query = "SELECT COUNT(*) FROM metrics WHERE name = 'train_loss'"
                self.committed.append(db.execute(query).fetchone()[0])


def test_logged_values_are_committed_during_an_epoch_not_only_at_its_end(tmp_path, monkeypatch):
    # A crash mid-epoch loses at most LOG_FLUSH_SECONDS of logged values: the record commits
    # them from inside the logging calls once that long has passed (here: at once), although
    # it does no work of its own after each batch.
    monkeypatch.setattr(hindsight_callback, "LOG_FLUSH_SECONDS", 0.0)
    peek = CountsCommittedLosses(tmp_path / "hindsight.db")
    fit([stalwart.HindsightCallback(dirpath=tmp_path), peek])
    assert peek.committed == [6]  # batches 0-5 each logged one


def test_an_epoch_cut_short_counts_the_batches_it_ran(tmp_path):
    # The batches of an epoch are counted at its end: also when max_steps stops it before its
    # last batch, which the record otherwise notes the end of training batches at.
    fit([stalwart.HindsightCallback(dirpath=tmp_path)], max_steps=13)
    with stalwart.hindsight.open(tmp_path) as store:
        assert store.run().epoch_work().batches.tolist() == [10, 3]


class WithOwnHook(stalwart.HindsightCallback):
    seen = 0

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.seen += 1


def test_a_subclass_keeps_the_hooks_it_adds(tmp_path):
    profiler = SectionNames()
    callback = WithOwnHook(dirpath=tmp_path)
    fit(callback, profiler=profiler)
    assert callback.seen == EPOCHS * 10
    assert callback_hooks_called(profiler, callback).count("on_before_backward") == EPOCHS * 10
    # ...and that hook's dispatch is charged with the rest.
    assert dispatched_per_batch(callback, automatic_optimization=True) == 2


def test_the_measured_dispatch_of_one_hook_is_microseconds(tmp_path):
    callback = stalwart.HindsightCallback(dirpath=tmp_path)
    trainer = fit(callback)
    assert 0 < hook_dispatch_seconds(trainer, callback) < 1e-3


def test_what_background_writes_take_is_charged_to_the_checkpoints(tmp_path, monkeypatch):
    materializer = ForkMaterializer(small_bytes=1 << 30)  # every checkpoint: copy + thread
    # Priced at 1 s per epoch end, the background cost must reach the record's figure.
    monkeypatch.setattr(materializer, "take_background_cost", lambda: 1.0)
    callback = EveryEpoch(dirpath=tmp_path, materializer=materializer)
    fit(callback)
    assert materializer.forks == 0 and materializer.copies == EPOCHS + 1  # + the initial state
    policy = callback.recorder.policy
    assert policy.total_materialize - policy.total_fixed >= EPOCHS * 1.0
    with stalwart.hindsight.open(tmp_path) as store:
        assert [c.epoch for c in store.run().checkpoints()] == list(range(EPOCHS))


class SlowFirstBatch(L.Callback):
    """Holds the first training batch for ``seconds``: an epoch as long as a real one."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == 0 and batch_idx == 0:
            time.sleep(self.seconds)


def test_the_first_checkpoints_price_is_measured_beside_the_first_epoch(tmp_path, monkeypatch):
    """The first decision needs a checkpoint's price: its write probed on the writer thread
    behind init.ckpt, not on the training thread at the first epoch's end (~14 ms of a 10 MB
    state's 2-second fit)."""
    import stalwart.hindsight.materializer as materializer_module

    probed_on: list[str] = []
    real_probe_write = materializer_module._probe_write

    def probe_write(*args, **kwargs):
        probed_on.append(threading.current_thread().name)
        return real_probe_write(*args, **kwargs)

    monkeypatch.setattr(materializer_module, "_probe_write", probe_write)
    callback = stalwart.HindsightCallback(dirpath=tmp_path)
    fit([callback, SlowFirstBatch(0.3)])
    assert probed_on == ["stalwart-checkpoint-writer"]
    with stalwart.hindsight.open(tmp_path) as store:
        first = store.run().decisions().iloc[0]
    assert 0 < first.materialize_cost < 0.1  # the probe's price, for a 0.1 MB state
    assert not any(path.name.startswith(".") for path in tmp_path.rglob("*"))


class SlowingWriter(Materializer):
    """A writer thread stand-in: each write reports 1 s of CPU time and is in flight for the
    whole next epoch, which it slows by SLOWDOWN seconds (so the record has a real slowdown to
    measure against clean epochs). Its submit takes COST on the test's clock, ``now``."""

    name = "slowing"
    SLOWDOWN = 0.02
    COST = 1e-3

    def __init__(self, now: list[float]) -> None:
        super().__init__()
        self.now = now
        self.in_flight = False
        self.untaken = 0

    def probe_cost(self, nbytes: int, directory) -> float:
        return self.COST

    def submit(self, job) -> float:
        self.now[0] += self.COST
        self.in_flight = True
        self.untaken += 1
        return self.COST

    @property
    def busy(self) -> bool:
        return self.in_flight

    def take_background_cost(self) -> float:
        taken, self.untaken = self.untaken, 0
        return float(taken)


def charged_on_an_injected_clock(tmp_path, monkeypatch, epochs: int, epoch_seconds) -> Any:
    """Records ``epochs`` epochs of ``epoch_seconds(epoch)`` on an injected clock, each write
    by a :class:`SlowingWriter` slowing the epoch after it; checkpoints at even epochs, so odd
    epochs carry a write and even ones are clean. Returns the interference charged per epoch."""
    import stalwart.hindsight.recorder as recorder_module

    now = [0.0]
    monkeypatch.setattr(recorder_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    writer = SlowingWriter(now)
    recorder = Recorder(tmp_path, materializer=writer)
    recorder.begin(hparams={}, fingerprints={}, config={})
    recorder.train_started()
    for epoch in range(epochs):
        recorder.epoch_started()
        now[0] += epoch_seconds(epoch) + (SlowingWriter.SLOWDOWN if writer.in_flight else 0.0)
        even = epoch % 2 == 0
        recorder.epoch_ended(epoch, state_bytes=lambda: 1000, veto=lambda _, even=even: even)
        writer.in_flight = False  # written during the epoch that just ended
        recorder.materialize_due(lambda: {"weights": None}, step=epoch)
    recorder.finish("completed")
    with stalwart.hindsight.open(tmp_path) as store:
        return store.run().decisions().set_index("epoch").interference


def test_a_writer_threads_cpu_time_stands_in_only_until_clean_epochs_measure_its_slowdown(
    tmp_path, monkeypatch
):
    # Epochs of exactly 30 ms, 20 ms more with a write in flight (not slept: a loaded machine
    # stalled a few epochs by more than the slowdown being measured).
    charged = charged_on_an_injected_clock(tmp_path, monkeypatch, 14, lambda epoch: 0.03)
    # Epochs 1, 3, 5, 7 ran before four clean epochs (2, 4, 6, 8) existed: the CPU time stands in.
    assert charged[[1, 3, 5, 7]].tolist() == [1.0] * 4
    # Later writes are charged the slowdown measured (20 ms each), not 1 s of CPU time; the
    # clean epochs nothing.
    assert charged[[9, 11, 13]].tolist() == pytest.approx([SlowingWriter.SLOWDOWN] * 3)
    assert charged[[0, 2, 4, 6, 8, 10, 12]].tolist() == [0.0] * 7


def test_a_machine_slowing_down_midrun_is_not_charged_to_the_checkpoints(tmp_path, monkeypatch):
    # Epochs of 30 ms, from epoch 14 on 45 ms (the whole machine slowed, as this one's does
    # between its fast and slow modes), 20 ms more with a write in flight.
    charged = charged_on_an_injected_clock(
        tmp_path, monkeypatch, 30, lambda epoch: 0.03 if epoch < 14 else 0.045
    )
    assert charged[[9, 11, 13]].tolist() == pytest.approx([SlowingWriter.SLOWDOWN] * 3)
    # Once three clean epochs (14, 16, 18) say the machine is slower, each write is charged its
    # own 20 ms again, not the 15 ms every epoch slowed by beside it (35 ms: 1.75x the price).
    assert charged[[19, 21, 23, 25, 27, 29]].tolist() == pytest.approx([SlowingWriter.SLOWDOWN] * 6)
    # Only the two writes between the move and the third slow clean epoch (15, 17) pay for it.
    assert charged[[15, 17]].tolist() == pytest.approx([SlowingWriter.SLOWDOWN + 0.015] * 2)
