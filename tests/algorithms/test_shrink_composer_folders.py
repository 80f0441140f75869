"""Composer Shrink with checkpoints in more than one folder: a delta is only written against a
file of its own folder, so Composer's rotation (``save_num_checkpoints_to_keep``) and deleting
an earlier run's folder never break a checkpoint that is kept."""

from __future__ import annotations

import shutil

from composer_digits import make_trainer

import stalwart.shrink
from stalwart.algorithms import Shrink
from stalwart.shrink.container import is_shrunk_file


def _fit(shrink: Shrink, folder, epochs: int, **overrides) -> None:
    trainer = make_trainer(
        width=8, epochs=epochs, algorithms=[shrink], save_folder=str(folder), save_interval="1ep",
        **overrides,
    )  # fmt: skip
    trainer.fit()
    trainer.close()


def _every_file_restores(folder) -> int:
    """How many checkpoints ``folder`` holds (Composer's ``latest`` link loaded, not counted)."""
    files = [p for p in folder.rglob("*.pt") if is_shrunk_file(p)]
    for path in files:
        stalwart.shrink.load(path)  # raises CorruptCheckpointError naming a broken chain
    return sum(not path.is_symlink() for path in files)


def test_a_folder_per_checkpoint_with_rotation_keeps_the_last_file_restorable(tmp_path):
    # "ep{epoch}/model.pt" and keeping one checkpoint: each file was a delta on the one in the
    # folder before, which the rotation deleted.
    shrink = Shrink(grad_window=0, compress_optimizer="lossless")
    _fit(
        shrink, tmp_path, epochs=3, save_filename="ep{epoch}/model.pt",
        save_num_checkpoints_to_keep=1,
    )  # fmt: skip
    assert [report.kind for report in shrink.reports] == ["keyframe"] * 3
    assert _every_file_restores(tmp_path) == 1


def test_one_shrink_reused_by_a_second_trainer_does_not_extend_the_first_runs_folder(tmp_path):
    shrink = Shrink(grad_window=0, compress_optimizer="lossless")
    _fit(shrink, tmp_path / "runA", epochs=2)
    _fit(shrink, tmp_path / "runB", epochs=2)
    assert [report.kind for report in shrink.reports] == ["keyframe", "delta"] * 2
    shutil.rmtree(tmp_path / "runA")
    assert _every_file_restores(tmp_path / "runB") == 2
