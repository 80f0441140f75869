"""Files written again at the same path (``save_last``): every file of the folder stays
restorable, and retired files are deleted only when nothing can still need them."""

import json
import logging

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

import stalwart.shrink as shrink
from stalwart import ShrinkCheckpoint
from stalwart.cli import main
from stalwart.plugins import ShrinkCheckpointIO, ShrinkRequest
from stalwart.shrink.chain import RETIRED_FILE, ChainWriter
from stalwart.shrink.container import is_shrunk_file, read_header
from stalwart.shrink.partition import QuantConfig
from tests.helpers import QUIET

WITH_CHECKPOINTS = {**QUIET, "enable_checkpointing": True}


def _fit(callback, epochs, *, plugins=(), ckpt_path=None):
    trainer = L.Trainer(
        max_epochs=epochs, callbacks=[callback], plugins=list(plugins), **WITH_CHECKPOINTS
    )
    trainer.fit(DigitsClassifier(width=8), DigitsDataModule(batch_size=500), ckpt_path=ckpt_path)


def _bases(directory):
    """file name -> the name of the file it is a delta on (None: a keyframe)."""
    bases = {}
    for path in directory.iterdir():
        if is_shrunk_file(path) and not path.name.startswith("."):
            base = read_header(path)["base"]
            bases[path.name] = None if base is None else base["file"]
    return bases


def _assert_every_file_restorable(directory):
    names = sorted(_bases(directory))
    assert names, f"no checkpoints in {directory}"
    for name in names:
        shrink.load(directory / name)  # raises CorruptCheckpointError naming a broken chain


@pytest.mark.parametrize(
    "options",
    [
        {"save_last": True},
        {"save_last": True, "background": True},
        # Top-k saves come only when train_loss improves; last.ckpt at every save.
        {"save_last": True, "save_top_k": 1, "monitor": "train_loss", "every_n_train_steps": 2},
    ],
    ids=["every-epoch", "background", "top-1-by-steps"],
)
def test_save_last_leaves_every_file_restorable_and_nothing_extends_last(tmp_path, options):
    callback = ShrinkCheckpoint(dirpath=tmp_path, keyframe_every=3, **options)
    _fit(callback, epochs=4)
    bases = _bases(tmp_path)
    assert "last.ckpt" in bases and len(bases) >= 3
    assert "last.ckpt" not in bases.values()  # last.ckpt is rewritten: no delta may be on it
    assert all(report.side == (report.path.endswith("last.ckpt")) for report in callback.reports)
    _assert_every_file_restorable(tmp_path)
    assert not list(tmp_path.glob(".*superseded*"))  # side saves: nothing had to be set aside


def test_a_run_resumed_from_last_ckpt_extends_the_file_last_ckpt_is_a_delta_on(tmp_path):
    _fit(ShrinkCheckpoint(dirpath=tmp_path, save_last=True), epochs=2)
    last_base = read_header(tmp_path / "last.ckpt")["base"]["file"]
    assert last_base.startswith("epoch=1-")
    resumed = ShrinkCheckpoint(dirpath=tmp_path, save_last=True)
    _fit(resumed, epochs=4, ckpt_path=str(tmp_path / "last.ckpt"))
    first_resumed = resumed.reports[0]
    assert first_resumed.path.endswith(".ckpt") and "epoch=2-" in first_resumed.path
    assert first_resumed.kind == "delta" and first_resumed.base.endswith(last_base)
    assert "last.ckpt" not in _bases(tmp_path).values()
    _assert_every_file_restorable(tmp_path)


def test_save_last_link_still_links_to_the_newest_file(tmp_path):
    callback = ShrinkCheckpoint(dirpath=tmp_path, save_last="link")
    _fit(callback, epochs=3)
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and last.resolve().name.startswith("epoch=2-")
    assert [r.path.split("/")[-1][:8] for r in callback.reports] == [
        "epoch=0-",
        "epoch=1-",
        "epoch=2-",
    ]  # last.ckpt is linked, never written
    _assert_every_file_restorable(tmp_path)


def test_a_run_resumed_through_the_last_link_extends_the_file_it_points_to(tmp_path, capsys):
    # last.ckpt is a link that each save moves on: a delta on the link itself broke at the
    # next save, and with it every checkpoint written after the resume.
    _fit(ShrinkCheckpoint(dirpath=tmp_path, save_last="link"), epochs=2)
    resumed = ShrinkCheckpoint(dirpath=tmp_path, save_last="link")
    _fit(resumed, epochs=4, ckpt_path="last")
    assert [report.kind for report in resumed.reports] == ["delta", "delta"]
    assert "epoch=1-" in resumed.reports[0].base
    assert "last.ckpt" not in _bases(tmp_path).values()
    assert (tmp_path / "last.ckpt").resolve().name.startswith("epoch=3-")
    _assert_every_file_restorable(tmp_path)
    assert main(["shrink", "inspect", str(tmp_path)]) == 0
    capsys.readouterr()


def test_model_checkpoint_save_last_through_the_io_plugin_sets_one_base_aside(tmp_path):
    # The plugin alone cannot tell last.ckpt from another file: the first last.ckpt becomes the
    # base of the next epoch file. When last.ckpt is written again, what it held is set aside
    # (the epoch file needs it); from then on the writer knows the path and writes it as a
    # side save, so that happens once.
    io = ShrinkCheckpointIO(compress_optimizer="lossless")
    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1)
    _fit(callback, epochs=4, plugins=[io])
    _assert_every_file_restorable(tmp_path)
    kept = list(tmp_path.glob(".last.ckpt.superseded-*"))
    assert len(kept) == 1
    assert kept[0].name in json.loads((tmp_path / RETIRED_FILE).read_text())
    epoch_files = sorted(tmp_path.glob("epoch=*.ckpt"))
    assert _bases(tmp_path)[epoch_files[1].name] == "last.ckpt"
    # The copy is deleted once nothing needs it: not while epoch 3 (a delta on 2, on 1, on the
    # copy) or last.ckpt (a delta on 3) is live. A later run's writer, which extends nothing yet.
    later = ShrinkCheckpointIO()
    for path in epoch_files[1:]:
        later.remove_checkpoint(path)
    assert len(list(tmp_path.glob(".last.ckpt.superseded-*"))) == 1
    later.remove_checkpoint(tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.glob("*.ckpt*")) == [epoch_files[0].name]
    assert not list(tmp_path.glob(".last.ckpt.superseded-*"))
    shrink.load(epoch_files[0])


def _weights(seed):
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 64, generator=generator),
        "b": torch.randn(64, generator=generator),
    }


def test_a_file_whose_base_was_replaced_keeps_retired_keyframes(tmp_path, caplog):
    # The folder the unfixed save_last left: a keyframe, "last" a delta on it, an epoch file a
    # delta on "last", then "last" replaced by a file that knows nothing of the chain. Bases
    # followed by name alone loop (epoch -> last -> epoch) and never reach the keyframe, so it
    # was deleted when retired: the one file that could still be restored.
    config = QuantConfig(bins=16)
    writer = ChainWriter(config=config, compress_optimizer="lossless")
    writer.save(_weights(0), None, tmp_path / "keyframe.shrunk")
    writer.save(_weights(1), None, tmp_path / "last.shrunk")
    writer.save(_weights(2), None, tmp_path / "epoch.shrunk")
    shrink.save(_weights(3), tmp_path / "last.shrunk", previous=writer.chain, config=config)
    with caplog.at_level(logging.WARNING, logger="stalwart.shrink.chain"):
        writer.remove(tmp_path / "keyframe.shrunk")
    assert (tmp_path / "keyframe.shrunk").exists()
    shrink.load(tmp_path / "keyframe.shrunk")
    assert "epoch.shrunk" in caplog.text and "no retired checkpoint is deleted" in caplog.text
    # Removing the broken file lets the collection go on.
    (tmp_path / "epoch.shrunk").unlink()
    (tmp_path / "last.shrunk").unlink()
    writer.chain = None
    writer.collect_retired(tmp_path)
    assert not (tmp_path / "keyframe.shrunk").exists()


def _plain_save_over(path, seed):
    torch.save({"state_dict": _weights(seed)}, path)  # trainer.save_checkpoint beside the IO


@pytest.mark.parametrize("replacement", ["plain", "other-chain"])
def test_a_chain_whose_last_file_was_replaced_starts_a_keyframe(tmp_path, caplog, replacement):
    # A hand save onto the newest checkpoint's path (a plain file beside ShrinkCheckpoint): the
    # next save was a delta on content no longer on disk, and it and every later file could not
    # be restored.
    config = QuantConfig(bins=16)
    writer = ChainWriter(config=config, compress_optimizer="lossless")
    writer.save(_weights(0), None, tmp_path / "0.shrunk")
    writer.save(_weights(1), None, tmp_path / "1.shrunk")
    if replacement == "plain":
        _plain_save_over(tmp_path / "1.shrunk", 9)
    else:  # a shrunken file of another writer's: same name, another CRC-32
        shrink.save(_weights(9), tmp_path / "1.shrunk", config=config)
    with caplog.at_level(logging.WARNING, logger="stalwart.shrink.chain"):
        report = writer.save(_weights(2), None, tmp_path / "2.shrunk")
    assert report.kind == "keyframe"
    assert "1.shrunk was replaced" in caplog.text
    shrink.load(tmp_path / "2.shrunk")
    assert writer.save(_weights(3), None, tmp_path / "3.shrunk").kind == "delta"
    shrink.load(tmp_path / "3.shrunk")


def test_a_plain_save_over_a_live_base_keeps_it_aside_and_no_other(tmp_path):
    # ShrinkCheckpoint hands saves without its request (trainer.save_checkpoint by hand) to the
    # plain IO: one onto a file a delta was written against lost that delta's base.
    io = ShrinkCheckpointIO(config=QuantConfig(bins=16), delegate=TorchCheckpointIO())
    request = ShrinkRequest()
    for step in range(3):
        io.save_checkpoint({"state_dict": _weights(step)}, tmp_path / f"{step}.ckpt", request)
    io.save_checkpoint({"state_dict": _weights(7)}, tmp_path / "other.ckpt")  # no base there
    assert not list(tmp_path.glob(".*superseded*"))
    io.save_checkpoint({"state_dict": _weights(8)}, tmp_path / "1.ckpt")  # 2.ckpt is on it
    assert [p.name[:18] for p in tmp_path.glob(".*superseded*")] == [".1.ckpt.superseded"]
    assert not is_shrunk_file(tmp_path / "1.ckpt")
    shrink.load(tmp_path / "2.ckpt")
    assert main(["shrink", "inspect", str(tmp_path)]) == 0
    io.save_checkpoint({"state_dict": _weights(9)}, tmp_path / "2.ckpt")  # the tip: none needs it
    assert not list(tmp_path.glob(".2.ckpt.superseded*"))
    io.save_checkpoint({"state_dict": _weights(3)}, tmp_path / "3.ckpt", request)
    assert io.reports[-1].kind == "keyframe"  # 2.ckpt, the chain's last file, was replaced
    shrink.load(tmp_path / "3.ckpt")
