"""The record loop of hindsight logging, shared by the Lightning and Composer adapters.

A :class:`Recorder` owns one record's policy, materializer, store and clocks. An adapter tells it
when training starts, when epochs start and end and when batches end, and hands it a *snapshot*
function that returns the framework's complete checkpoint object; the recorder decides (Flor's
Joint Invariant, corrected by measured background interference), writes and indexes. Nothing
here knows Lightning or Composer: what a checkpoint contains is the adapter's business.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from stalwart.hindsight.interference import InterferenceMeter
from stalwart.hindsight.materializer import (
    Materializer,
    WriteJob,
    make_materializer,
)
from stalwart.hindsight.numerics import NUMERICS_KEY, capture_numerics
from stalwart.hindsight.policy import (
    DEFAULT_EPSILON,
    DEFAULT_RESTORE_RATIO,
    Decision,
    JointInvariantPolicy,
)
from stalwart.hindsight.store import (
    INITIAL_EPOCH,
    HindsightStore,
    checkpoint_recorder,
    format_overhead,
    prepare_directory,
)

#: ``veto(policy_says) -> bool``: an adapter's override of a checkpoint decision.
Veto = Callable[[bool], bool]
#: Logged values are committed to the store at least this often (and at every epoch end).
LOG_FLUSH_SECONDS = 1.0


class Recorder:
    """One run directory's record loop: adaptive checkpoint decisions, writes, and the manifest.

    Args:
        dirpath: the run directory (created if missing; refused if it holds foreign files).
        epsilon: record overhead budget, a fraction in (0, 1).
        materializer: ``"fork"``, ``"inline"`` or a :class:`Materializer`.
        restore_ratio: the policy's restore/materialize cost ratio ``c``.
        name: how warnings name the adapter (e.g. ``"HindsightCallback"``).

    Example::

        recorder = Recorder("runs")
        recorder.begin(hparams={}, fingerprints={}, config={"max_epochs": 3})
        recorder.train_started()
        for epoch in range(3):
            recorder.epoch_started()
            ...  # train, calling recorder.batch_ended() after each batch
            recorder.epoch_ended(epoch, state_bytes=lambda: 4096)
            recorder.materialize_due(lambda: {"model": model.state_dict()}, step=epoch)
        recorder.finish("completed")
    """

    def __init__(
        self,
        dirpath: str | os.PathLike = "runs",
        epsilon: float = DEFAULT_EPSILON,
        materializer: str | Materializer = "fork",
        restore_ratio: float = DEFAULT_RESTORE_RATIO,
        name: str = "Recorder",
    ) -> None:
        # Every argument is checked before anything is created on disk.
        self.policy = JointInvariantPolicy(epsilon=epsilon, restore_ratio=restore_ratio)
        make_materializer(materializer)
        self._materializer_spec = materializer
        self.dirpath = prepare_directory(dirpath)
        self.name = name
        self._store: HindsightStore | None = None
        self.materializer: Materializer | None = None
        #: Commits the adapter's captured log rows; called at least every LOG_FLUSH_SECONDS.
        self.flush_logs: Callable[[], None] = lambda: None
        self.start_fresh()

    def start_fresh(self) -> None:
        """Per-run state: each fit is a new run (a resume then loads the checkpointed state)."""
        self.policy = JointInvariantPolicy(
            self.policy.epsilon, self.policy.restore_ratio, self.policy.aim
        )
        self.run_id: int | None = None
        self.resumed_from: str | None = None
        self.decided_through = -1
        self._cost_estimate: float | None = None
        self._due: tuple[Decision, float] | None = None
        self._interference = InterferenceMeter()
        self._shadowed = False
        self._warmup = True
        self._last_flush = 0.0
        self._clock = 0.0
        self._batches = 0
        self._last_batch_end: float | None = None
        self._bookkeeping = 0.0

    @property
    def store(self) -> HindsightStore:
        if self._store is None:
            self._store = HindsightStore(self.dirpath, create=True)
        return self._store

    @property
    def recording(self) -> bool:
        return self.run_id is not None and self.materializer is not None

    def begin(self, *, hparams: dict, fingerprints: dict, config: dict) -> int:
        """Start a new run in the store; ``config`` is added to the policy's own settings."""
        with self.charged():
            self.start_fresh()
            self.materializer = make_materializer(self._materializer_spec)
            self.run_id = self.store.begin_run(
                hparams=hparams,
                fingerprints=fingerprints,
                config={
                    "epsilon": self.policy.epsilon,
                    "restore_ratio": self.policy.restore_ratio,
                    "aim": self.policy.aim,
                    "materializer": self.materializer.name,
                    # What decides the run's floating-point results: replay restores it.
                    NUMERICS_KEY: capture_numerics(),
                    **config,
                },
            )
        return self.run_id

    def write_initial(self, snapshot: Callable[[], Any], step: int) -> None:
        """Write the state training starts from (a replay from epoch 0 needs no user seeding) in
        the background like every checkpoint; behind it, price one for the first decision."""
        self.charge_fixed(self.write(snapshot, INITIAL_EPOCH, "init.ckpt", step))
        self.materializer.prime(self.store.run_dir(self.run_id))

    def charge_bookkeeping(self, seconds: float) -> None:
        """Charge seconds the adapter spent inside training on recording (log capture, per-batch
        hooks): part of the overhead, not of the epoch's compute time."""
        self._bookkeeping += seconds

    def charge_fixed(self, seconds: float) -> None:
        """Charge seconds the adapter spent recording outside any checkpoint (e.g. its setup)."""
        self.policy.charge_fixed(seconds)

    @contextlib.contextmanager
    def charged(self) -> Iterator[None]:
        """Charge the time the block takes with :meth:`charge_fixed`."""
        started = time.perf_counter()
        yield  # (a block that raises ends the record: nothing to charge)
        self.charge_fixed(time.perf_counter() - started)

    def train_started(self) -> None:
        self._clock = time.perf_counter()
        self._warmup = True

    def epoch_started(self) -> None:
        self._batches = 0
        self._last_batch_end = None
        self._shadowed = self.materializer is not None and self.materializer.busy

    def batch_ended(self) -> None:
        """After each training batch: count it, commit logged values about once a second and
        note whether a background write is in flight. An adapter for which a per-batch call
        costs more than it is worth calls :meth:`training_ended` once an epoch instead.

        A commit per batch costs ~0.1 ms inside training: so about once a second (and at every
        epoch end); a crash loses at most that second of logged values."""
        if self.materializer is None:
            return
        if time.perf_counter() - self._last_flush >= LOG_FLUSH_SECONDS:
            self.flush()
        self.materializer.poll()
        self._shadowed = self._shadowed or self.materializer.busy
        self.training_ended(self._batches + 1)

    def training_ended(self, batches: int) -> None:
        """The epoch's ``batches`` training batches are done (what remains is validation and the
        epoch-end hooks). Instead of :meth:`batch_ended` after each batch: whether a background
        write overlapped the epoch is already known, since writes start only between epochs
        (:meth:`epoch_started` notes one still in flight, :meth:`epoch_ended` one still busy);
        the adapter commits logged values at least every ``LOG_FLUSH_SECONDS`` itself."""
        if self.materializer is None:
            return
        self._batches = batches
        self._last_batch_end = time.perf_counter()

    def epoch_ended(
        self,
        epoch: int,
        state_bytes: Callable[[], int],
        veto: Veto = bool,
        final: bool = False,
    ) -> Decision | None:
        """Account a finished epoch and decide whether to checkpoint it.

        Args:
            epoch: the epoch that just ended (0-based).
            state_bytes: tensor bytes of the state a checkpoint holds (asked only before the
                first checkpoint, to probe what one costs).
            veto: ``veto(policy_says) -> bool``, the adapter's override of the decision.
            final: the run ends after this epoch: not checkpointed unless the veto forces it (a
                replay of it starts from the checkpoint before, and the fit would wait for the
                write: a 100 MB state's, ~2.5% of a 10 s fit).

        Returns the decision (None when the epoch was already decided or nothing is recorded).
        A positive decision is *due*: the adapter calls :meth:`materialize_due` once the epoch
        has fully ended (which still cancels it if the run turns out to end there).
        """
        if not self.recording or epoch <= self.decided_through:
            return None
        ended = time.perf_counter()
        # One commit for everything the epoch end writes (epoch work, logged values, decision).
        with self.store.batch():
            decision = self._account_epoch(epoch, ended, state_bytes, veto, final)
        # This epoch end's own work (those writes, the decision, the first cost probe) is the
        # record's, and the next epoch's clock starts after it.
        self._clock = time.perf_counter()
        self.policy.charge_fixed(self._clock - ended)
        return decision

    def _account_epoch(
        self, epoch: int, ended: float, state_bytes: Callable[[], int], veto: Veto, final: bool
    ) -> Decision:
        """Record the epoch's work and decide.

        The epoch-level time (validation, epoch-end hooks) is what a replay that memoizes the
        epoch still runs; with the batches, what one that re-executes it runs: both for replay's
        cost estimate. What background writes took from this epoch is measured where it lands:
        an epoch during which a writer (child or thread) was busy, against clean epochs. Until
        enough clean epochs exist (e.g. every epoch checkpointed), a writer thread's CPU time
        stands in, charged whole as if training used every core: its serialization holds the
        interpreter lock, but its checksum and writes run beside training on a free core.
        """
        epoch_level = ended - (self._last_batch_end or self._clock)
        self.store.add_epoch_work(self.run_id, epoch, self._batches, epoch_level)
        self.flush()
        self.materializer.poll()
        shadowed = self._shadowed or self.materializer.busy
        epoch_seconds = ended - self._clock
        thread_cpu = self.materializer.take_background_cost()
        if shadowed and thread_cpu > 0 and not self._interference.settled:
            interference, background = 0.0, thread_cpu
        else:
            self._interference.observe(epoch_seconds, shadowed=shadowed, warmup=self._warmup)
            interference = background = self._interference.take()
        self._warmup = False
        self.policy.charge(background)
        bookkeeping, self._bookkeeping = self._bookkeeping, 0.0
        self.policy.charge_fixed(bookkeeping)
        compute = epoch_seconds - max(interference, 0.0) - bookkeeping
        estimate = self._estimate_cost(state_bytes)
        decision = self.policy.decide(compute_time=compute, materialize_cost=estimate, epoch=epoch)
        # Until one clean epoch (no writer alive) has been seen, a checkpoint's true cost cannot
        # be measured: leave the epoch after the first checkpoint free of a new writer.
        measurable = self._interference.baseline is not None or self.policy.checkpoints == 0
        says = decision.checkpoint and measurable and not final
        decision = replace(decision, checkpoint=veto(says))
        self.decided_through = epoch
        if decision.checkpoint:  # accounted in materialize_due, where a stop may still cancel it
            self._due = (decision, background, not says)  # (not says: the adapter forced it)
        else:
            self.store.add_decision(self.run_id, decision.as_dict(), None, background)
        return decision

    def drop_due(self) -> None:
        """Forget a due checkpoint (the epoch did not end cleanly)."""
        self._due = None

    def materialize_due(self, snapshot: Callable[[], Any], step: int, final: bool = False) -> None:
        """Write the checkpoint :meth:`epoch_ended` decided on, if any; ``final``: the run turned
        out to end with this epoch after the decision (e.g. an early stop requested by a later
        epoch-end hook), which cancels it as :meth:`epoch_ended`'s ``final`` would have, unless
        the adapter forced it."""
        due, self._due = self._due, None
        if due is None:
            return
        decision, interference, forced = due
        if final and not forced:
            cancelled = replace(decision, checkpoint=False).as_dict()
            self.store.add_decision(self.run_id, cancelled, None, interference)
            return
        # Accounted before the snapshot, which holds the policy's state for a resume from it.
        self.policy.checkpointed(decision.materialize_cost)
        measured = self.write(snapshot, decision.epoch, f"epoch={decision.epoch:04d}.ckpt", step)
        written = time.perf_counter()
        self.policy.revise_last_cost(decision.materialize_cost, measured)
        self.store.add_decision(self.run_id, decision.as_dict(), measured, interference)
        indexed = time.perf_counter() - written
        self.policy.charge_fixed(indexed)
        # The next epoch's clock must not include M (nor its index row).
        self._clock += measured + indexed

    def write(self, snapshot: Callable[[], Any], epoch: int, name: str, step: int) -> float:
        """Snapshot the state and hand it to the materializer; returns the seconds it cost the
        training thread: the snapshot and the submit (a copy, or a fork). What the background
        write takes from training is charged at the next epoch end (see :meth:`epoch_ended`)."""
        start = time.perf_counter()
        checkpoint = snapshot()
        path = self.store.run_dir(self.run_id) / name
        record = checkpoint_recorder(self.store.db_path, self.run_id, epoch, step)
        prepared = time.perf_counter() - start
        return prepared + self.materializer.submit(WriteJob(checkpoint, path, record))

    def flush(self) -> None:
        self._last_flush = time.perf_counter()
        self.flush_logs()

    def finish(self, status: str) -> str | None:
        """Write what is pending, wait for background writers, close the run with its overhead
        figure. Returns a completed run's one-line summary (None otherwise), for the adapter."""
        if not self.recording:
            return None
        self.policy.charge(self.materializer.take_background_cost())
        # The fit waits for the last writes: the record's; what the writer used is not charged.
        started = time.perf_counter()
        self.flush()
        self.materializer.close()
        self.materializer.take_background_cost()
        self.policy.charge_fixed(time.perf_counter() - started)
        # Final, kept with the run for `stalwart runs`: only its row and the close (~1 ms) follow.
        run_dir, figure = self.store.run_dir(self.run_id), overhead_figure(self.policy)
        self.store.finish_run(self.run_id, status, overhead=figure)
        self.close()
        for failure in self.materializer.failures:
            warnings.warn(f"{self.name}: {failure}", stacklevel=3)
        self.materializer = None
        return summary(self.name, run_dir, figure) if status == "completed" else None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "dirpath": str(self.dirpath),
            "run_id": self.run_id,
            "decided_through": self.decided_through,
            "cost_estimate": self._cost_estimate,
            "policy": self.policy.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the policy of a checkpointed record; the current run notes where from."""
        self.policy.load_state_dict(state_dict["policy"])
        self.decided_through = int(state_dict["decided_through"])
        self._cost_estimate = state_dict["cost_estimate"]
        previous = state_dict["run_id"]
        if previous is not None:
            self.resumed_from = (
                f"{state_dict['dirpath']}#run_{previous:04d}@epoch={self.decided_through}"
            )
            if self.run_id is not None:
                self.store.mark_resumed(self.run_id, self.resumed_from)

    def _estimate_cost(self, state_bytes: Callable[[], int]) -> float:
        """The mean measured cost of this run's checkpoints; before the first, a measured probe.

        Measured cost is main-thread time plus the slowdown background writes caused (see
        :mod:`stalwart.hindsight.interference`). The median of the last few, not the last value
        nor the mean of all: one noisy epoch charged to a checkpoint must not set the price of
        every later one.
        """
        if self.policy.checkpoints:
            return self.policy.typical_cost
        if self._cost_estimate is None:
            run_dir = self.store.run_dir(self.run_id)
            self._cost_estimate = self.materializer.probe_cost(state_bytes(), run_dir)
            self.policy.prior(self._cost_estimate)
        return self._cost_estimate


def overhead_figure(policy: JointInvariantPolicy) -> dict[str, float | int]:
    """The record's overhead figure and its parts, as a run keeps it (:attr:`Run.overhead`).

    The run's own (:meth:`JointInvariantPolicy.own`): a fit resumed from a record checkpoint
    continues its policy's totals, and used to report the parent run's epochs, checkpoints and
    seconds as its own, where its decisions and ``stalwart runs`` counted its own.
    """
    own = policy.own()
    return {
        "overhead": own.overhead,
        "outside_checkpoints": own.fixed / max(own.compute, 1e-12),
        "spent_seconds": own.materialize,
        "fixed_seconds": own.fixed,
        "compute_seconds": own.compute,
        "epochs": own.epochs,
        "checkpoints": own.checkpoints,
        "epsilon": policy.epsilon,
    }


def summary(name: str, run_dir: Path, figure: dict) -> str:
    """The one line a completed record ends with: what it took and what it cost (``figure``:
    :func:`overhead_figure`, the one its run keeps)."""
    return (
        f"{name}: recorded {run_dir} ({figure['epochs']} epochs, {figure['checkpoints']} "
        f"checkpoints, record overhead {format_overhead(figure)}, "
        f"budget {figure['epsilon']:.2%})"
    )
