"""An outer-loop replay of a checkpointed epoch whose previous epoch has no checkpoint.

The memoized epoch's *end* is restored from its own checkpoint, but its start is the previous
epoch's end: what ``on_train_epoch_start`` sees, and what the epoch-level work of the epochs
before it carries into it (callbacks' state, the probe's own). The replay reaches it from the
checkpoint before, training the epoch in between, so those values are the rerun's bit for bit.
A plan that jumped the epoch in between (it was not asked for) would hand the probe the older
checkpoint's weights instead.
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import stalwart
from stalwart import FunctionProbe
from tests.helpers import QUIET

EPOCHS, BATCHES = 6, 4


class Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OddEpochs(stalwart.HindsightCallback):
    """Checkpoints after epochs 1, 3, 5 only."""

    def should_checkpoint(self, trainer, policy_says: bool) -> bool:
        return trainer.current_epoch % 2 == 1


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 8, generator=generator), torch.randint(0, 2, (40,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=10)


def weight_norm(name: str):
    return lambda trainer, module: module.log(name, module.net.weight.norm())


def probes() -> list[FunctionProbe]:
    return [
        FunctionProbe("on_train_epoch_start", weight_norm("at_start")),
        FunctionProbe("on_train_epoch_end", weight_norm("at_end")),
    ]


class Seen(L.Callback):
    """What a rerun with the probes would have logged, by epoch."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int], float] = {}

    def on_train_epoch_start(self, trainer, module) -> None:
        self.values["at_start", trainer.current_epoch] = module.net.weight.norm().item()

    def on_train_epoch_end(self, trainer, module) -> None:
        self.values["at_end", trainer.current_epoch] = module.net.weight.norm().item()


def test_a_memoized_epochs_start_is_the_trained_epoch_before_it(tmp_path):
    trainer = stalwart.Trainer(
        max_epochs=EPOCHS, callbacks=[OddEpochs(dirpath=tmp_path)], deterministic=True, **QUIET
    )
    torch.manual_seed(0)
    trainer.fit(Linear(), data())
    seen = Seen()
    torch.manual_seed(0)
    L.Trainer(max_epochs=EPOCHS, callbacks=[seen], deterministic=True, **QUIET).fit(
        Linear(), data()
    )

    plan = trainer.replay(Linear(), data(), probe=probes(), epochs=[3, 5], dry_run=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch with the record
        result = trainer.replay(Linear(), data(), probe=probes(), epochs=[3, 5])

    assert result.level == "outer"
    (segment,) = result.segments
    assert (segment.memoized, segment.executed) == (frozenset({3, 5}), [2, 4])
    assert sorted(set(result.batch_epochs)) == [2, 4]
    assert result.batches_executed == plan.batches == 2 * BATCHES
    for name in ("at_start", "at_end"):
        replayed = result.metrics(name)
        assert replayed.epoch.tolist() == [3, 5]
        assert replayed.value.tolist() == [seen.values[name, epoch] for epoch in (3, 5)]
