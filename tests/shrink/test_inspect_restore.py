"""``stalwart shrink inspect|restore`` on a real Composer Shrink folder: a restored file resumes a
plain Composer Trainer with the trained weights, Composer's ``latest`` link is counted once, and a
missing output folder is one clear error line."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import stalwart.shrink
import stalwart.shrink.inspect
from stalwart.cli import main
from stalwart.shrink.inspect import describe

pytest.importorskip("composer")
from composer_digits import digits_model, make_trainer  # noqa: E402

from stalwart.algorithms import Shrink  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two epochs of the digits run with Shrink (a file per epoch), and its initial weights."""
    folder = tmp_path_factory.mktemp("composer-shrink")
    trainer = make_trainer(
        epochs=2, algorithms=[Shrink(tau=0.05)], save_folder=str(folder), save_interval="1ep"
    )
    trainer.fit()
    trainer.close()
    torch.manual_seed(0)  # as make_trainer seeds it: the weights every run starts from
    return SimpleNamespace(folder=folder, last=folder / "ep2-ba22-rank0.pt", init=digits_model())


def test_a_restored_composer_checkpoint_resumes_a_plain_trainer_with_the_trained_weights(
    run, tmp_path, capsys
):
    out = tmp_path / "plain.pt"
    assert main(["shrink", "restore", str(run.last), str(out)]) == 0
    said = capsys.readouterr().out
    trainer = make_trainer(epochs=3, load_path=str(out))  # no Shrink: Composer's loader alone
    assert int(trainer.state.timestamp.epoch) == 2
    decoded = stalwart.shrink.load(run.last)
    loaded = trainer.state.model.state_dict()
    assert loaded.keys() == decoded.keys()
    assert all(torch.equal(loaded[name], decoded[name]) for name in decoded)
    initial = run.init.state_dict()
    assert not torch.equal(loaded["module.0.weight"], initial["module.0.weight"])
    assert "a plain Composer checkpoint" in said
    trainer.fit()  # and it trains on from there
    assert int(trainer.state.timestamp.epoch) == 3
    trainer.close()


def test_inspect_lists_composers_latest_link_once_and_counts_each_file_once(run, capsys):
    link = run.folder / "latest-rank0.pt"
    assert link.is_symlink() and link.resolve() == run.last.resolve()
    assert main(["shrink", "inspect", str(run.folder)]) == 0
    shown = capsys.readouterr().out
    table = [line.split() for line in shown.splitlines()]
    rows = [cells[0] for cells in table if cells[1:2] in (["keyframe"], ["delta"])]
    assert rows == ["ep1-ba11-rank0.pt", "ep2-ba22-rank0.pt"]
    assert "latest-rank0.pt -> ep2-ba22-rank0.pt" in shown
    assert "2 checkpoint(s)" in shown
    files = [describe(run.folder / "ep1-ba11-rank0.pt"), describe(run.last)]
    ratio = sum(f["weight_bytes"] for f in files) / sum(f["weight_stored"] for f in files)
    overall = re.search(r"weights ([\d.]+)x smaller overall", shown)
    assert overall and overall.group(1) == f"{ratio:.1f}"


def test_restore_into_a_missing_folder_is_one_error_line_before_any_decoding(
    run, tmp_path, capsys, monkeypatch
):
    def never(*args, **kwargs):
        raise AssertionError("decoded the chain before checking where the output goes")

    monkeypatch.setattr(stalwart.shrink.inspect, "load_with_extra", never)
    out = tmp_path / "nodir" / "out.pt"
    assert main(["shrink", "restore", str(run.last), str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("stalwart: error:") and "Traceback" not in error
    assert str(tmp_path / "nodir") in error and "mkdir -p" in error
    assert not out.parent.exists()
    # An existing folder as OUT (even with --force) is refused the same way.
    assert main(["shrink", "restore", str(run.last), str(tmp_path), "--force"]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_restore_refuses_to_overwrite_a_shrunken_file_or_to_convert_a_plain_one(
    run, tmp_path, capsys
):
    first = run.folder / "ep1-ba11-rank0.pt"  # the base of the last file
    before = first.read_bytes()
    assert main(["shrink", "restore", str(run.last), str(first), "--force"]) == 2
    assert "is a shrunken checkpoint" in capsys.readouterr().err
    assert first.read_bytes() == before  # the delta on it still restores
    plain = tmp_path / "plain.pt"
    torch.save({"state_dict": {}}, plain)
    assert main(["shrink", "restore", str(plain), str(tmp_path / "again.pt")]) == 2
    assert "is not a shrunken checkpoint" in capsys.readouterr().err
