"""Composer ``algorithms=[Hindsight(), Shrink()]``: the record replays, and a replay (whose
Trainers save nothing) neither trips Shrink's "this Trainer saves none" check nor writes or
takes up a checkpoint, while still reading a shrunken file its Trainer loads."""

from __future__ import annotations

import gc

import pytest
from composer.loggers import InMemoryLogger
from composer_digits import WeightNormProbe, make_trainer

from stalwart.algorithms import Hindsight, Shrink, composer_internals, replay
from stalwart.hindsight.estimate import ReplayEstimate
from stalwart.shrink.container import is_shrunk_file

EPOCHS = 3
BATCHES = 11  # 1437 digits in batches of 128, the last short one dropped


class EveryEpoch(Hindsight):
    """Checkpoint every epoch, whatever the policy says: the test needs a fixed plan."""

    def should_checkpoint(self, state, policy_says: bool) -> bool:
        return True


def checkpoint_files(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


@pytest.fixture(scope="module")
def ground_truth():
    """The run with the probe attached from the start (no Hindsight, no Shrink)."""
    memory = InMemoryLogger()
    make_trainer(epochs=EPOCHS, callbacks=[WeightNormProbe()], loggers=[memory]).fit()
    return [float(v) for _, v in memory.data["probe/weight_norm"]]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One Hindsight and one Shrink for the record and every replay, as in docs/composer.md."""
    gc.collect()  # Trainers of earlier tests that were never closed close when collected
    root = tmp_path_factory.mktemp("record")
    saved = tmp_path_factory.mktemp("shrunk")
    hindsight, shrink = EveryEpoch(root), Shrink(tau=0.05)

    def factory(**overrides):
        args = {
            "algorithms": [hindsight, shrink],
            "save_folder": str(saved),
            "save_interval": "1ep",
        }
        return make_trainer(epochs=EPOCHS, **{**args, **overrides})

    trainer = factory()
    trainer.fit()
    trainer.close()
    assert is_shrunk_file(saved / "ep1-ba11-rank0.pt")
    return factory, saved, shrink


def test_a_dry_run_plans_and_writes_nothing(recorded):
    factory, saved, _ = recorded
    before = checkpoint_files(saved)
    estimate = replay(factory, probe=WeightNormProbe(), epochs=[1], dry_run=True)
    assert isinstance(estimate, ReplayEstimate)
    assert checkpoint_files(saved) == before
    assert composer_internals._holders == []  # the reference Trainer gave the routing back


def test_a_replay_equals_the_run_with_the_probe_and_writes_no_checkpoint(recorded, ground_truth):
    factory, saved, _ = recorded
    before = checkpoint_files(saved)
    result = replay(factory, probe=WeightNormProbe(), epochs=[1, 2])
    assert result.mismatches == []
    replayed = result.metrics("probe/weight_norm").value.tolist()
    assert replayed == ground_truth[BATCHES : 3 * BATCHES]  # bit for bit
    assert checkpoint_files(saved) == before
    assert composer_internals._holders == []


def test_a_factory_resuming_from_a_shrunken_file_replays(recorded, ground_truth, tmp_path):
    """The replay builds the factory's Trainer, ``load_path`` and all, to learn the model: that
    Trainer reads the shrunken file, and this Shrink's chain is not taken over by it."""
    factory, saved, shrink = recorded
    # A second fit of the same run, resumed from its shrunken epoch-1 file, recorded apart.
    hindsight = EveryEpoch(tmp_path / "resumed")

    def resumed(**overrides):
        args = {
            "load_path": str(saved / "ep1-ba11-rank0.pt"), "algorithms": [hindsight, shrink],
            "save_folder": str(tmp_path / "checkpoints"),
        }  # fmt: skip
        return factory(**{**args, **overrides})

    trainer = resumed()
    trainer.fit()
    trainer.close()
    tip = shrink.writer.chain.path
    result = replay(resumed, probe=WeightNormProbe(), epochs=[2])
    assert result.mismatches == []
    replayed = result.metrics("probe/weight_norm").value.tolist()
    # Within the bound, not bit for bit: the resume restored quantized weights.
    assert len(replayed) == BATCHES
    assert replayed == pytest.approx(ground_truth[2 * BATCHES :], rel=0.05)
    assert shrink.writer.chain.path == tip
