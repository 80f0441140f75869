"""Composer Shrink: shrunken delta checkpoints through Composer's saver, resumed via load_path;
a Trainer without Shrink in the same process keeps writing Composer's own checkpoints."""

from __future__ import annotations

import gc
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from composer.loggers import InMemoryLogger
from composer.utils import checkpoint as composer_checkpoint
from composer_digits import digits_loaders, make_trainer

import stalwart.shrink
from stalwart.algorithms import Shrink, composer_internals
from stalwart.shrink.container import is_shrunk_file, read_header

TAU = 0.05
#: What ``stalwart/algorithms/shrink.md`` ("Measured") promises for this workload: the whole
#: checkpoint folder (weights, optimizer, schedulers, timestamp, RNG) against Composer's own
#: files of the same run, and the weights alone against their raw tensor bytes.
WHOLE_FOLDER_RATIO = 2.5
WEIGHTS_RATIO = 4.0
REPLACED = ("_write_checkpoint_file", "safe_torch_load")


def held_out_loss_and_accuracy(model: torch.nn.Module) -> tuple[float, float]:
    """The model's loss and accuracy on the whole held-out split (the search's scoring data)."""
    batch = next(iter(digits_loaders()[1]))
    model.eval()
    with torch.no_grad():
        outputs = model(batch)
        loss = float(model.loss(outputs, batch))
    return loss, float((outputs.argmax(-1) == batch[1]).float().mean())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 epochs twice in one process, with Shrink and without, both Trainers open."""
    gc.collect()  # Trainers of earlier tests that were never closed close when collected
    assert composer_internals._holders == []
    originals = {name: getattr(composer_checkpoint, name) for name in REPLACED}
    shrunk_folder = tmp_path_factory.mktemp("composer-shrink")
    plain_folder = tmp_path_factory.mktemp("composer-plain")
    shrink = Shrink(tau=TAU)
    memory = InMemoryLogger()
    shrunk = make_trainer(
        epochs=4, algorithms=[shrink], save_folder=str(shrunk_folder), save_interval="1ep",
        loggers=[memory],
    )  # fmt: skip
    plain = make_trainer(epochs=4, save_folder=str(plain_folder), save_interval="1ep")
    routed_while_open = [getattr(composer_checkpoint, n) is not originals[n] for n in REPLACED]
    shrunk.fit()
    plain.fit()
    live = held_out_loss_and_accuracy(shrunk.state.model)
    plain_weights = {k: v.clone() for k, v in plain.state.model.state_dict().items()}
    shrunk.close()
    plain.close()
    return SimpleNamespace(
        folder=shrunk_folder, plain_folder=plain_folder, shrink=shrink, live=live,
        accuracy=[float(v) for _, v in memory.data["metrics/eval/MulticlassAccuracy"]],
        plain_weights=plain_weights, originals=originals, routed_while_open=routed_while_open,
    )  # fmt: skip


def test_checkpoints_are_shrunken_deltas_within_the_quality_bound(runs):
    files = [runs.folder / f"ep{e}-ba{11 * e}-rank0.pt" for e in range(1, 5)]
    assert all(is_shrunk_file(f) for f in files)
    assert [read_header(f)["kind"] for f in files] == ["keyframe", "delta", "delta", "delta"]
    assert all(r.degradation is not None and r.degradation <= TAU for r in runs.shrink.reports)
    assert all(r.ratio >= WEIGHTS_RATIO for r in runs.shrink.reports)


def test_the_whole_folder_is_smaller_by_the_documented_ratio(runs):
    def folder_bytes(folder) -> int:
        return sum(p.stat().st_size for p in folder.glob("ep*-rank0.pt"))

    assert len(list(runs.plain_folder.glob("ep*-rank0.pt"))) == 4
    ratio = folder_bytes(runs.plain_folder) / folder_bytes(runs.folder)
    assert ratio >= WHOLE_FOLDER_RATIO, f"{ratio:.2f}x"


def test_the_restored_model_is_within_the_quality_bound(runs, tmp_path):
    restored = make_trainer(
        epochs=4, algorithms=[Shrink()], save_folder=str(tmp_path),
        load_path=str(runs.folder / "ep4-ba44-rank0.pt"),
    )  # fmt: skip
    loss, accuracy = held_out_loss_and_accuracy(restored.state.model)
    restored.close()
    live_loss, live_accuracy = runs.live
    assert loss <= (1 + TAU) * live_loss
    assert accuracy >= live_accuracy - 0.02  # a few of the 360 held-out digits at most


def test_a_trainer_without_shrink_beside_one_writes_composer_checkpoints(runs):
    assert runs.routed_while_open == [True, True]
    last = runs.plain_folder / "ep4-ba44-rank0.pt"
    assert not is_shrunk_file(last)
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    assert sorted(checkpoint) == ["rng", "state"]  # Composer's own layout, nothing of stalwart's
    model = checkpoint["state"]["model"]
    assert model.keys() == runs.plain_weights.keys()
    assert all(torch.equal(model[k], v) for k, v in runs.plain_weights.items())  # lossless


def test_closing_the_trainer_gives_composer_its_functions_back(runs, tmp_path):
    assert all(getattr(composer_checkpoint, n) is runs.originals[n] for n in REPLACED)
    assert composer_internals._holders == []
    # A later Trainer without Shrink, loading a plain checkpoint and saving, is Composer alone.
    later = make_trainer(
        epochs=5, save_folder=str(tmp_path), save_interval="1ep",
        load_path=str(runs.plain_folder / "ep4-ba44-rank0.pt"),
    )  # fmt: skip
    assert all(getattr(composer_checkpoint, n) is runs.originals[n] for n in REPLACED)
    later.fit()
    later.close()
    saved = tmp_path / "ep5-ba55-rank0.pt"
    assert not is_shrunk_file(saved)
    assert sorted(torch.load(saved, weights_only=False)) == ["rng", "state"]


def test_importing_the_algorithms_changes_nothing_in_composer():
    script = (
        "from composer.utils import checkpoint as c\n"
        "before = {n: getattr(c, n) for n in dir(c)}\n"
        "import stalwart.algorithms\n"
        "from stalwart.algorithms import Hindsight, Shrink, replay\n"
        "Shrink(); Hindsight\n"
        "after = {n: getattr(c, n) for n in dir(c)}\n"
        "assert before == after, sorted(n for n in after if before.get(n) is not after[n])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_restored_from_a_shrunken_checkpoint_training_continues(runs):
    folder = runs.folder
    delta = folder / "ep2-ba22-rank0.pt"
    memory = InMemoryLogger()
    resumed = Shrink(tau=TAU)
    trainer = make_trainer(
        epochs=6, algorithms=[resumed], save_folder=str(folder), save_interval="1ep",
        load_path=str(delta), save_overwrite=True, loggers=[memory],
    )  # fmt: skip
    assert int(trainer.state.timestamp.epoch) == 2
    decoded = stalwart.shrink.load(delta)
    restored = trainer.state.model.state_dict()
    assert all(torch.equal(restored[name], decoded[name]) for name in decoded)
    trainer.fit()
    trainer.close()
    after = [float(v) for _, v in memory.data["metrics/eval/MulticlassAccuracy"]]
    assert len(after) == 4 and after[-1] > runs.accuracy[1] and after[-1] > 0.85  # kept learning
    # The resumed run extends the chain it was restored from.
    assert resumed.reports[0].base is not None
    assert read_header(folder / "ep6-ba66-rank0.pt")["kind"] == "delta"


def test_latest_symlink_and_rotation_never_break_a_chain(tmp_path):
    shrink = Shrink(tau=TAU, keyframe_every=2)
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


def test_each_save_is_held_to_tau_times_the_schedules_share_by_default(runs):
    # The digits run's StepLR halves the rate every 2 epochs; a save at an epoch's end sees the
    # rate the next epoch trains at (the one a run resumed from it continues with).
    assert runs.shrink.tau_follows_lr
    assert all(r.degradation <= r.bound for r in runs.shrink.reports)
    assert [r.bound / TAU for r in runs.shrink.reports] == pytest.approx([1.0, 0.5, 0.5, 0.25])
