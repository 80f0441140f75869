"""Records made with Lightning's weight averaging callbacks replay like any other.

``EMAWeightAveraging`` saves the *averaged* weights as the checkpoint's ``state_dict`` (the
training weights go to ``current_model_state``): memoized epochs used to train on them and
validate a stale average, so every replayed value differed. ``StochasticWeightAveraging`` keeps
its scheduler's function in its state, which a weights-only load refuses: its record's
checkpoints used to be called corrupt.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging

import stalwart
from stalwart.errors import CorruptCheckpointError, UnsafeCheckpointError
from stalwart.hindsight.checkpoint_file import read_checkpoint, write_checkpoint
from tests.helpers import QUIET, EpochProbe, EveryEpoch, GradProbe

EPOCHS = 4


AVERAGING = {
    "ema": lambda: EMAWeightAveraging(decay=0.9),
    "swa": lambda: StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2),
}


def fresh():
    L.seed_everything(7)
    return DigitsClassifier(width=16), DigitsDataModule(batch_size=128, train_size=384)


def trainer_for(kind, dirpath, probes=()) -> stalwart.Trainer:
    """A fresh Trainer with a fresh averaging callback, as a new session would make."""
    callbacks = [AVERAGING[kind](), EveryEpoch(dirpath=dirpath), *probes]
    return stalwart.Trainer(max_epochs=EPOCHS, callbacks=callbacks, deterministic=True, **QUIET)


def values(frame, epochs=None):
    if epochs is not None:
        frame = frame[frame.epoch.isin(epochs)]
    return frame[["epoch", "step", "value"]].reset_index(drop=True)


@pytest.fixture(scope="module", params=sorted(AVERAGING))
def runs(request, tmp_path_factory):
    """The record, and the same seeded fit with the probes there from the start."""
    kind = request.param
    record = tmp_path_factory.mktemp(f"{kind}_record")
    trainer_for(kind, record).fit(*fresh())
    truth = tmp_path_factory.mktemp(f"{kind}_truth")
    trainer_for(kind, truth, [EpochProbe(), GradProbe()]).fit(*fresh())
    return kind, record, stalwart.hindsight.open(truth).run()


@pytest.mark.parametrize("init", ["weak", "strong"])
def test_an_outer_loop_replay_restores_the_training_and_the_averaged_weights(runs, init):
    kind, record, truth = runs
    result = trainer_for(kind, record).replay(*fresh(), probe=EpochProbe(), init=init)
    assert result.batches_executed == 0
    assert values(result.metrics("w_norm")).equals(values(truth.metrics("w_norm")))
    assert result.mismatches == []  # val_loss, validated on the averaged weights, too


def test_an_inner_loop_replay_resumed_from_an_averaged_checkpoint_is_exact(runs):
    kind, record, truth = runs
    result = trainer_for(kind, record).replay(*fresh(), probe=GradProbe(), epochs=[2, 3])
    assert [s.resume_from for s in result.segments] == [1]
    expected = values(truth.metrics("grad_norm"), [2, 3])
    assert values(result.metrics("grad_norm")).equals(expected)
    assert result.mismatches == []


def test_a_checkpoint_with_swa_state_is_unsafe_not_corrupt_and_loads_when_trusted(runs):
    kind, record, _ = runs
    if kind != "swa":
        pytest.skip("only SWA's state holds objects a weights-only load refuses")
    last = stalwart.hindsight.open(record).run().checkpoints()[-1]
    with pytest.raises(UnsafeCheckpointError, match=r"intact.*GLOBAL getattr.*weights_only=False"):
        last.load()
    assert last.load(weights_only=False)["global_step"] == last.step


class NotATensor:
    """A class torch's weights-only unpickler does not know."""


def test_a_disallowed_global_is_unsafe_and_a_damaged_file_still_corrupt(tmp_path):
    path = tmp_path / "epoch=0000.ckpt"
    written = write_checkpoint({"w": torch.ones(3), "extra": NotATensor()}, path)
    with pytest.raises(UnsafeCheckpointError, match="NotATensor") as caught:
        read_checkpoint(path, written.nbytes, written.crc32)
    assert not isinstance(caught.value, CorruptCheckpointError)
    loaded = read_checkpoint(path, written.nbytes, written.crc32, weights_only=False)
    assert isinstance(loaded["extra"], NotATensor)
    with pytest.raises(CorruptCheckpointError):  # the index no longer matches the bytes
        read_checkpoint(path, written.nbytes, written.crc32 ^ 1)
