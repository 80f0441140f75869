"""Checkpoints in more than one folder: a delta is only ever written against a file of its own
folder, so retiring files in one folder (save_top_k) or deleting a whole folder (an old run's)
never breaks a checkpoint elsewhere; and ``stalwart shrink inspect`` marks what cannot be
restored."""

import logging
import shutil

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import ModelCheckpoint

import stalwart.shrink as shrink
from stalwart import ShrinkCheckpoint
from stalwart.cli import main
from stalwart.plugins import ShrinkCheckpointIO
from stalwart.shrink.chain import ChainWriter
from stalwart.shrink.container import is_shrunk_file
from stalwart.shrink.partition import QuantConfig
from tests.helpers import QUIET

WITH_CHECKPOINTS = {**QUIET, "enable_checkpointing": True}


def _fit(callbacks, epochs, *, plugins=(), ckpt_path=None):
    trainer = L.Trainer(
        max_epochs=epochs, callbacks=callbacks, plugins=list(plugins), **WITH_CHECKPOINTS
    )
    trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=500), ckpt_path=ckpt_path)


def _every_file_restores(folder):
    files = [p for p in folder.rglob("*") if is_shrunk_file(p) and not p.name.startswith(".")]
    assert files, f"no checkpoints in {folder}"
    for path in files:
        shrink.load(path)  # raises CorruptCheckpointError naming a broken chain
    return files


@pytest.mark.parametrize("background", [False, True], ids=["in-the-fit", "background"])
def test_a_folder_per_checkpoint_with_save_top_k_leaves_the_kept_file_restorable(
    tmp_path, caplog, background
):
    # "{epoch}/model" (or a metric named "val/acc" in the filename) puts each checkpoint in a
    # folder of its own; save_top_k=1 retires the older ones in their folders. The kept file
    # was a delta on a file of another folder, which was deleted.
    callback = ShrinkCheckpoint(
        dirpath=tmp_path, filename="{epoch}/model", save_top_k=1, background=background
    )
    with caplog.at_level(logging.INFO, logger="stalwart.shrink.chain"):
        _fit([callback], epochs=3)
    assert [report.kind for report in callback.reports] == ["keyframe"] * 3
    (kept,) = _every_file_restores(tmp_path)
    assert kept.resolve() == (tmp_path / "epoch=2" / "model.ckpt").resolve()
    shrink.load(callback.best_model_path)
    warned = [r for r in caplog.records if "starts a new keyframe" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.INFO]  # loudly once
    # The advice covers both ways into a new folder: a '/' in the filename, a new dirpath.
    assert "resume into the same dirpath" in warned[0].getMessage()
    assert "no '/' in the filename" in warned[0].getMessage()


def test_io_plugin_saves_by_hand_into_another_folder_break_nothing(tmp_path):
    # ModelCheckpoint(save_top_k=1) in best/ and trainer.save_checkpoint into exports/ each
    # epoch: the chain ran best -> exports -> best, and retiring in best/ deleted the base an
    # export needed (and the export the kept best file needed).
    class Export(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch:
                trainer.save_checkpoint(tmp_path / "exports" / f"epoch{trainer.current_epoch}.ckpt")

    best = ModelCheckpoint(dirpath=tmp_path / "best", save_top_k=1, monitor="train_loss")
    _fit([best, Export()], epochs=3, plugins=[ShrinkCheckpointIO(config=QuantConfig(bins=16))])
    assert len(_every_file_restores(tmp_path)) == 3  # one in best/, two exports


def test_a_run_resumed_into_a_new_folder_restores_without_the_old_one(tmp_path):
    first = ShrinkCheckpoint(dirpath=tmp_path / "run1")
    _fit([first], epochs=2)
    second = ShrinkCheckpoint(dirpath=tmp_path / "run2")
    _fit([second], epochs=4, ckpt_path=first.reports[-1].path)
    assert [report.kind for report in second.reports] == ["keyframe", "delta"]
    shutil.rmtree(tmp_path / "run1")  # the old run, superseded by the resumed one
    assert len(_every_file_restores(tmp_path / "run2")) == 2


def _weights(seed):
    return {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))}


def test_a_chain_resumed_in_its_own_folder_stays_a_delta_and_elsewhere_starts_a_keyframe(
    tmp_path,
):
    (tmp_path / "a").mkdir()
    writer = ChainWriter(config=QuantConfig(bins=16), compress_optimizer="lossless")
    writer.save(_weights(0), None, tmp_path / "a" / "0.shrunk")
    resumed = ChainWriter(config=QuantConfig(bins=16), compress_optimizer="lossless")
    resumed.load(tmp_path / "a" / "0.shrunk")
    assert resumed.save(_weights(1), None, tmp_path / "a" / "1.shrunk").kind == "delta"
    assert resumed.save(_weights(2), None, tmp_path / "b" / "2.shrunk").kind == "keyframe"
    assert resumed.save(_weights(3), None, tmp_path / "b" / "3.shrunk").kind == "delta"


def _chain(folder, names, *, previous=None):
    """A chain of small shrunken files, each a delta on the one before."""
    report = previous
    for seed, name in enumerate(names):
        report = shrink.save(_weights(seed), folder / name, previous=report)
    return report


def test_inspect_marks_files_whose_chain_is_broken_and_fails(tmp_path, capsys):
    _chain(tmp_path, ["a.shrunk", "b.shrunk", "c.shrunk", "d.shrunk"])
    (tmp_path / "b.shrunk").unlink()
    assert main(["shrink", "inspect", str(tmp_path)]) == 2
    said = capsys.readouterr()
    kinds = {cells[0]: cells[1] for cells in map(str.split, said.out.splitlines()) if cells}
    assert (kinds["a.shrunk"], kinds["c.shrunk"], kinds["d.shrunk"]) == (
        "keyframe",
        "delta!",
        "delta!",
    )
    assert "! d.shrunk cannot be restored: its chain needs b.shrunk, which is missing" in said.out
    assert "3 checkpoint(s) (2 cannot be restored, left out of the totals)" in said.out
    assert "c.shrunk, d.shrunk" in said.err and "Traceback" not in said.err
    # A replaced base (another checkpoint at its path) is found as restore finds it.
    shrink.save(_weights(9), tmp_path / "b.shrunk")
    assert main(["shrink", "inspect", str(tmp_path / "d.shrunk")]) == 2
    assert "b.shrunk, which was replaced by a different checkpoint" in capsys.readouterr().out


def test_inspect_shows_a_base_in_another_folder_as_such(tmp_path, capsys):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run2").mkdir()
    first = _chain(tmp_path / "run1", ["a.shrunk"])  # stalwart.shrink.save may still do this
    _chain(tmp_path / "run2", ["b.shrunk"], previous=first)
    assert main(["shrink", "inspect", str(tmp_path / "run2")]) == 0
    shown = capsys.readouterr().out
    assert "../run1/a.shrunk" in shown and "a base outside" in shown
    shutil.rmtree(tmp_path / "run1")
    assert main(["shrink", "inspect", str(tmp_path / "run2")]) == 2
    assert "its chain needs ../run1/a.shrunk, which is missing" in capsys.readouterr().out


def test_restore_of_a_folder_is_one_clear_error(tmp_path, capsys):
    _chain(tmp_path, ["a.shrunk"])
    assert main(["shrink", "restore", str(tmp_path), str(tmp_path / "out.pt")]) == 2
    error = capsys.readouterr().err
    assert "is a folder" in error and "stalwart shrink inspect" in error
    assert "Traceback" not in error and not (tmp_path / "out.pt").exists()


def test_a_chain_resumed_through_a_link_into_another_folder_is_read_there(tmp_path):
    # b/latest.shrunk -> ../a/1.shrunk: its base is beside the file, in a/, not beside the link;
    # and the chain continues from a/, so a save into b/ starts a keyframe, one into a/ a delta.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _chain(tmp_path / "a", ["0.shrunk", "1.shrunk"])
    (tmp_path / "b" / "latest.shrunk").symlink_to("../a/1.shrunk")
    writer = ChainWriter(config=QuantConfig(bins=16), compress_optimizer="lossless")
    weights, _ = writer.load(tmp_path / "b" / "latest.shrunk")
    assert torch.equal(weights["w"], shrink.load(tmp_path / "a" / "1.shrunk")["w"])
    assert writer.save(_weights(2), None, tmp_path / "b" / "2.shrunk").kind == "keyframe"
    writer.load(tmp_path / "b" / "latest.shrunk")
    assert writer.save(_weights(3), None, tmp_path / "a" / "3.shrunk").kind == "delta"
    (tmp_path / "b" / "latest.shrunk").unlink()
    (tmp_path / "b" / "latest.shrunk").symlink_to("../a/3.shrunk")  # the link moves on
    assert len(_every_file_restores(tmp_path / "a")) == 3


def _tear(path):
    """Cut ``path`` in half, as a full disk or an interrupted copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_inspect_lists_the_good_files_beside_a_torn_one(tmp_path, capsys):
    _chain(tmp_path, ["a.shrunk", "b.shrunk", "c.shrunk", "d.shrunk"])
    _tear(tmp_path / "d.shrunk")
    assert main(["shrink", "inspect", str(tmp_path)]) == 2
    said = capsys.readouterr()
    kinds = {cells[0]: cells[1] for cells in map(str.split, said.out.splitlines()) if cells}
    assert [kinds[name] for name in ("a.shrunk", "b.shrunk", "c.shrunk", "d.shrunk")] == [
        "keyframe",
        "delta",
        "delta",
        "torn!",
    ]
    assert "! d.shrunk cannot be restored: it is torn" in said.out
    assert "4 checkpoint(s) (1 cannot be restored, left out of the totals)" in said.out
    assert "d.shrunk" in said.err and "Traceback" not in said.err


def test_inspect_marks_the_deltas_on_a_torn_base(tmp_path, capsys):
    _chain(tmp_path, ["a.shrunk", "b.shrunk", "c.shrunk"])
    _tear(tmp_path / "b.shrunk")
    assert main(["shrink", "inspect", str(tmp_path)]) == 2
    said = capsys.readouterr().out
    kinds = {cells[0]: cells[1] for cells in map(str.split, said.splitlines()) if cells}
    assert (kinds["a.shrunk"], kinds["b.shrunk"], kinds["c.shrunk"]) == (
        "keyframe",
        "torn!",
        "delta!",
    )
    assert "! c.shrunk cannot be restored: its chain needs b.shrunk, which is torn" in said


def test_inspect_says_how_many_other_files_it_left_out(tmp_path, capsys):
    _chain(tmp_path, ["a.shrunk"])
    torch.save(_weights(1), tmp_path / "plain.ckpt")  # e.g. a plain ModelCheckpoint's file
    assert main(["shrink", "inspect", str(tmp_path)]) == 0
    assert "1 other file(s) in" in capsys.readouterr().out
    (tmp_path / "plain.ckpt").unlink()
    assert main(["shrink", "inspect", str(tmp_path)]) == 0
    assert "other file(s)" not in capsys.readouterr().out
