"""What a replay that does not reproduce its record says about why, where Lightning's own data
iterators are the cause (not a mechanism that stalwart fixes: a hint that names it).

Lightning builds a training iterator in ``FitLoop.setup_data`` and, in an epoch past 0 that no
fit resumed into, again at the epoch loop's start; each draws a seed from the global RNG. A fit
resumed from a checkpoint (every replay segment) builds it once.
"""

from __future__ import annotations

import warnings

import lightning as L
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart import HindsightCallback
from tests.helpers import QUIET


class EveryOtherEpoch(HindsightCallback):
    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return trainer.current_epoch % 2 == 1


class BatchProbe(L.Callback):
    """Inner-loop: the mean of every training batch (which data the epoch drew)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("batch_mean", batch[0].double().mean())


def fresh():
    L.seed_everything(5)
    return DigitsClassifier(width=16), DigitsDataModule(batch_size=128, train_size=384)


def replay(trainer, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.replay(*fresh(), probe=BatchProbe(), **kwargs)
    said = [str(w.message) for w in caught if "does not reproduce" in str(w.message)]
    return result, said


def test_reloaded_dataloaders_are_named_and_init_strong_suggested(tmp_path):
    def trainer() -> stalwart.Trainer:
        return stalwart.Trainer(
            max_epochs=4, reload_dataloaders_every_n_epochs=1, deterministic=True,
            callbacks=[EveryOtherEpoch(dirpath=tmp_path)], **QUIET,
        )  # fmt: skip

    trainer().fit(*fresh())
    # Epochs 2 and 3 from epoch 1's checkpoint: each recorded epoch drew two seeds, the
    # resumed fit's first epoch one, so the batches differ from there on.
    result, said = replay(trainer(), epochs=[2, 3])
    assert result.mismatches
    (warning,) = said
    assert "reload_dataloaders_every_n_epochs" in warning and "init='strong'" in warning
    assert "fit() continued" not in warning
    # The hint holds: from the start of the fit, the iterators are built as recorded.
    result, said = replay(trainer(), epochs=[2, 3], init="strong")
    assert result.mismatches == [] and said == []


def test_a_fit_continued_on_the_same_trainer_is_named(tmp_path):
    trainer = stalwart.Trainer(
        max_epochs=2, deterministic=True, callbacks=[HindsightCallback(dirpath=tmp_path)], **QUIET
    )
    model, data = fresh()
    trainer.fit(model, data)
    trainer.fit_loop.max_epochs = 4
    trainer.fit(model, data)  # run_0002: epochs 2 and 3
    result, said = replay(trainer, run="run_0002", epochs=[2, 3], init="strong")
    assert result.mismatches
    (warning,) = said
    assert "run_0002 starts at epoch 2 without resuming" in warning
    assert "ckpt_path" in warning


def test_a_resumed_run_is_not_taken_for_a_continued_fit(tmp_path):
    """A run resumed with ckpt_path also starts past epoch 0, and replays exactly."""

    def trainer(epochs: int) -> stalwart.Trainer:
        return stalwart.Trainer(
            max_epochs=epochs, deterministic=True,
            callbacks=[EveryOtherEpoch(dirpath=tmp_path)], **QUIET,
        )  # fmt: skip

    trainer(2).fit(*fresh())
    start = stalwart.hindsight.open(tmp_path).run().checkpoint(1).path
    trainer(4).fit(*fresh(), ckpt_path=start)
    result, said = replay(trainer(4), run="run_0002", epochs=[2, 3])
    assert result.mismatches == [] and said == []
