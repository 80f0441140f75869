"""Composer Shrink: shrunken delta checkpoints through Composer's saver, resumed via load_path."""

from __future__ import annotations

import pytest
import torch
from composer.loggers import InMemoryLogger
from composer_digits import make_trainer

import stalwart.shrink
from stalwart.algorithms import Shrink
from stalwart.shrink.container import is_shrunk_file, read_header


@pytest.fixture(scope="module")
def shrunk_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("composer-shrink")
    shrink = Shrink(tau=0.05)
    memory = InMemoryLogger()
    make_trainer(
        epochs=4, algorithms=[shrink], save_folder=str(folder), save_interval="1ep",
        loggers=[memory],
    ).fit()  # fmt: skip
    accuracy = [float(v) for _, v in memory.data["metrics/eval/MulticlassAccuracy"]]
    return folder, shrink, accuracy


def test_checkpoints_are_shrunken_deltas_within_the_quality_bound(shrunk_run):
    folder, shrink, _ = shrunk_run
    files = [folder / f"ep{e}-ba{11 * e}-rank0.pt" for e in range(1, 5)]
    assert all(is_shrunk_file(f) for f in files)
    assert [read_header(f)["kind"] for f in files] == ["keyframe", "delta", "delta", "delta"]
    assert all(r.degradation is not None and r.degradation <= 0.05 for r in shrink.reports)
    assert all(r.ratio > 2 for r in shrink.reports)  # quantized weights, not a plain copy


def test_restored_from_a_shrunken_checkpoint_training_continues(shrunk_run):
    folder, _, accuracy = shrunk_run
    delta = folder / "ep2-ba22-rank0.pt"
    memory = InMemoryLogger()
    resumed = Shrink(tau=0.05)
    trainer = make_trainer(
        epochs=6, algorithms=[resumed], save_folder=str(folder), save_interval="1ep",
        load_path=str(delta), save_overwrite=True, loggers=[memory],
    )  # fmt: skip
    assert int(trainer.state.timestamp.epoch) == 2
    decoded = stalwart.shrink.load(delta)
    restored = trainer.state.model.state_dict()
    assert all(torch.equal(restored[name], decoded[name]) for name in decoded)
    trainer.fit()
    after = [float(v) for _, v in memory.data["metrics/eval/MulticlassAccuracy"]]
    assert len(after) == 4 and after[-1] > accuracy[1] and after[-1] > 0.85  # it kept learning
    # The resumed run extends the chain it was restored from.
    assert resumed.reports[0].base is not None
    assert read_header(folder / "ep6-ba66-rank0.pt")["kind"] == "delta"


def test_latest_symlink_and_rotation_never_break_a_chain(tmp_path):
    shrink = Shrink(tau=0.05, keyframe_every=2)
    make_trainer(
        epochs=4, algorithms=[shrink], save_folder=str(tmp_path), save_interval="1ep",
        save_num_checkpoints_to_keep=1,
    ).fit()  # fmt: skip
    kept = sorted(p.name for p in tmp_path.glob("ep*.pt"))
    # ep3 is the keyframe the surviving delta ep4 needs; ep1 and ep2 are deleted.
    assert kept == ["ep3-ba33-rank0.pt", "ep4-ba44-rank0.pt"]
    trainer = make_trainer(
        epochs=5, load_path=str(tmp_path / "latest-rank0.pt"), algorithms=[Shrink()],
        save_folder=str(tmp_path / "resumed"),
    )  # fmt: skip
    assert int(trainer.state.timestamp.epoch) == 4
