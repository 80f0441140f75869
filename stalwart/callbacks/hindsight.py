"""HindsightCallback: record a Lightning run cheaply, so it can be queried and replayed later."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from stalwart.callbacks.lightning_internals import (
    batches_completed,
    dispatched_per_batch,
    dump_checkpoint,
    fit_ends_after_this_epoch,
    hook_dispatch_seconds,
    hook_epoch_boundary,
    is_last_batch,
    release_epoch_start,
    release_loaders_built,
    resume_at_epoch_start,
    skip_unused_hooks,
    unhook_epoch_boundary,
    when_loaders_built,
)
from stalwart.callbacks.loader_rng import LOADER_RNG_KEY, capture_loader_rng, restore_loader_rng
from stalwart.callbacks.log_capture import LogCapture
from stalwart.callbacks.loop_state import (
    INNER_LOOP_END_KEY,
    capture_inner_loop_end,
    capture_logged,
)
from stalwart.callbacks.replay_loggers import describe_loggers
from stalwart.hindsight.checkpoint_file import checksum_file
from stalwart.hindsight.fingerprint import hook_fingerprints
from stalwart.hindsight.materializer import Materializer, tensor_bytes
from stalwart.hindsight.persistent_workers import persistent_workers_warning
from stalwart.hindsight.policy import DEFAULT_EPSILON, DEFAULT_RESTORE_RATIO, JointInvariantPolicy
from stalwart.hindsight.recorder import LOG_FLUSH_SECONDS, Recorder
from stalwart.hindsight.store import HindsightStore
from stalwart.hindsight.writeback import LOGGERS_KEY
from stalwart.rng import RNG_KEY, capture_rng, restore_rng


class HindsightCallback(Callback):
    r"""Record a training run for hindsight logging: every logged value, plus adaptive checkpoints.

    At each training-epoch end the callback measures the epoch's compute time ``C`` and asks the
    policy (Flor's Joint Invariant, :class:`~stalwart.hindsight.policy.JointInvariantPolicy`)
    whether a checkpoint now keeps the record overhead under ``epsilon``. A checkpoint is complete:
    everything Lightning saves (module, optimizers, LR schedulers, precision state, loops, data
    module and callback states) plus every RNG state, so ``trainer.fit(ckpt_path=...)`` from it
    continues bit for bit. The main thread only snapshots the state (on CPU a copy handed to a
    writer thread); the file is written in the background.

    Every ``self.log`` call is stored in ``dirpath/hindsight.db`` (SQLite) with the run's manifest;
    read it with :func:`stalwart.hindsight.open`.

    Args:
        dirpath: the run directory (created if missing). Each ``fit`` adds a run to it.
        epsilon: record overhead budget, a fraction in (0, 1); default 1/15 (6.67%).
        materializer: ``"fork"`` (background writes, default: a writer thread on CPU, a fork or
            the thread, measured, where the state is on a GPU) or ``"inline"`` (main thread).
        restore_ratio: expected restore/materialize cost ratio ``c`` of the policy.

    Example::

        from lightning.pytorch import Trainer
        import stalwart
        from stalwart import HindsightCallback

        trainer = Trainer(max_epochs=20, callbacks=[HindsightCallback(dirpath="runs")])
        trainer.fit(model, datamodule)
        stalwart.hindsight.open("runs").run().metrics("val_loss")

    Checkpoints are taken between epochs, after every epoch-end hook and the LR step have run.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike = "runs",
        epsilon: float = DEFAULT_EPSILON,
        materializer: str | Materializer = "fork",
        restore_ratio: float = DEFAULT_RESTORE_RATIO,
    ) -> None:
        self.recorder = Recorder(dirpath, epsilon, materializer, restore_ratio, "HindsightCallback")
        self._capture: LogCapture | None = None
        self._inner_loop_end: dict | None = None
        self._rng_at_start: dict | None = None
        self._dispatch_per_batch = 0.0
        self._first_batch = 0
        self._training_counted = False
        self._loaders_checked: set[str] = set()
        #: The training DataLoaders' generator states of the checkpoint a fit resumes from.
        self._loader_rng: list[torch.Tensor] | None = None
        # Lightning would otherwise hand this callback every hook of every batch, each in a
        # profiler section: more than the record's own per-batch work costs.
        skip_unused_hooks(self)

    @property
    def dirpath(self) -> Path:
        return self.recorder.dirpath

    @property
    def policy(self) -> JointInvariantPolicy:
        return self.recorder.policy

    @property
    def store(self) -> HindsightStore:
        return self.recorder.store

    @property
    def run_id(self) -> int | None:
        return self.recorder.run_id

    @property
    def resumed_from(self) -> str | None:
        return self.recorder.resumed_from

    # -- lifecycle -------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # On every rank: a fit resumed from one of the record's checkpoints starts the next
        # epoch afresh, also with max_steps set (Lightning would restart the loops mid-epoch).
        resume_at_epoch_start(trainer)
        when_loaders_built(trainer, lambda: self._restore_loader_rng(trainer))
        if not trainer.is_global_zero:
            return
        started = time.perf_counter()
        self._inner_loop_end = None
        self._rng_at_start = None
        self._loaders_checked = set()
        datamodule = trainer.datamodule
        fingerprints = {
            "module": hook_fingerprints(pl_module),
            "datamodule": hook_fingerprints(datamodule) if datamodule is not None else {},
        }
        fingerprinting = time.perf_counter() - started
        run_id = self.recorder.begin(
            hparams=dict(pl_module.hparams),
            fingerprints=fingerprints,
            config={
                "max_epochs": trainer.max_epochs,
                # A replay stops where max_steps stopped the record, however its Trainer is built.
                "max_steps": trainer.max_steps,
                "module_class": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
                # A replay in eager mode of a record made compiled rounds differently: its hint
                # says so.
                "compiled": getattr(pl_module, "_compiler_ctx", None) is not None,
                "lightning": lightning.__version__,
                "torch": torch.__version__,
                # Where the user's loggers keep their values: a replay writes there too.
                LOGGERS_KEY: describe_loggers(trainer.loggers),
            },
        )
        # What recording adds before training is part of its cost (begin charges its own).
        self.recorder.charge_fixed(fingerprinting)
        # Lightning hands the batch hooks this callback implements to it: that is the record's
        # (and so is measuring it).
        with self.recorder.charged():
            hooks = dispatched_per_batch(self, pl_module.automatic_optimization)
            self._dispatch_per_batch = hooks * hook_dispatch_seconds(trainer, self)
        self._capture = LogCapture(self.store, run_id, "record", flush_every=LOG_FLUSH_SECONDS)
        self._capture.attach(pl_module, trainer)
        self.recorder.flush_logs = self._capture.flush
        # Materialized once the fit loop has finished the epoch, the one exact resume point:
        # after the module's own on_train_epoch_end and the epoch-interval LR step.
        hook_epoch_boundary(
            trainer, on_end=lambda: self._materialize_due(trainer), on_error=self.recorder.drop_due
        )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Before the fit loop builds epoch 0's data iterator, which draws from the RNG.
        with self.recorder.charged():
            self._rng_at_start = capture_rng()
            self._note_resumed_file(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.recorder.recording:
            warn_persistent_workers(trainer, self._loaders_checked, self.recorder.name)
        if self.run_id is not None and trainer.ckpt_path is None:
            self.recorder.write_initial(
                lambda: self._snapshot(trainer, rng=self._rng_at_start), trainer.global_step
            )
        self.recorder.train_started()
        # Lightning may run an epoch's end with no start in this fit: with max_steps set, a fit
        # resumed from a file saved inside on_train_epoch_end (a ModelCheckpoint's) runs that
        # epoch's end again, and no batch. Its count of batches starts here.
        self._first_batch = batches_completed(trainer)
        self._training_counted = False

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.recorder.epoch_started()
        self._first_batch = batches_completed(trainer)
        self._training_counted = False

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning hands every batch to this hook, but only the epoch's last has work here:
        # what the record counts per batch is summed at the epoch end instead. Counting it here
        # cost ~10 us a batch in a fit (0.4% of the wall clock of 0.1 s epochs of a 1 MB model).
        if not is_last_batch(trainer) or not self.recorder.recording:
            return
        started = time.perf_counter()
        self._inner_loop_end = capture_inner_loop_end(trainer)
        done = batches_completed(trainer) + 1  # this batch is counted after the hook
        self.recorder.training_ended(done - self._first_batch)
        self._training_counted = True
        self.recorder.charge_bookkeeping(time.perf_counter() - started)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.recorder.recording:
            started = time.perf_counter()
            done = batches_completed(trainer)
            if not self._training_counted:  # the epoch stopped early (e.g. max_steps)
                self.recorder.training_ended(done - self._first_batch)
            else:
                # Completes the inner-loop-end capture here, not after the last batch: later
                # callbacks' and the module's on_train_batch_end still log after this callback's.
                capture_logged(self._inner_loop_end, trainer)
            # The epoch's log captures, the capture above and Lightning's dispatch of the batch
            # hook to this callback: the record's, not the epoch's compute.
            spent = self._capture.spent + time.perf_counter() - started
            self._capture.spent = 0.0
            dispatch = (done - self._first_batch) * self._dispatch_per_batch
            self.recorder.charge_bookkeeping(spent + dispatch)
        # Decided here, materialized once the epoch has fully ended (see setup): the module's
        # own on_train_epoch_end and the epoch-interval LR step still run after this hook.
        self.recorder.epoch_ended(
            trainer.current_epoch,
            state_bytes=lambda: (
                tensor_bytes(pl_module.state_dict())
                + tensor_bytes([optimizer.state_dict() for optimizer in trainer.optimizers])
            ),
            veto=lambda policy_says: self.should_checkpoint(trainer, policy_says),
            final=fit_ends_after_this_epoch(trainer),
        )

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Where neither the sanity check nor the first epoch validates, the validation loaders
        # are built only now (the sanity check's are there at on_train_start, checked with the
        # training loaders: one warning names both).
        checked = "validation" in self._loaders_checked
        if self.recorder.recording and not checked and not trainer.sanity_checking:
            warn_persistent_workers(trainer, self._loaders_checked, self.recorder.name)

    def should_checkpoint(self, trainer: Trainer, policy_says: bool) -> bool:
        """Override to force or veto checkpoints; by default the policy decides.

        The fit's last epoch is not checkpointed (no replay starts after it, and the fit would
        wait for the write): where the fit is known to stop there (``max_epochs``, ``max_steps``,
        a stop already requested), ``policy_says`` is False; where a later epoch-end hook
        requests the stop (``EarlyStopping`` checks after this callback), the checkpoint this
        returned True for is dropped, unless it returned True against ``policy_says``.
        """
        return policy_says

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish("completed")

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._finish("failed")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        unhook_epoch_boundary(trainer)
        release_epoch_start(trainer)
        release_loaders_built(trainer)
        if self._capture is not None:
            self._capture.detach()
            self._capture = None
        self.recorder.close()

    # -- checkpoint contents -----------------------------------------------------------------

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Restored here, before the fit loop builds its dataloader iterator, which draws a seed.
        if RNG_KEY in checkpoint:
            restore_rng(checkpoint[RNG_KEY])
        self._loader_rng = checkpoint.get(LOADER_RNG_KEY)

    def state_dict(self) -> dict[str, Any]:
        return self.recorder.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.recorder.load_state_dict(state_dict)

    # -- internals ---------------------------------------------------------------------------

    def _materialize_due(self, trainer: Trainer) -> None:
        self.recorder.materialize_due(
            lambda: self._snapshot(trainer, self._inner_loop_end),
            trainer.global_step,
            final=fit_ends_after_this_epoch(trainer),
        )

    def _snapshot(
        self, trainer: Trainer, inner_loop_end: dict | None = None, rng: dict | None = None
    ) -> dict:
        """The complete training state: Lightning's checkpoint plus every RNG state."""
        checkpoint = dump_checkpoint(trainer)
        checkpoint[RNG_KEY] = rng if rng is not None else capture_rng()
        # Not for init.ckpt (rng given): training starts from the loaders' generators as the
        # user's code builds them, and by on_train_start the first iterator has drawn from them.
        loader_rng = capture_loader_rng(trainer) if rng is None else []
        if loader_rng:
            checkpoint[LOADER_RNG_KEY] = loader_rng
        if inner_loop_end is not None:
            checkpoint[INNER_LOOP_END_KEY] = inner_loop_end
        return checkpoint

    def _note_resumed_file(self, trainer: Trainer) -> None:
        """A fit resumed with ``ckpt_path`` writes no ``init.ckpt``: a replay of its first epochs
        starts from the file it resumed from (which may be a ``ModelCheckpoint``'s, outside the
        record). Noted with its size and CRC-32 now, before training may overwrite it (a
        ``last.ckpt``), so a replay can tell it from a later file of the same name."""
        path = trainer.ckpt_path  # Lightning has resolved "last"/"best" and loaded it by now
        if self.run_id is None or not isinstance(path, (str, os.PathLike)):
            return
        if os.path.isfile(path):
            self.store.note_resumed_file(self.run_id, path, *checksum_file(path))

    def _restore_loader_rng(self, trainer: Trainer) -> None:
        """The resumed checkpoint's DataLoader generator states, once the loaders exist."""
        if self._loader_rng is not None:
            restore_loader_rng(trainer, self._loader_rng)
            self._loader_rng = None

    def _finish(self, status: str) -> None:
        summary = self.recorder.finish(status)
        if summary is not None:
            rank_zero_info(summary)


def warn_persistent_workers(trainer: Trainer, checked: set[str], name: str) -> None:
    """Warn, once a fit (``checked``: the loader kinds looked at so far), where a training or
    validation DataLoader keeps its workers.

    Persistent workers are seeded once, when their loader is first iterated (from a seed the
    main process draws then, and only then), and their random state then runs on from epoch
    to epoch inside the worker processes, where no checkpoint can hold it. A fit resumed
    from an epoch checkpoint starts new workers from a seed drawn where the recorded run drew
    none, so the data order and any augmentation differ from the record's from there on.
    """
    persistent = []
    for kind, loaders in (
        ("training", trainer.train_dataloader),
        ("validation", trainer.val_dataloaders),
    ):
        if loaders is None or kind in checked:
            continue  # validation loaders not built yet: checked when validation starts
        checked.add(kind)
        found: list[DataLoader] = []
        apply_to_collection(loaders, DataLoader, found.append)
        if any(loader.persistent_workers for loader in found):
            persistent.append(kind)
    if persistent:
        checked |= {"training", "validation"}  # one warning a fit is enough
        warnings.warn(persistent_workers_warning(name, persistent), stacklevel=2)
