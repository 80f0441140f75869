"""With ``max_steps`` set, a fit resumed from a hindsight checkpoint, and so every replay, starts
the next epoch exactly where the uninterrupted record did.

Lightning restarts its loops from any checkpoint once ``max_steps`` is set; restarted from the
record's epoch boundary, the next epoch used to run no batch and the one after it to start at the
same step (an epoch lost), and the first epoch's plateau LR step was skipped.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from digits import DigitsClassifier, DigitsDataModule
from lightning.pytorch.loggers import Logger

import stalwart
from tests.helpers import EveryEpoch

BATCHES = 5  # 640 training samples / 128
#: Where the record stops: 2 batches into epoch 3, or at the end of epoch 3.
LIMITS = {"ends_mid_epoch": 3 * BATCHES + 2, "ends_at_epoch_end": 4 * BATCHES}
QUIET = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


class PlateauEveryEpoch(DigitsClassifier):
    """Draws from the RNG at epoch end, and halves its LR after every epoch through a plateau
    schedule (val_loss never improves by 100%), which the fit loop itself steps."""

    def on_train_epoch_end(self) -> None:
        self.log("epoch_noise", torch.rand(()))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, factor=0.5, patience=0, threshold=1.0
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"},
        }


class GradProbe(L.Callback):
    """Inner-loop: the gradient norm before every optimizer step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        norms = [p.grad.norm() for p in pl_module.parameters() if p.grad is not None]
        pl_module.log("grad_norm", torch.stack(norms).norm())


class Steps(Logger):
    """Keeps every ``(step, metrics)`` Lightning hands its loggers: the loggers' step axis."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    name = "steps"
    version = 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append((step, dict(metrics)))


def trainer_for(max_steps: int, callbacks, logger=False) -> stalwart.Trainer:
    return stalwart.Trainer(
        max_epochs=10,
        max_steps=max_steps,
        callbacks=callbacks,
        deterministic=True,
        logger=logger,
        log_every_n_steps=1,
        **QUIET,
    )


def fresh():
    L.seed_everything(7)
    return PlateauEveryEpoch(width=32), DigitsDataModule(batch_size=128, train_size=640)


def fit(max_steps: int, dirpath, probes=(), ckpt_path=None):
    logger = Steps()
    trainer = trainer_for(max_steps, [EveryEpoch(dirpath=dirpath), *probes], logger)
    model, datamodule = fresh()
    trainer.fit(model, datamodule, ckpt_path=ckpt_path)
    return model, trainer, logger


@pytest.fixture(scope="module", params=list(LIMITS), ids=list(LIMITS))
def record(request, tmp_path_factory):
    max_steps = LIMITS[request.param]
    root = tmp_path_factory.mktemp("record")
    model, trainer, logger = fit(max_steps, root)
    assert trainer.global_step == max_steps
    return max_steps, root, model, trainer, logger


@pytest.fixture(scope="module")
def truth(record, tmp_path_factory):
    """The same record with the probe there from the start."""
    max_steps = record[0]
    root = tmp_path_factory.mktemp("truth")
    fit(max_steps, root, probes=[GradProbe()])
    return stalwart.hindsight.open(root).run()


def values(frame, epochs=None):
    if epochs is not None:
        frame = frame[frame.epoch.isin(epochs)]
    return frame[["epoch", "step", "value"]].reset_index(drop=True)


@pytest.mark.parametrize("epoch", [-1, 1, 2])
def test_a_resume_continues_the_record_bit_for_bit(record, tmp_path, epoch):
    max_steps, root, model, trainer, logger = record
    run = stalwart.hindsight.open(root).run()
    resumed, resumed_trainer, resumed_logger = fit(
        max_steps, tmp_path, ckpt_path=run.checkpoint(epoch).path
    )

    # Every batch of every later epoch ran, at the record's steps, with the record's values
    # (an epoch max_steps cuts short does not validate).
    again = stalwart.hindsight.open(tmp_path).run()
    names = {name for name in run.metric_names() if (run.metrics(name).epoch > epoch).any()}
    assert names >= {"train_loss", "epoch_noise"}
    assert sorted(again.metric_names()) == sorted(names)
    for name in names:
        before = values(run.metrics(name))
        before = before[before.epoch > epoch].reset_index(drop=True)
        assert values(again.metrics(name)).equals(before), name
    # ... and the loggers see them at the record's steps.
    after = [(step, metrics) for step, metrics in logger.logged if metrics["epoch"] > epoch]
    assert resumed_logger.logged == after

    assert (resumed_trainer.current_epoch, resumed_trainer.global_step) == (
        trainer.current_epoch,
        trainer.global_step,
    )
    for (name, x), (_, y) in zip(
        model.state_dict().items(), resumed.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), f"parameter {name} differs"
    # The plateau schedule stepped after every whole epoch: also after the first resumed one.
    (group,) = resumed_trainer.optimizers[0].param_groups
    whole_epochs = max_steps // BATCHES
    assert group["lr"] == trainer.optimizers[0].param_groups[0]["lr"] == 0.1 * 0.5**whole_epochs


@pytest.mark.parametrize("workers", [1, 2])
def test_an_inner_loop_replay_from_epoch_checkpoints_is_bit_exact(record, truth, workers):
    max_steps, root = record[:2]
    result = trainer_for(max_steps, [EveryEpoch(dirpath=root)]).replay(
        *fresh(), probe=GradProbe(), epochs=[2, 3], workers=workers, loggers=None
    )
    assert len(result.segments) == workers
    last = max_steps - 3 * BATCHES  # the batches epoch 3 ran before max_steps
    assert sorted(result.batch_epochs) == [2] * BATCHES + [3] * last
    replayed = values(result.metrics("grad_norm")).sort_values("step", ignore_index=True)
    assert replayed.equals(values(truth.metrics("grad_norm"), [2, 3]))
    assert replayed.step.tolist() == list(range(2 * BATCHES, max_steps))
    assert result.mismatches == []  # train_loss, val_loss, epoch_noise as recorded
