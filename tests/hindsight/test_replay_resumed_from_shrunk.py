"""Lightning: a record resumed from a ``ShrinkCheckpoint`` file (``fit(ckpt_path=...)``, as
docs/shrink.md says) replays: the start it resumed from is read through the shrunken format
(by the Lightning adapter; the hindsight core reads torch.save files only), both when the
replay checks the model against it and by the segment's Trainer, which leaves the record's
ShrinkCheckpoint (and with it its checkpoint IO) out."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.precision import DoublePrecision

import stalwart
import stalwart.shrink
from stalwart import HindsightCallback, ShrinkCheckpoint
from stalwart.errors import CorruptCheckpointError
from stalwart.hindsight.checkpoint_file import checksum_file
from stalwart.hindsight.store import CheckpointEntry
from stalwart.plugins.shrink_io import ShrinkCheckpointIO
from stalwart.shrink.container import is_shrunk_file
from stalwart.trainer import _load_start, _reading_shrunken_files
from tests.helpers import QUIET, GradProbe

BATCHES = 4  # 512 training samples / 128


class OddEpochs(HindsightCallback):
    """Checkpoints after epochs 1, 3, ...: the resumed fit's first epoch starts from the
    shrunken file, its later ones from the record's own checkpoint."""

    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return trainer.current_epoch % 2 == 1


class Kept(GradProbe):
    """The probe's values, kept for comparing (a fit with the probe from the start)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.values.append(float(pl_module.net[0].weight.grad.norm()))


def fresh():
    L.seed_everything(11)
    return DigitsClassifier(width=32), DigitsDataModule(batch_size=128, train_size=512)


def trainer(trainer_class, callbacks, epochs=5) -> L.Trainer:
    quiet = {**QUIET, "enable_checkpointing": True}
    return trainer_class(max_epochs=epochs, callbacks=callbacks, deterministic=True, **quiet)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A plain fit of 2 epochs writes shrunken files; a recorded fit resumes from epoch 1's,
    and a rerun (the ground truth) resumes from it too with the probe attached from the start."""
    root = tmp_path_factory.mktemp("shrunk")
    first = ShrinkCheckpoint(dirpath=root / "first")
    trainer(L.Trainer, [first], epochs=2).fit(*fresh())
    start = first.reports[-1].path
    assert is_shrunk_file(start)
    with warnings.catch_warnings():  # the resumed fits run other callbacks than the first
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
        warnings.filterwarnings("ignore", message="The dirpath has changed")
        recording = [OddEpochs(dirpath=root / "record"), ShrinkCheckpoint(dirpath=root / "ck")]
        record = trainer(stalwart.Trainer, recording)
        record.fit(*fresh(), ckpt_path=start)
        kept = Kept()
        rerun = trainer(L.Trainer, [kept, ShrinkCheckpoint(dirpath=root / "rerun")])
        rerun.fit(*fresh(), ckpt_path=start)
    return record, kept.values, start


@pytest.mark.parametrize("workers", [1, 2])
def test_a_record_resumed_from_a_shrunken_file_replays_bit_for_bit(resumed, workers):
    record, truth, _ = resumed
    result = record.replay(*fresh(), probe=GradProbe(), workers=workers)
    assert [s.resume_from for s in result.segments] == ([1] if workers == 1 else [1, 3])
    assert result.mismatches == []  # train_loss, val_loss and val_acc of epochs 2..4 exactly
    grad_norm = result.metrics("grad_norm")
    assert grad_norm.epoch.tolist() == [2] * BATCHES + [3] * BATCHES + [4] * BATCHES
    assert grad_norm.value.tolist() == truth  # bit for bit, the first epoch's too


def test_a_shrunken_start_is_verified_and_read_as_the_lightning_checkpoint(resumed):
    _, _, start = resumed
    nbytes, crc32 = checksum_file(start)
    checkpoint = _load_start(CheckpointEntry(1, 1, 8, Path(start), nbytes, crc32))
    assert checkpoint["epoch"] == 1 and checkpoint["optimizer_states"]
    weights = stalwart.shrink.load(start)
    assert checkpoint["state_dict"].keys() == weights.keys()
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in weights.items())
    # Checked against the size and CRC-32 the record noted before anything is decoded.
    with pytest.raises(CorruptCheckpointError, match="does not match|changed|CRC"):
        _load_start(CheckpointEntry(1, 1, 8, Path(start), nbytes, crc32 ^ 1))


def test_a_segment_trainer_reads_shrunken_files_with_a_fresh_plugin_of_its_own():
    users = ShrinkCheckpointIO(delegate=TorchCheckpointIO())
    precision = DoublePrecision()
    kwargs = _reading_shrunken_files({"plugins": [precision, users], "max_epochs": 3})
    assert kwargs["max_epochs"] == 3
    assert kwargs["plugins"][0] is precision
    (reader,) = kwargs["plugins"][1:]
    assert isinstance(reader, ShrinkCheckpointIO) and reader is not users  # its chain untouched
    assert reader.delegate is users.delegate
    other = TorchCheckpointIO()
    assert _reading_shrunken_files({"plugins": other})["plugins"][0].delegate is other
