"""Replay inside a Lightning fit: memoized epochs skip their batches, probes log as usual."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from stalwart.callbacks.lightning_internals import (
    release_epoch_batches,
    release_loaders_built,
    replace_epoch_batches,
    when_loaders_built,
)
from stalwart.callbacks.loader_rng import LOADER_RNG_KEY, restore_loader_rng
from stalwart.callbacks.log_capture import LogCapture
from stalwart.callbacks.loop_state import restore_inner_loop_end
from stalwart.errors import ConfigurationError
from stalwart.hindsight.plan import INNER, OUTER, Segment
from stalwart.hindsight.store import CheckpointEntry, HindsightStore
from stalwart.rng import RNG_KEY, restore_rng

#: Hooks that run per training batch: a probe or an edit touching one needs the batches re-run.
BATCH_LEVEL_HOOKS = frozenset(
    {
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
        "training_step",
        "backward",
        "optimizer_step",
        "optimizer_zero_grad",
        "configure_gradient_clipping",
        "lr_scheduler_step",
        "train_dataloader",
        "transfer_batch_to_device",
        "on_before_batch_transfer",
        "on_after_batch_transfer",
    }
)
#: Module methods whose edits only change epoch-level work (validation, epoch hooks).
EPOCH_LEVEL_HOOKS = frozenset(
    {
        "validation_step",
        "on_validation_start",
        "on_validation_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "val_dataloader",
        "on_validation_model_eval",
        "on_validation_model_train",
    }
)


class FunctionProbe(Callback):
    """A plain function run on one Lightning hook, as a probe.

    Args:
        hook: the callback hook name, e.g. ``"on_train_epoch_end"``.
        fn: called with the hook's arguments ``(trainer, pl_module, *args)``.

    Example::

        def lr(trainer, pl_module):
            pl_module.log("lr", trainer.optimizers[0].param_groups[0]["lr"])

        trainer.replay(model, datamodule, probe=FunctionProbe("on_train_epoch_end", lr))
    """

    def __init__(self, hook: str, fn: Callable[..., Any]) -> None:
        if not hook.startswith("on_") or not callable(getattr(Callback, hook, None)):
            raise ConfigurationError(
                f"{hook!r} is not a Lightning callback hook; use one such as "
                "'on_train_epoch_end' or 'on_train_batch_end'."
            )
        self.hook = hook
        self.fn = fn
        setattr(self, hook, fn)

    @property
    def state_key(self) -> str:
        return f"FunctionProbe[{self.hook}:{getattr(self.fn, '__qualname__', self.fn)}]"


def probe_hooks(probe: Callback) -> set[str]:
    """The hooks a probe callback implements."""
    if isinstance(probe, FunctionProbe):
        return {probe.hook}
    return {
        name
        for name in dir(Callback)
        if name.startswith("on_")
        and getattr(type(probe), name, None) is not getattr(Callback, name)
    }


def probe_level(probes: list[Callback], edited_hooks: set[str]) -> str:
    """Inner if any probe hook or edited module method runs per training batch."""
    touched = set().union(*(probe_hooks(p) for p in probes)) if probes else set()
    if touched & BATCH_LEVEL_HOOKS:
        return INNER
    # An edited helper we cannot place (forward, a custom method) may run in training_step.
    if edited_hooks - EPOCH_LEVEL_HOOKS:
        return INNER
    return OUTER


class ReplayDriver(Callback):
    """Runs one replay segment inside a fit: skips memoized epochs, stores the probes' values.

    A memoized epoch's training batches do not run: the state they produced is restored from the
    epoch's checkpoint (weights, optimizer, loop counters; schedulers and RNG as the last batch
    left them) and the epoch-level work runs as recorded: validation, then the epoch-end hooks and
    the LR step.
    """

    def __init__(
        self,
        segment: Segment,
        checkpoints: dict[int, CheckpointEntry],
        store_dir: str,
        run_id: int,
        replay_id: str,
        index: int,
    ) -> None:
        self.segment = segment
        self.checkpoints = checkpoints
        self.store_dir = store_dir
        self.run_id = run_id
        self.replay_id = replay_id
        self.index = index
        self.batch_epochs: list[int] = []
        self._store: HindsightStore | None = None
        self._capture: LogCapture | None = None
        self._started = 0.0
        self._loader_rng: list[torch.Tensor] | None = None

    @property
    def state_key(self) -> str:
        return "stalwart.ReplayDriver"

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._started = time.perf_counter()
        self._store = HindsightStore(self.store_dir, create=True)
        requested = self.segment.requested
        self._capture = LogCapture(
            self._store, self.run_id, "replay", self.replay_id, keep=requested.__contains__
        )
        self._capture.attach(pl_module, trainer)
        when_loaders_built(trainer, lambda: self._restore_loader_rng(trainer))
        replace_epoch_batches(
            trainer,
            skip=self.segment.memoized.__contains__,
            restore=lambda epoch: self._restore_memoized(trainer, epoch),
        )

    def _restore_memoized(self, trainer: Trainer, epoch: int) -> None:
        # The record's own file, its bytes checked against the record's index first: loaded in
        # full, as the segment's start is, since callbacks' state may hold objects a weights-only
        # load refuses (StochasticWeightAveraging's scheduler keeps a function).
        checkpoint = self.checkpoints[epoch].load(weights_only=False)
        others = [callback for callback in trainer.callbacks if callback is not self]
        restore_inner_loop_end(trainer, checkpoint, others)

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A resumed run's first epochs start from the file it resumed from, which may be a
        # ModelCheckpoint's, without RNG state: the recorded fit then went on with its process's
        # RNG as seeded before the fit (HindsightCallback restores it only when present), and so
        # does this one.
        if RNG_KEY in checkpoint:
            restore_rng(checkpoint[RNG_KEY])
        self._loader_rng = checkpoint.get(LOADER_RNG_KEY)

    def _restore_loader_rng(self, trainer: Trainer) -> None:
        # The checkpoint is loaded before the loaders exist, and their first iterator is made
        # right after they are built, before any hook: in between is the one place for this.
        if self._loader_rng is not None:
            restore_loader_rng(trainer, self._loader_rng)
            self._loader_rng = None

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.batch_epochs.append(trainer.current_epoch)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self._capture.flush()

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._capture.flush()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._capture.flush()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        release_epoch_batches(trainer)
        release_loaders_built(trainer)
        if self._capture is not None:
            self._capture.flush()
            self._capture.detach()
        if self._store is not None:
            self._store.add_replay_work(
                self.replay_id, self.run_id, self.index, self.segment.resume_from,
                self.segment.last_epoch, self.batch_epochs, time.perf_counter() - self._started,
            )  # fmt: skip
            self._store.close()
