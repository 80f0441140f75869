"""What the record charges itself: the costs a user's wall clock pays that no checkpoint shows."""

from __future__ import annotations

import lightning as L
from digits import DigitsClassifier, DigitsDataModule

import stalwart
import stalwart.callbacks.hindsight as hindsight_callback
from stalwart.callbacks.lightning_internals import HOOKS_PER_BATCH, hook_dispatch_seconds
from stalwart.hindsight.materializer import ForkMaterializer

EPOCHS = 3


class EveryEpoch(stalwart.HindsightCallback):
    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return True


def fit(callback: stalwart.HindsightCallback) -> L.Trainer:
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        limit_train_batches=10,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(DigitsClassifier(width=32), DigitsDataModule())
    return trainer


def test_lightnings_dispatch_of_every_hook_of_every_batch_is_charged(tmp_path, monkeypatch):
    # A dispatch priced at 10 ms per hook must show, batch for batch, in the record's figure.
    monkeypatch.setattr(hindsight_callback, "hook_dispatch_seconds", lambda trainer, cb: 0.01)
    callback = stalwart.HindsightCallback(dirpath=tmp_path, epsilon=1e-6)
    fit(callback)
    batches = EPOCHS * 10
    assert callback.recorder.policy.total_fixed >= batches * HOOKS_PER_BATCH[True] * 0.01


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
