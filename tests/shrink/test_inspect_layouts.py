"""``stalwart shrink inspect`` on the folders the adapters really write: a delta whose base was
set aside (``save_last`` through the IO plugin) names the hidden copy it is read from, and
checkpoints in subfolders (a filename with a ``/``) are listed from the top folder."""

import glob
import shutil

import lightning as L
import torch
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.callbacks import ModelCheckpoint

import stalwart.shrink as shrink
from stalwart import ShrinkCheckpoint
from stalwart.cli import main
from stalwart.plugins import ShrinkCheckpointIO
from tests.helpers import QUIET

WITH_CHECKPOINTS = {**QUIET, "enable_checkpointing": True}
#: The header of a listing whose names all fit the 28-character columns, as it always was.
FLAT_HEADER = (
    f"{'file':28} {'kind':8} {'base':28} {'weights':>8} {'optim.':>7} {'total':>7} "
    f"{'degr.':>7} {'bound':>6} {'cont.':>7}  weights config | optimizer moments"
)


def _fit(callback, epochs, *, plugins=()):
    trainer = L.Trainer(
        max_epochs=epochs, callbacks=[callback], plugins=list(plugins), **WITH_CHECKPOINTS
    )
    trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=500))


def _listing(capsys, path, status=0):
    assert main(["shrink", "inspect", str(path)]) == status
    said = capsys.readouterr()
    rows = {}
    for cells in map(str.split, said.out.splitlines()):
        if cells[1:2] and cells[1].rstrip("!") in ("keyframe", "delta"):
            rows[cells[0]] = (cells[1], cells[2])  # file -> (kind, base)
    return said.out, rows


def test_a_delta_on_a_base_set_aside_names_the_hidden_copy_it_is_read_from(tmp_path, capsys):
    run = tmp_path / "run"
    io = ShrinkCheckpointIO(compress_optimizer="lossless")
    _fit(ModelCheckpoint(dirpath=run, save_last=True, save_top_k=-1), 3, plugins=[io])
    (kept,) = run.glob(".last.ckpt.superseded-*")
    _, epoch1, epoch2 = sorted(path.name for path in run.glob("epoch=*.ckpt"))
    shown, rows = _listing(capsys, run)
    # epoch 1's header records last.ckpt, which now holds a delta on epoch 2: its base is the
    # copy set aside when last.ckpt was written again (what shrink.load reads, by checksum).
    assert rows[epoch1] == ("delta", kept.name)
    assert rows["last.ckpt"] == ("delta", epoch2)
    assert kept.name not in rows  # a base, not a checkpoint of its own
    assert "copy the folder with its hidden files" in shown
    # Copied without hidden files, the chain through the copy set aside is broken, and says so.
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in glob.glob(f"{run}/*.ckpt"):
        shutil.copy(path, copy)
    shown, rows = _listing(capsys, copy, status=2)
    assert rows[epoch2][0] == "delta!"
    assert f"no copy of it is kept as {kept.name}" in shown
    # Copied with them, everything restores.
    whole = tmp_path / "whole"
    shutil.copytree(run, whole)
    _listing(capsys, whole)
    shrink.load(whole / epoch2)


def test_checkpoints_in_subfolders_are_listed_from_the_top_folder(tmp_path, capsys):
    _fit(ShrinkCheckpoint(dirpath=tmp_path, filename="{epoch}/model", keyframe_every=10), 2)
    shown, rows = _listing(capsys, tmp_path)
    assert sorted(rows) == ["epoch=0/model.ckpt", "epoch=1/model.ckpt"]
    assert "2 checkpoint(s)" in shown
    # A delta on a file in a sibling subfolder is named relative to the top folder (no "../").
    (tmp_path / "by_hand").mkdir()
    (tmp_path / "later").mkdir()
    first = shrink.save({"w": torch.randn(64, 64)}, tmp_path / "by_hand" / "a.shrunk")
    shrink.save({"w": torch.randn(64, 64)}, tmp_path / "later" / "b.shrunk", previous=first)
    shown, rows = _listing(capsys, tmp_path)
    assert rows["later/b.shrunk"] == ("delta", "by_hand/a.shrunk")
    assert "a base outside" not in shown and "4 checkpoint(s)" in shown


def test_a_flat_folder_is_listed_as_before(tmp_path, capsys):
    first = shrink.save({"w": torch.randn(64, 64)}, tmp_path / "a.shrunk")
    shrink.save({"w": torch.randn(64, 64)}, tmp_path / "b.shrunk", previous=first)
    shown, rows = _listing(capsys, tmp_path)
    assert shown.splitlines()[0] == FLAT_HEADER
    assert rows == {"a.shrunk": ("keyframe", "-"), "b.shrunk": ("delta", "a.shrunk")}


def test_a_link_to_a_delta_in_another_folder_is_listed_as_restorable(tmp_path, capsys):
    # The delta's base lies beside the file the link points to, where restore reads it: the
    # listing looked beside the link, said the base was missing and failed.
    weights = {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0))}
    (tmp_path / "run").mkdir()
    first = shrink.save(weights, tmp_path / "run" / "0.ckpt")
    shrink.save({"w": weights["w"] + 0.01}, tmp_path / "run" / "1.ckpt", previous=first)
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "model.ckpt").symlink_to("../run/1.ckpt")
    shrink.load(tmp_path / "best" / "model.ckpt")
    _, rows = _listing(capsys, tmp_path / "best")
    assert rows == {"model.ckpt": ("delta", "../run/0.ckpt")}
