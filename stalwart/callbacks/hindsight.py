"""HindsightCallback: record a Lightning run cheaply, so it can be queried and replayed later."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import replace
from typing import Any

import lightning
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from stalwart.callbacks.log_capture import LogCapture
from stalwart.callbacks.loop_state import INNER_LOOP_END_KEY, capture_inner_loop_end
from stalwart.hindsight.fingerprint import hook_fingerprints
from stalwart.hindsight.interference import InterferenceMeter
from stalwart.hindsight.materializer import (
    InlineMaterializer,
    Materializer,
    WriteJob,
    make_materializer,
    tensor_bytes,
)
from stalwart.hindsight.policy import (
    DEFAULT_EPSILON,
    DEFAULT_RESTORE_RATIO,
    Decision,
    JointInvariantPolicy,
)
from stalwart.hindsight.rng import RNG_KEY, capture_rng, restore_rng
from stalwart.hindsight.store import (
    INITIAL_EPOCH,
    HindsightStore,
    checkpoint_recorder,
    prepare_directory,
)

#: Logged values are committed to the store at least this often (and at every epoch end).
LOG_FLUSH_SECONDS = 1.0


class HindsightCallback(Callback):
    r"""Record a training run for hindsight logging: every logged value, plus adaptive checkpoints.

    At each training-epoch end the callback measures the epoch's compute time ``C`` and asks the
    policy (Flor's Joint Invariant, :class:`~stalwart.hindsight.policy.JointInvariantPolicy`)
    whether a checkpoint now keeps the record overhead under ``epsilon``. A checkpoint is complete:
    everything Lightning saves (module, optimizers, LR schedulers, precision state, loops, data
    module and callback states) plus every RNG state, so ``trainer.fit(ckpt_path=...)`` from it
    continues bit for bit. The main thread only forks; a child writes the file in the background.

    Every ``self.log`` call is stored in ``dirpath/hindsight.db`` (SQLite) with the run's manifest;
    read it with :func:`stalwart.hindsight.open`.

    Args:
        dirpath: the run directory (created if missing). Each ``fit`` adds a run to it.
        epsilon: record overhead budget, a fraction in (0, 1); default 1/15 (6.67%).
        materializer: ``"fork"`` (background writes, default) or ``"inline"`` (no fork).
        restore_ratio: expected restore/materialize cost ratio ``c`` of the policy.

    Example::

        from lightning.pytorch import Trainer
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
        # Every argument is checked before anything is created on disk.
        self.policy = JointInvariantPolicy(epsilon=epsilon, restore_ratio=restore_ratio)
        make_materializer(materializer)
        self._materializer_spec = materializer
        self.dirpath = prepare_directory(dirpath)
        self._store: HindsightStore | None = None
        self._materializer: Materializer | None = None
        self._capture: LogCapture | None = None
        self._start_fresh()

    def _start_fresh(self) -> None:
        """Per-fit state: each fit is a new run (a resume then loads the checkpointed state)."""
        self.policy = JointInvariantPolicy(self.policy.epsilon, self.policy.restore_ratio)
        self.run_id: int | None = None
        self.resumed_from: str | None = None
        self._decided_through = -1
        self._cost_estimate: float | None = None
        self._due: tuple[Decision, float] | None = None
        self._interference = InterferenceMeter()
        self._shadowed = False
        self._warmup = True
        self._last_flush = 0.0
        self._clock = 0.0
        self._inner_loop_end: dict | None = None
        self._rng_at_start: dict | None = None

    @property
    def store(self) -> HindsightStore:
        if self._store is None:
            self._store = HindsightStore(self.dirpath, create=True)
        return self._store

    # -- lifecycle -------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        self._start_fresh()
        self._materializer = make_materializer(self._materializer_spec)
        datamodule = trainer.datamodule
        self.run_id = self.store.begin_run(
            hparams=dict(pl_module.hparams),
            fingerprints={
                "module": hook_fingerprints(pl_module),
                "datamodule": hook_fingerprints(datamodule) if datamodule is not None else {},
            },
            config={
                "epsilon": self.policy.epsilon,
                "restore_ratio": self.policy.restore_ratio,
                "materializer": self._materializer.name,
                "max_epochs": trainer.max_epochs,
                "module_class": f"{type(pl_module).__module__}.{type(pl_module).__qualname__}",
                "lightning": lightning.__version__,
                "torch": torch.__version__,
            },
        )
        self._capture = LogCapture(self.store, self.run_id, "record")
        self._capture.attach(pl_module, trainer)
        self._hook_epoch_boundary(trainer)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Before the fit loop builds epoch 0's data iterator, which draws from the RNG.
        self._rng_at_start = capture_rng()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.run_id is not None and trainer.ckpt_path is None:
            # The state training starts from, so a replay from epoch 0 needs no user seeding.
            # Written inline, before training starts: a background writer here would slow the
            # first epoch, which is also the only clean baseline the interference meter has yet.
            cost = self._write_checkpoint(
                trainer, INITIAL_EPOCH, "init.ckpt", rng=self._rng_at_start,
                materializer=InlineMaterializer(),
            )  # fmt: skip
            self.policy.charge(cost)
        self._clock = time.perf_counter()
        self._warmup = True

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._materializer is not None:
            self._shadowed = self._materializer.busy

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self._materializer is None:
            return
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._inner_loop_end = capture_inner_loop_end(trainer)
        # A commit per batch costs ~0.1 ms inside training: commit about once a second instead
        # (and at every epoch end); a crash loses at most that second of logged values.
        if time.perf_counter() - self._last_flush >= LOG_FLUSH_SECONDS:
            self._flush_logs()
        self._materializer.poll()
        self._shadowed = self._shadowed or self._materializer.busy

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush_logs()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = trainer.current_epoch
        if self.run_id is None or epoch <= self._decided_through:
            return
        self._flush_logs()
        self._materializer.poll()
        shadowed = self._shadowed or self._materializer.busy
        epoch_seconds = time.perf_counter() - self._clock
        self._interference.observe(epoch_seconds, shadowed=shadowed, warmup=self._warmup)
        self._warmup = False
        interference = self._interference.take()
        self.policy.charge(interference)
        compute_time = epoch_seconds - max(interference, 0.0)
        estimate = self._estimate_cost(trainer, pl_module)
        decision = self.policy.decide(
            compute_time=compute_time, materialize_cost=estimate, epoch=epoch
        )
        # Until one clean epoch (no writer alive) has been seen, a checkpoint's true cost cannot
        # be measured: leave the epoch after the first checkpoint free of a new writer.
        measurable = self._interference.baseline is not None or self.policy.checkpoints == 0
        decision = replace(
            decision,
            checkpoint=self.should_checkpoint(trainer, decision.checkpoint and measurable),
        )
        self._decided_through = epoch
        if decision.checkpoint:
            # Materialized once the epoch has fully ended (see _hook_epoch_boundary): the module's
            # own on_train_epoch_end and the epoch-interval LR step still run after this hook.
            self.policy.checkpointed(estimate)
            self._due = (decision, interference)
        else:
            self.store.add_decision(self.run_id, decision.as_dict(), None, interference)
        self._clock = time.perf_counter()

    def should_checkpoint(self, trainer: Trainer, policy_says: bool) -> bool:
        """Override to force or veto checkpoints; by default the policy decides."""
        return policy_says

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish("completed")

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._finish("failed")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        vars(trainer.fit_loop).pop("on_advance_end", None)
        if self._capture is not None:
            self._capture.detach()
            self._capture = None
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- checkpoint contents -----------------------------------------------------------------

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Restored here, before the fit loop builds its dataloader iterator, which draws a seed.
        if RNG_KEY in checkpoint:
            restore_rng(checkpoint[RNG_KEY])

    def state_dict(self) -> dict[str, Any]:
        return {
            "dirpath": str(self.dirpath),
            "run_id": self.run_id,
            "decided_through": self._decided_through,
            "cost_estimate": self._cost_estimate,
            "policy": self.policy.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict["policy"])
        self._decided_through = int(state_dict["decided_through"])
        self._cost_estimate = state_dict["cost_estimate"]
        previous = state_dict["run_id"]
        if previous is not None:
            self.resumed_from = (
                f"{state_dict['dirpath']}#run_{previous:04d}@epoch={self._decided_through}"
            )
            if self.run_id is not None:
                self.store.mark_resumed(self.run_id, self.resumed_from)

    # -- internals ---------------------------------------------------------------------------

    def _estimate_cost(self, trainer: Trainer, pl_module: LightningModule) -> float:
        """The mean measured cost of this run's checkpoints; before the first, a measured probe.

        Measured cost is main-thread time plus the slowdown background writes caused (see
        :mod:`stalwart.hindsight.interference`). The mean, not the last value: with buffered small
        checkpoints most cost a copy and every few a fork; the mean is what one more costs.
        """
        if self.policy.checkpoints:
            return self.policy.total_materialize / self.policy.checkpoints
        if self._cost_estimate is None:
            nbytes = tensor_bytes(pl_module.state_dict()) + tensor_bytes(
                [optimizer.state_dict() for optimizer in trainer.optimizers]
            )
            self._cost_estimate = self._materializer.probe_cost(
                nbytes, self.store.run_dir(self.run_id)
            )
        return self._cost_estimate

    def _hook_epoch_boundary(self, trainer: Trainer) -> None:
        """Materialize right after the fit loop finishes an epoch, the one exact resume point.

        No callback hook runs there: a snapshot in ``on_train_epoch_end`` misses the module's own
        epoch-end hook and the LR step, and one in the next ``on_train_epoch_start`` has loop
        counters that Lightning's restart logic reads as a later epoch. So the fit loop's
        ``on_advance_end`` is wrapped for this fit (teardown removes the wrapper).
        """
        loop = trainer.fit_loop
        advance_end = loop.on_advance_end

        def on_advance_end() -> None:
            try:
                advance_end()
            except SIGTERMException:  # raised after the epoch completed: the state is whole
                self._materialize_due(trainer)
                raise
            except BaseException:
                self._due = None
                raise
            self._materialize_due(trainer)

        loop.on_advance_end = on_advance_end

    def _materialize_due(self, trainer: Trainer) -> None:
        due, self._due = self._due, None
        if due is None:
            return
        decision, interference = due
        measured = self._write_checkpoint(
            trainer, decision.epoch, f"epoch={decision.epoch:04d}.ckpt", self._inner_loop_end
        )
        self.policy.revise_last_cost(decision.materialize_cost, measured)
        self.store.add_decision(self.run_id, decision.as_dict(), measured, interference)
        # The epoch clock restarts after the checkpoint: C must not include M.
        self._clock += measured

    def _write_checkpoint(
        self,
        trainer: Trainer,
        epoch: int,
        name: str,
        inner_loop_end: dict | None = None,
        rng: dict | None = None,
        materializer: Materializer | None = None,
    ) -> float:
        """Snapshot the complete training state and hand it to the materializer; main-thread s."""
        start = time.perf_counter()
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint[RNG_KEY] = rng if rng is not None else capture_rng()
        if inner_loop_end is not None:
            checkpoint[INNER_LOOP_END_KEY] = inner_loop_end
        path = self.store.run_dir(self.run_id) / name
        record = checkpoint_recorder(self.store.db_path, self.run_id, epoch, trainer.global_step)
        (materializer or self._materializer).submit(WriteJob(checkpoint, path, record))
        return time.perf_counter() - start

    def _flush_logs(self) -> None:
        self._last_flush = time.perf_counter()
        if self._capture is not None:
            self._capture.flush()

    def _finish(self, status: str) -> None:
        if self.run_id is None or self._materializer is None:
            return
        self._flush_logs()
        self._materializer.close()
        for failure in self._materializer.failures:
            warnings.warn(f"HindsightCallback: {failure}", stacklevel=2)
        self.store.finish_run(self.run_id, status)
        if status == "completed":
            rank_zero_info(
                f"HindsightCallback: recorded {self.store.run_dir(self.run_id)} "
                f"({self.policy.epochs} epochs, {self.policy.checkpoints} checkpoints, "
                f"checkpoint cost {self.policy.overhead:.2%} of compute, "
                f"budget {self.policy.epsilon:.2%})"
            )
        self._materializer = None
