"""ShrinkCheckpoint in real Lightning training: restores, chain bookkeeping, no side effects."""

import math
import subprocess
import sys

import lightning as L
import pytest
import torch
from digits_cnn import DigitsCNN, DigitsCNNDataModule

import stalwart.hindsight
import stalwart.shrink as shrink
from stalwart import HindsightCallback, ShrinkCheckpoint
from stalwart.errors import ConfigurationError
from stalwart.shrink.container import is_shrunk_file
from tests.helpers import QUIET

EPOCHS = 15
SEGMENT_ENDS = [4, 6, 8, 10, 12, 15]  # a fresh Trainer and model resume at each of these - 1


def _quiet(**kwargs):
    return {**QUIET, "enable_checkpointing": True, **kwargs}


def _held_out_accuracy(model: DigitsCNN, dm: DigitsCNNDataModule) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for loader in (dm.val_dataloader(), dm.test_dataloader()):
            for x, y in loader:
                correct += int((model(x).argmax(-1) == y).sum())
                total += y.numel()
    return correct / total


def _latest(directory):
    files = [p for p in directory.iterdir() if is_shrunk_file(p)]
    return max(files, key=lambda p: p.stat().st_mtime_ns)


@pytest.fixture(scope="module")
def uncompressed_accuracy():
    L.seed_everything(0)
    dm = DigitsCNNDataModule()
    model = DigitsCNN(max_epochs=EPOCHS)
    L.Trainer(max_epochs=EPOCHS, **QUIET).fit(model, dm)
    return _held_out_accuracy(model, dm)


def test_training_through_restores_keeps_the_metric_and_shrinks_20x(
    tmp_path, uncompressed_accuracy
):
    L.seed_everything(0)
    dm = DigitsCNNDataModule()
    reports = []
    restores = 0
    ckpt = None
    model = None
    for end in SEGMENT_ENDS:
        callback = ShrinkCheckpoint(dirpath=tmp_path, keyframe_every=10)
        model = DigitsCNN(max_epochs=EPOCHS)  # fresh weights: everything comes from the file
        L.Trainer(max_epochs=end, callbacks=[callback], **_quiet()).fit(model, dm, ckpt_path=ckpt)
        restores += ckpt is not None
        reports += callback.reports
        ckpt = _latest(tmp_path)
    assert len(reports) == EPOCHS >= 10 and restores >= 5
    assert all(r.degradation is None or r.degradation <= 0.05 for r in reports)
    cumulative = sum(r.weight_bytes for r in reports) / sum(r.weight_stored for r in reports)
    keyframe = reports[0]
    assert keyframe.kind == "keyframe" and keyframe.ratio >= 8, keyframe
    assert cumulative >= 20, [round(r.ratio, 1) for r in reports]
    assert sum(r.kind == "keyframe" for r in reports) == 2  # keyframe_every=10 across restores
    accuracy = _held_out_accuracy(model, dm)
    assert abs(accuracy - uncompressed_accuracy) / uncompressed_accuracy <= 0.01, (
        accuracy, uncompressed_accuracy,
    )  # fmt: skip


def test_with_tau_following_the_learning_rate_each_save_is_held_to_the_schedules_share(tmp_path):
    # DigitsCNN's cosine over 4 epochs: a save at the end of epoch e sees the rate the schedule
    # set for epoch e + 1, the one a run resumed from it trains at: 0.85, 0.5, 0.15 and 0 of the
    # initial rate. The bound is tau times that share, never below a fifth of tau.
    def bounds(**kwargs) -> list[float]:
        callback = ShrinkCheckpoint(dirpath=tmp_path / str(kwargs), **kwargs)
        L.Trainer(max_epochs=4, callbacks=[callback], **_quiet()).fit(
            DigitsCNN(max_epochs=4), DigitsCNNDataModule()
        )
        assert all(r.degradation is None or r.degradation <= r.bound for r in callback.reports)
        return [r.bound / 0.05 for r in callback.reports]

    shares = [(1 + math.cos(math.pi / 4)) / 2, 0.5, 0.2, 0.2]
    assert bounds() == pytest.approx(shares)  # the default follows the rate
    assert bounds(tau_follows_lr=False) == [pytest.approx(1.0)] * 4


def test_evaluation_leaves_no_trace_in_training(tmp_path):
    # Scoring candidates loads them into the live module and iterates the validation loader;
    # weights, modes and RNG are put back, so training is bit-identical with or without it.
    def fit(callbacks):
        L.seed_everything(1)
        model = DigitsCNN(max_epochs=3)
        kwargs = _quiet() if callbacks else QUIET
        L.Trainer(max_epochs=3, callbacks=callbacks, **kwargs).fit(model, DigitsCNNDataModule())
        return model.state_dict()

    plain = fit([])
    hindsight = HindsightCallback(dirpath=tmp_path / "runs")
    shrunk = fit([ShrinkCheckpoint(dirpath=tmp_path / "ckpt"), hindsight])
    assert all(torch.equal(plain[k], shrunk[k]) for k in plain)
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 3
    assert len(list((tmp_path / "runs").rglob("*.ckpt"))) >= 2  # hindsight recorded alongside
    # Scoring silences the module's logging; the record's own interception of it comes back
    # after each save (it was dropped at the first one: only epoch 0's values were recorded).
    logged = stalwart.hindsight.open(tmp_path / "runs").run().metrics("train_loss")
    assert sorted(set(logged.epoch.tolist())) == [0, 1, 2]


def test_background_saves_leave_training_untouched_and_are_all_written_when_fit_returns(tmp_path):
    # Each save is shrunk by a forked child while training goes on; the fit's teardown waits
    # for the last one, and a fit resumes from the chain they wrote.
    def fit(callbacks, epochs=3, ckpt=None, model=None):
        L.seed_everything(1)
        model = model or DigitsCNN(max_epochs=4)
        kwargs = _quiet() if callbacks else QUIET
        L.Trainer(max_epochs=epochs, callbacks=callbacks, **kwargs).fit(
            model, DigitsCNNDataModule(), ckpt_path=ckpt
        )
        return model

    plain = fit([]).state_dict()
    callback = ShrinkCheckpoint(dirpath=tmp_path, background=True)
    shrunk = fit([callback]).state_dict()
    assert all(torch.equal(plain[k], shrunk[k]) for k in plain)
    files = sorted(tmp_path.glob("*.ckpt"))
    assert len(files) == 3 and all(is_shrunk_file(p) for p in files)
    assert [r.kind for r in callback.reports] == ["keyframe", "delta", "delta"]
    assert not callback.io.writer.busy() and callback.io.chain.path == _latest(tmp_path)
    assert all(r.degradation <= r.bound for r in callback.reports)
    resumed = ShrinkCheckpoint(dirpath=tmp_path, background=True)
    fit([resumed], epochs=4, ckpt=_latest(tmp_path))
    assert [r.kind for r in resumed.reports] == ["delta"]  # extends the chain it resumed from
    assert len(list(tmp_path.glob("*.ckpt"))) == 4


def test_files_a_delta_needs_are_kept_until_nothing_needs_them(tmp_path):
    # save_top_k=1 asks ModelCheckpoint to delete every older file; deltas still need theirs.
    def fit(epochs, ckpt=None):
        callback = ShrinkCheckpoint(dirpath=tmp_path, keyframe_every=3, save_top_k=1)
        L.Trainer(max_epochs=epochs, callbacks=[callback], **_quiet()).fit(
            DigitsCNN(max_epochs=8), DigitsCNNDataModule(), ckpt_path=ckpt
        )
        return sorted(p.name.split("-")[0] for p in tmp_path.glob("*.ckpt"))

    names = fit(5)  # keyframes at epochs 0 and 3; epoch 4 is a delta on 3
    assert names == ["epoch=3", "epoch=4"]
    latest = next(tmp_path.glob("epoch=4-*.ckpt"))
    shrink.load(latest)
    names = fit(7, latest)
    # Epoch 5 (a delta on 4) was retired when 6 (a keyframe) came and nothing needs it: deleted.
    # A resumed ModelCheckpoint never asks to delete the last file of the fit before it (4), so
    # 4 stays, and 3 - retired by the first fit - stays too because 4 is a delta on it.
    assert names == ["epoch=3", "epoch=4", "epoch=6"]
    assert "epoch=3-" in (tmp_path / ".shrink-retired.json").read_text()


def test_lossy_optimizer_state_and_cli(tmp_path):
    callback = ShrinkCheckpoint(dirpath=tmp_path, compress_optimizer="lossy")
    L.Trainer(max_epochs=2, callbacks=[callback], **_quiet()).fit(
        DigitsCNN(), DigitsCNNDataModule()
    )
    lossless_total = callback.reports[0].weight_bytes  # sanity: a real model was saved
    assert lossless_total > 100_000 and callback.reports[-1].total_ratio > 4
    cli = [sys.executable, "-m", "stalwart.cli", "shrink"]
    shown = subprocess.run([*cli, "inspect", str(tmp_path)], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert (
        "keyframe" in shown.stdout and "delta" in shown.stdout and "smaller overall" in shown.stdout
    )
    out = tmp_path / "plain.ckpt"
    latest = _latest(tmp_path)
    made = subprocess.run([*cli, "restore", str(latest), str(out)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    plain = torch.load(out, weights_only=False)
    assert set(plain["state_dict"]) == set(shrink.load(latest))
    # A plain Lightning Trainer resumes from the restored file.
    L.Trainer(max_epochs=3, **QUIET).fit(DigitsCNN(), DigitsCNNDataModule(), ckpt_path=out)
    again = subprocess.run([*cli, "restore", str(latest), str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and "--force" in again.stderr


def test_bad_callback_arguments(tmp_path):
    for kwargs in ({"tau": -1}, {"eval_batches": 0}, {"keyframe_every": 0},
                   {"compress_optimizer": "fp8"}, {"grad_beta": 0}, {"continue_steps": 0},
                   {"screen_fraction": 1.0}, {"screen_accept": 1.5}):  # fmt: skip
        with pytest.raises(ConfigurationError):
            ShrinkCheckpoint(dirpath=tmp_path, **kwargs)


def test_a_resumed_search_is_never_more_aggressive_than_the_checkpoint_it_resumes(tmp_path):
    # The held-out loss is amplified at the second save only (exp(s * loss): relative degradation
    # ~ s * the loss difference), forcing a less aggressive configuration there. The lenient saves
    # after it, in a fresh Trainer resumed from that second file, must not go back to the first,
    # more aggressive choice: the neighbourhood search never increases aggressiveness.
    strictness = {0: 1.0, 1: 40.0, 2: 1.0}
    dm = DigitsCNNDataModule()
    dm.setup()
    x, y = next(iter(dm.val_dataloader()))

    def amplified_loss(module: DigitsCNN) -> float:
        loss = float(torch.nn.functional.cross_entropy(module(x), y))
        return float(torch.exp(torch.tensor(strictness[module.trainer.current_epoch] * loss)))

    def fit(epochs, ckpt=None):
        L.seed_everything(0)
        callback = ShrinkCheckpoint(dirpath=tmp_path, evaluate=amplified_loss, filename="{epoch}")
        L.Trainer(max_epochs=epochs, callbacks=[callback], **_quiet()).fit(
            DigitsCNN(max_epochs=3), dm, ckpt_path=ckpt
        )
        return [report.config for report in callback.reports]

    first, second = fit(2)
    assert None not in (first, second) and second != first
    assert second.at_most_as_aggressive_as(first)  # the strict save backed off
    (resumed,) = fit(3, tmp_path / "epoch=1.ckpt")
    assert resumed is not None, (first, second)
    assert resumed.at_most_as_aggressive_as(second), (first, second, resumed)
