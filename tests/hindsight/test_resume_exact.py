"""A hindsight checkpoint is complete: a resume from it reproduces the uninterrupted run exactly."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule

import stalwart
from stalwart import HindsightCallback
from tests.helpers import QUIET

EPOCHS = 6


class EveryEpoch(HindsightCallback):
    """Checkpoint every epoch regardless of cost, so every resume point exists."""

    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return True


class RandomEpochEnd(DigitsClassifier):
    """Draws from the RNG in an epoch-end hook too, and steps its LR schedule per epoch."""

    def on_train_epoch_end(self) -> None:
        self.log("epoch_noise", torch.rand(()))


def fit(callbacks, ckpt_path=None, max_epochs=EPOCHS) -> L.LightningModule:
    L.seed_everything(7)
    model = RandomEpochEnd(width=64)
    trainer = L.Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        deterministic=True,
        **QUIET,
    )
    trainer.fit(model, DigitsDataModule(batch_size=128, train_size=640), ckpt_path=ckpt_path)
    return model, trainer


def assert_same_state(a: L.LightningModule, b: L.LightningModule, ta, tb) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), f"parameter {name} differs"
    sa, sb = ta.optimizers[0].state_dict(), tb.optimizers[0].state_dict()
    for key in sa["state"]:
        assert torch.equal(sa["state"][key]["momentum_buffer"], sb["state"][key]["momentum_buffer"])
    assert sa["param_groups"][0]["lr"] == sb["param_groups"][0]["lr"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("record")
    model, trainer = fit([EveryEpoch(dirpath=root)])
    return root, model, trainer


def test_recording_does_not_perturb_training(recorded):
    _, model, trainer = recorded
    plain, plain_trainer = fit([])
    assert_same_state(model, plain, trainer, plain_trainer)


@pytest.mark.parametrize("epoch", [-1, 0, 2, 4])
def test_resume_from_checkpoint_is_bit_exact(recorded, tmp_path, epoch):
    root, model, trainer = recorded
    run = stalwart.hindsight.open(root).run()
    entry = run.checkpoint(epoch)
    entry.load()  # verified against its checksum
    resumed, resumed_trainer = fit([EveryEpoch(dirpath=tmp_path)], ckpt_path=entry.path)
    assert_same_state(model, resumed, trainer, resumed_trainer)

    # The values logged after the resume point equal the record's, bit for bit.
    again = stalwart.hindsight.open(tmp_path).run()
    assert again.resumed_from.endswith(f"run_{run.run_id:04d}@epoch={epoch}")
    for name in ("train_loss", "val_loss", "epoch_noise"):
        before = run.metrics(name)
        before = before[before.epoch > epoch].reset_index(drop=True)
        after = again.metrics(name).reset_index(drop=True)
        assert after.epoch.min() == epoch + 1
        assert before[["epoch", "step", "value"]].equals(after[["epoch", "step", "value"]]), name


def test_checkpoint_holds_the_complete_training_state(recorded):
    root, _, _ = recorded
    state = stalwart.hindsight.open(root).run().checkpoint(3).load()
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"):
        assert key in state, key
    assert {"python", "numpy", "torch", "cuda"} <= set(state["stalwart_rng"])
    assert state["lr_schedulers"][0]["last_epoch"] == 4  # stepped after each of epochs 0..3
    # The record's own state counts this checkpoint, as the uninterrupted record did after it: a
    # resume continues the policy from there (epochs 0..3 checkpointed, init.ckpt apart).
    (record,) = [s for s in state["callbacks"].values() if "policy" in s]
    assert record["decided_through"] == 3
    assert record["policy"]["checkpoints"] == 4 and record["policy"]["last_checkpoint_epochs"] == 4
    # Plain torch.load with Lightning's default weights_only=True reads it.
    torch.load(stalwart.hindsight.open(root).run().checkpoint(3).path, weights_only=True)
