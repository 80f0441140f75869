"""Replay: probes added after the fact give the values a probed run would have logged."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart import FunctionProbe, HindsightCallback
from tests.helpers import QUIET

EPOCHS = 6
BATCHES = 5  # 640 training samples / 128


class EveryEpoch(HindsightCallback):
    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return True


class EpochProbe(L.Callback):
    """Outer-loop: weight norm, learning rate and validation accuracy at epoch end."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("w_norm", pl_module.net[0].weight.norm())
        pl_module.log("lr_seen", trainer.optimizers[0].param_groups[0]["lr"])

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("val_bias_norm", pl_module.net[-1].bias.norm())


class GradProbe(L.Callback):
    """Inner-loop: the gradient norm before every optimizer step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        norms = [p.grad.norm() for p in pl_module.parameters() if p.grad is not None]
        pl_module.log("grad_norm", torch.stack(norms).norm())


class NoisyEpochEnd(DigitsClassifier):
    def on_train_epoch_end(self) -> None:
        self.log("epoch_noise", torch.rand(()))


def trainer_for(dirpath, probes=()) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=EPOCHS,
        callbacks=[EveryEpoch(dirpath=dirpath), *probes],
        deterministic=True,
        **QUIET,
    )


def fresh():
    L.seed_everything(3)
    return NoisyEpochEnd(width=48), DigitsDataModule(batch_size=128, train_size=640)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    trainer_for(root).fit(*fresh())
    return root


@pytest.fixture(scope="module")
def truth(tmp_path_factory):
    """The ground truth: the same training with the probes there from the start."""
    root = tmp_path_factory.mktemp("truth")
    trainer_for(root, [EpochProbe(), GradProbe()]).fit(*fresh())
    return stalwart.hindsight.open(root).run()


def values(frame, epochs=None):
    if epochs is not None:
        frame = frame[frame.epoch.isin(epochs)]
    return frame[["epoch", "step", "value"]].reset_index(drop=True)


def test_outer_loop_probe_replays_bit_exact_without_training_batches(record, truth):
    result = trainer_for(record).replay(*fresh(), probe=EpochProbe())
    assert result.level == "outer"
    assert result.batches_executed == 0
    for name in ("w_norm", "lr_seen", "val_bias_norm"):
        assert values(result.metrics(name)).equals(values(truth.metrics(name))), name
    assert result.mismatches == []  # val_loss, val_acc, epoch_noise reproduced too


def test_inner_loop_probe_replays_bit_exact_and_runs_only_its_epochs(record, truth):
    result = trainer_for(record).replay(*fresh(), probe=GradProbe(), epochs=range(2, 5))
    assert result.level == "inner"
    assert result.batch_epochs == [e for e in (2, 3, 4) for _ in range(BATCHES)]
    expected = values(truth.metrics("grad_norm"), [2, 3, 4])
    assert values(result.metrics("grad_norm")).equals(expected)
    assert result.mismatches == []


def test_parallel_replay_equals_serial(record, truth):
    serial = trainer_for(record).replay(*fresh(), probe=GradProbe())
    parallel = trainer_for(record).replay(*fresh(), probe=GradProbe(), workers=2)
    assert len(parallel.segments) == 2
    assert sorted(parallel.batch_epochs) == sorted(serial.batch_epochs)
    assert values(parallel.metrics("grad_norm")).equals(values(serial.metrics("grad_norm")))
    assert values(serial.metrics("grad_norm")).equals(values(truth.metrics("grad_norm")))


def test_while_cuda_is_in_use_here_the_segments_run_in_turn_in_this_process(
    record, truth, monkeypatch, caplog
):
    # A forked worker cannot use this process's CUDA context (tests/gpu runs this on a GPU).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    result = trainer_for(record).replay(*fresh(), probe=GradProbe(), workers=2)
    assert len(result.segments) == 2 and "one after another here" in caplog.text
    assert values(result.metrics("grad_norm")).equals(values(truth.metrics("grad_norm")))
    assert result.mismatches == []


def test_function_probe_and_replay_rows_are_in_the_store(record):
    def lr(trainer, pl_module):
        pl_module.log("lr_fn", trainer.optimizers[0].param_groups[0]["lr"])

    result = trainer_for(record).replay(
        *fresh(), probe=FunctionProbe("on_train_epoch_end", lr), epochs=[1, 4]
    )
    assert result.batches_executed == 0
    stored = stalwart.hindsight.open(record).run().metrics("lr_fn")
    mine = stored[stored.replay_id == result.replay_id]
    assert mine.epoch.tolist() == [1, 4] and set(mine.source) == {"replay"}


class EditedTrainingStep(NoisyEpochEnd):
    """The recorded model with a log statement added to training_step after the fact."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_x2", loss * 2)
        return loss


class EditedEpochEnd(NoisyEpochEnd):
    def on_validation_epoch_end(self) -> None:
        self.log("bias_mean", self.net[-1].bias.mean())


def test_edits_to_the_module_are_probes_of_their_level(record, truth):
    L.seed_everything(3)
    data = DigitsDataModule(batch_size=128, train_size=640)
    inner = trainer_for(record).replay(EditedTrainingStep(width=48), data, epochs=[3])
    assert inner.level == "inner" and set(inner.batch_epochs) == {3}
    doubled = inner.metrics("loss_x2").value.to_numpy()
    recorded = truth.metrics("train_loss")
    recorded = recorded[recorded.epoch == 3].value.to_numpy()
    assert (doubled == (torch.tensor(recorded, dtype=torch.float32) * 2).numpy()).all()
    L.seed_everything(3)
    outer = trainer_for(record).replay(EditedEpochEnd(width=48), data)
    assert outer.level == "outer" and outer.batches_executed == 0
    assert outer.metrics("bias_mean").epoch.tolist() == list(range(EPOCHS))


class EveryThirdEpoch(HindsightCallback):
    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return trainer.current_epoch % 3 == 2


def test_missing_checkpoints_are_re_executed_and_values_stay_exact(tmp_path, truth):
    trainer = stalwart.Trainer(
        max_epochs=EPOCHS,
        callbacks=[EveryThirdEpoch(dirpath=tmp_path)],
        deterministic=True,
        **QUIET,
    )
    trainer.fit(*fresh())
    assert [c.epoch for c in stalwart.hindsight.open(tmp_path).run().checkpoints()] == [2, 5]
    result = trainer.replay(*fresh(), probe=EpochProbe())
    assert result.level == "outer"
    assert sorted(set(result.batch_epochs)) == [0, 1, 3, 4]  # 2 and 5 memoized
    assert values(result.metrics("w_norm")).equals(values(truth.metrics("w_norm")))
    assert result.mismatches == []
