"""Hindsight logging (Flor) for MosaicML Composer: the ``Hindsight`` algorithm and ``replay``.

Recording is :class:`stalwart.hindsight.recorder.Recorder`, the same loop
:class:`~stalwart.HindsightCallback` runs in Lightning: the Joint Invariant policy, the fork
materializer, the SQLite store. This module only translates Composer events into it. A checkpoint
is Composer's own (``{"state": state.state_dict(), "rng": ...}``, RNG and timestamp included), so
``Trainer(load_path=...)`` resumes from it exactly. Method card: ``hindsight.md`` beside this file.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import io
import logging
import os
import statistics
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import composer
import torch
from composer.callbacks import CheckpointSaver
from composer.core import Algorithm, Callback, Engine, Event, State, Time
from composer.loggers import Logger, LoggerDestination
from composer.trainer import Trainer
from composer.utils import reproducibility
from torch.utils.data import DataLoader

from stalwart.errors import ConfigurationError, ReplayError, StalwartError
from stalwart.hindsight import replay as core
from stalwart.hindsight.checkpoint_file import verify_checkpoint
from stalwart.hindsight.estimate import ReplayEstimate
from stalwart.hindsight.fingerprint import hook_fingerprints
from stalwart.hindsight.materializer import Materializer, tensor_bytes
from stalwart.hindsight.persistent_workers import (
    persistent_workers_cause,
    persistent_workers_warning,
)
from stalwart.hindsight.plan import INNER, Segment
from stalwart.hindsight.policy import DEFAULT_EPSILON, DEFAULT_RESTORE_RATIO
from stalwart.hindsight.recorder import Recorder
from stalwart.hindsight.replay import ReplayResult
from stalwart.hindsight.store import CheckpointEntry, HindsightStore
from stalwart.hindsight.writeback import (
    LOGGERS_KEY,
    mlflow_target,
    tensorboard_target,
    unsupported_target,
)

log = logging.getLogger(__name__)

#: Set while ``replay`` builds and runs trainers: a ``Hindsight`` made then records nothing.
_REPLAYING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "stalwart_replaying", default=False
)


class StoreDestination(LoggerDestination):
    """A Composer logger destination that writes every ``log_metrics`` value to the store.

    Rows are tagged with the training epoch they belong to (values logged by epoch-end evaluation
    belong to the epoch that just ended, although Composer's timestamp has moved on) and buffered
    until :meth:`flush`.

    Args:
        store: where rows go.
        run_id: the run they belong to.
        source: ``"record"`` or ``"replay"``.
        replay_id: tags replayed rows.
        keep: which epochs' values to keep.
    """

    def __init__(
        self,
        source: str,
        replay_id: str | None = None,
        keep: Callable[[int], bool] = lambda epoch: True,
    ) -> None:
        self.store: HindsightStore | None = None
        self.run_id: int | None = None
        self.source = source
        self.replay_id = replay_id
        self.keep = keep
        #: The epoch being trained; set at EPOCH_START by the algorithm that owns the destination.
        self.epoch = 0
        # The event running now and the timestamp at its start (Composer replaces the timestamp
        # rather than changing it): what a logged value's hook and step are read from.
        self._event: Event | None = None
        self._timestamp: Any = None
        #: Between an epoch's checkpoint event and the next epoch (or the end of the fit).
        self.between_epochs = False
        #: Called when the Trainer shuts down (normally, on an error, or at interpreter exit).
        self.on_close: Callable[[], None] = lambda: None
        #: Seconds spent inside ``log_metrics`` since the owner last took them (the record
        #: charges them to its overhead).
        self.spent = 0.0
        self._pending: list[tuple] = []

    def open(self, store: HindsightStore, run_id: int) -> None:
        self.store = store
        self.run_id = run_id

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        # The destination is also the *last* callback, so this runs after every other callback
        # has handled the epoch's checkpoint event: what is logged from here until the next
        # epoch (Composer's end-of-fit counters) belongs to no trained epoch of this fit.
        if event is Event.EPOCH_CHECKPOINT:
            self.between_epochs = True

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        started = time.perf_counter()
        epoch = self.epoch + 1 if self.between_epochs else self.epoch
        if self.run_id is None or not self.keep(epoch):
            return
        if step is None:
            step = 0 if self._timestamp is None else int(self._timestamp.batch)
        hook = None if self._event is None else self._event.value
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.detach()
            elif not isinstance(value, (int, float)):
                continue  # images, tables, histograms: not a series of numbers
            self._pending.append(
                (self.run_id, epoch, step, name, value, hook, self.source, self.replay_id)
            )
        self.spent += time.perf_counter() - started

    def flush(self) -> None:
        if not self._pending or self.store is None:
            return
        rows = [(*row[:4], float(row[4]), *row[5:]) for row in self._pending]
        self._pending.clear()
        self.store.add_metrics(rows)

    def close(self, state: State, logger: Logger) -> None:
        self.on_close()

    def track(self, event: Event, state: State) -> None:
        """Follow the loop: which epoch and event logged values belong to. Called at every
        event, so it only keeps references; a logged value reads its step from them."""
        self._event = event
        self._timestamp = state.timestamp
        if event is Event.EPOCH_START:
            self.epoch = int(state.timestamp.epoch)
            self.between_epochs = False


def describe_destinations(callbacks: Iterable[Any]) -> list[dict[str, Any]]:
    """Where each of a run's logger destinations keeps its values (for a replay's write-back).

    Destinations that keep nothing on disk (console, progress bar, in memory) are left out.
    """
    from composer.loggers import (
        ConsoleLogger,
        InMemoryLogger,
        MLFlowLogger,
        ProgressBarLogger,
        TensorboardLogger,
    )

    described = []
    for destination in callbacks:
        if not isinstance(destination, LoggerDestination) or isinstance(
            destination, (StoreDestination, ConsoleLogger, ProgressBarLogger, InMemoryLogger)
        ):
            continue
        if isinstance(destination, TensorboardLogger) and destination.writer is not None:
            described.append(tensorboard_target(destination.writer.log_dir))
        elif isinstance(destination, MLFlowLogger) and destination._run_id is not None:
            described.append(mlflow_target(destination.tracking_uri, destination._run_id))
        else:
            described.append(unsupported_target(destination))
    return described


def _attach(state: State, logger: Logger, destination: StoreDestination) -> None:
    """Receive every logged value, and every event after all other callbacks."""
    if destination not in logger.destinations:
        logger.destinations = (*logger.destinations, destination)
    if destination not in state.callbacks:
        state.callbacks.append(destination)


def _state_bytes(state: State) -> int:
    """Tensor bytes of what a checkpoint holds (the policy's first cost probe sizes it)."""
    return tensor_bytes(state.model.state_dict()) + tensor_bytes(
        [optimizer.state_dict() for optimizer in state.optimizers]
    )


def composer_checkpoint(state: State) -> dict:
    """The object Composer's own checkpointing saves, so ``load_path`` reads it as its own."""
    return {"state": state.state_dict(), "rng": reproducibility.get_rng_state()}


#: The events ``Hindsight.apply`` handles. A set: ``match`` runs at every event, and Composer's
#: ``Event.__eq__`` (a string comparison) made a tuple's ``in`` cost ~3.6 us an event.
_APPLIED_AT = frozenset(
    {Event.INIT, Event.FIT_START, Event.EPOCH_START, Event.EPOCH_CHECKPOINT, Event.FIT_END}
)


def persistent_loaders(state: State) -> list[str]:
    """Which of a Trainer's DataLoaders (``"training"``, ``"evaluation"``) keep their worker
    processes from epoch to epoch (``persistent_workers=True``)."""
    loaders = [("training", state.train_dataloader)] + [
        ("evaluation", getattr(evaluator.dataloader, "dataloader", None))
        for evaluator in state.evaluators or []
    ]
    persistent = {
        kind: None
        for kind, loader in loaders
        if isinstance(loader, DataLoader) and loader.persistent_workers and loader.num_workers
    }
    return list(persistent)  # each kind once, training first


def warn_persistent_workers(state: State, name: str) -> None:
    """Warn, once a fit, where a training or evaluation DataLoader keeps its workers (the
    Composer side of :func:`stalwart.callbacks.hindsight.warn_persistent_workers`).

    Persistent workers are seeded once, when their loader is first iterated, and their random
    state then runs on from epoch to epoch inside the worker processes, where no checkpoint can
    hold it: a fit resumed from an epoch checkpoint draws other data than the record did.
    """
    persistent = persistent_loaders(state)
    if persistent:
        warnings.warn(persistent_workers_warning(name, persistent), stacklevel=2)


class CallbackDispatch:
    """What Composer's engine spends handing each event to one callback, measured in place.

    Composer calls every callback at every event (~13 a training batch) through the loop body of
    ``Engine._run_callbacks``: a debug-log line built whether or not debug logging is on, the
    profiler check, the call. Timed warm in a tight loop it costs ~5 us; inside a training loop,
    where the model's work has the CPU's caches, ~10 us (measured: one no-op callback added
    0.15 s to a 2.8 s Composer fit of 14,040 events). So it is sampled where it runs: every
    ``every``-th event (a prime, so that the samples go round every kind of event) one extra
    pass of that loop body, on ``callback`` and an event it ignores, is timed, and the mean of
    the samples is the cost of an event. Until the first sample, a warm measurement stands in.
    The sampling runs without Composer's profiler, so nothing lands in the user's trace (with
    Composer's debug logging on, each sample, and the 50 warm passes, add a "Running callback"
    line). ``tests/algorithms/test_composer_internals.py`` fails, naming it, if the engine's
    methods used here change.

    Args:
        state: the Trainer's state (its timestamp, as the debug-log line reads it).
        logger: the Trainer's logger.
        callback: the callback whose dispatch is measured; it must ignore ``BATCH_START``.
        every: events between samples.
    """

    def __init__(self, state: State, logger: Logger, callback: Callback, every: int = 97) -> None:
        self.every = every
        self.callback = callback
        self._engine = SimpleNamespace(
            state=SimpleNamespace(profiler=None, timestamp=state.timestamp), logger=logger
        )
        self._engine._debug_log = functools.partial(Engine._debug_log, self._engine)
        self._state = state
        self._events = 0
        self._sampled, self._samples = 0.0, 0
        #: The cost per event: the warm median until the first sample, then the samples' mean.
        self.per_event = statistics.median([self._time_one() for _ in range(50)])

    def _time_one(self) -> float:
        self._engine.state.timestamp = self._state.timestamp
        start = time.perf_counter()
        Engine._run_callbacks(self._engine, Event.BATCH_START, [self.callback])
        return time.perf_counter() - start

    def event(self) -> float:
        """Count one event (sampling it when due); returns the cost per event."""
        self._events += 1
        if self._events % self.every == 0:
            self._sampled += self._time_one()
            self._samples += 1
            self.per_event = self._sampled / self._samples
        return self.per_event


class Hindsight(Algorithm):
    """Record a Composer run for hindsight logging: every logged value, plus adaptive checkpoints.

    At each epoch checkpoint event the algorithm measures the epoch's compute time and asks Flor's
    Joint Invariant whether a checkpoint keeps the record overhead under ``epsilon``; the state
    (Composer's full checkpoint: model, optimizers, schedulers, timestamp, RNG) is written in the
    background (on CPU a copy handed to a writer thread). Every ``logger.log_metrics`` value
    goes to ``dirpath/hindsight.db``. Later, :func:`replay` runs new probes (Composer callbacks)
    over the recorded epochs.

    Args:
        dirpath: the run directory (created if missing). Each ``fit`` adds a run to it.
        epsilon: record overhead budget, a fraction in (0, 1); default 1/15 (6.67%).
        materializer: ``"fork"`` (background writes, default) or ``"inline"``.
        restore_ratio: expected restore/materialize cost ratio ``c`` of the policy.

    Example::

        from composer import Trainer
        import stalwart
        from stalwart.algorithms import Hindsight

        trainer = Trainer(model=model, train_dataloader=train, max_duration="10ep",
                          algorithms=[Hindsight(dirpath="runs")])
        trainer.fit()
        stalwart.hindsight.open("runs").run().metrics("loss/train/total")
    """

    def __init__(
        self,
        dirpath: str | os.PathLike = "runs",
        epsilon: float = DEFAULT_EPSILON,
        materializer: str | Materializer = "fork",
        restore_ratio: float = DEFAULT_RESTORE_RATIO,
    ) -> None:
        self.recorder = Recorder(dirpath, epsilon, materializer, restore_ratio, "Hindsight")
        #: Whether the Trainer this instance joined records; a Trainer built by ``replay`` does
        #: not (the instance then only tells replay where the record is).
        self.passive = False
        self._destination = StoreDestination("record")
        # A fit that raised never reaches FIT_END: its run is closed as failed, with every
        # pending checkpoint written, when Composer shuts the Trainer down.
        self._destination.on_close = lambda: self._finish("failed")
        self._loaded: dict | None = None
        self._first_epoch = True
        #: The State of the Trainer whose fit this instance last recorded: a fit that finds the
        #: same State continues that Trainer (a second ``fit()``), not a resume from a file.
        self._fitted: weakref.ref[State] | None = None
        self._continued = False
        #: Between an EPOCH_START and its EPOCH_CHECKPOINT: at FIT_END, the fit stopped inside.
        self._in_epoch = False
        #: Composer's cost of handing each event to the destination (from FIT_START).
        self._dispatch: CallbackDispatch | None = None

    @property
    def dirpath(self):
        return self.recorder.dirpath

    def __repr__(self) -> str:
        return f"Hindsight(dirpath={str(self.dirpath)!r}, epsilon={self.recorder.policy.epsilon})"

    def match(self, event: Event, state: State) -> bool:
        if event is Event.INIT:  # decided per Trainer: one instance may serve record and replay
            self.passive = _REPLAYING.get()
        if self.passive:
            return False
        started = time.perf_counter()
        destination = self._destination
        destination.track(event, state)
        dispatch = 0.0 if self._dispatch is None else self._dispatch.event()
        if event is Event.BATCH_END:
            # Here, not in apply: Composer's way to an algorithm's apply (its trace, a debug-log
            # line, the trace logged to every destination) cost ~50 us a batch, more than this.
            self.recorder.batch_ended()
            applies = False
        else:
            applies = event in _APPLIED_AT
        # Every event also reaches the destination through Composer's callback loop: all of it
        # is the record's, charged as it happens (the epoch's compute excludes it).
        spent, destination.spent = destination.spent, 0.0
        self.recorder.charge_bookkeeping(time.perf_counter() - started + spent + dispatch)
        return applies

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        recorder = self.recorder
        if event == Event.INIT:
            _attach(state, logger, self._destination)
        elif event == Event.FIT_START:
            self._begin(state, logger)
            warn_persistent_workers(state, self.recorder.name)
        elif event == Event.EPOCH_START:  # (match has tracked it)
            if self._first_epoch:
                self._first_epoch = False
                if int(state.timestamp.batch) == 0 or self._continued:
                    # Taken here, not at FIT_START: Composer spins the dataloaders in between
                    # (drawing from the RNG), and a resume restores the RNG after spinning. A
                    # fit continued on the same Trainer starts from its state there (its step
                    # and epoch are in the checkpoint's timestamp); one resumed from a file
                    # replays its first epochs from that file.
                    step = int(state.timestamp.batch)
                    recorder.write_initial(lambda: composer_checkpoint(state), step)
                recorder.train_started()
            recorder.epoch_started()
            self._in_epoch = True
        elif event == Event.EPOCH_CHECKPOINT:
            self._in_epoch = False
            step = int(state.timestamp.batch)
            recorder.epoch_ended(
                int(state.timestamp.epoch) - 1,
                state_bytes=lambda: _state_bytes(state),
                veto=lambda policy_says: self.should_checkpoint(state, policy_says),
                final=_ends_after_this_epoch(state),
            )
            recorder.materialize_due(lambda: composer_checkpoint(state), step)
        elif event == Event.FIT_END:
            if self._in_epoch:
                self._end_stopped_epoch(state)
            self._finish("completed")

    def _end_stopped_epoch(self, state: State) -> None:
        """Account the epoch the fit stopped in, as Lightning's epoch end does when
        ``max_steps`` cuts one short.

        A fit whose ``max_duration`` is in batches, samples or tokens (or that
        ``state.stop_training()`` stops) ends inside an epoch, and Composer fires none of that
        epoch's end events. Its batches ran and their values are recorded, so it is an epoch of
        the record: its decision and batch count tell a replay that it exists and where the fit
        stopped in it. Never checkpointed, whatever ``should_checkpoint`` says: its state is
        not an epoch's end, and no replay starts after the fit's last epoch.
        """
        self.recorder.epoch_ended(
            int(state.timestamp.epoch),
            state_bytes=lambda: _state_bytes(state),
            veto=lambda policy_says: False,
            final=True,
        )

    def _finish(self, status: str) -> None:
        summary = self.recorder.finish(status)
        if summary is not None:
            log.info(summary)
        self.recorder.close()

    def should_checkpoint(self, state: State, policy_says: bool) -> bool:
        """Override to force or veto checkpoints; by default the policy decides."""
        return policy_says

    def _begin(self, state: State, logger: Logger) -> None:
        started = time.perf_counter()
        model = state.model
        fingerprints = {"module": hook_fingerprints(model), "datamodule": {}}
        fingerprinting = time.perf_counter() - started
        run_id = self.recorder.begin(
            hparams=dict(getattr(model, "hparams", {}) or {}),
            fingerprints=fingerprints,
            config={
                "framework": "composer",
                "max_duration": str(state.max_duration),
                # Composer's name for the run: replay(run=...) accepts it too.
                "run_name": state.run_name,
                "module_class": f"{type(model).__module__}.{type(model).__qualname__}",
                "composer": composer.__version__,
                "torch": torch.__version__,
                # Where the user's loggers keep their values: a replay writes there too.
                LOGGERS_KEY: describe_destinations(state.callbacks),
            },
        )
        # What recording adds before training is part of its cost (begin charges its own).
        self.recorder.charge_fixed(fingerprinting)
        with self.recorder.charged():
            self._dispatch = CallbackDispatch(state, logger, self._destination)
        self._destination.open(self.recorder.store, run_id)
        self.recorder.flush_logs = self._destination.flush
        if self._loaded is not None:
            self.recorder.load_state_dict(self._loaded)
            self._loaded = None
        self._first_epoch = True
        self._in_epoch = False
        self._continued = self._fitted is not None and self._fitted() is state
        self._fitted = weakref.ref(state)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "recorder": self.recorder.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Loading happens while the Trainer is built, before FIT_START begins the new run.
        self._loaded = state.get("recorder")


_REPLAY_APPLIED_AT = frozenset({Event.BATCH_START, Event.BATCH_END, Event.EPOCH_CHECKPOINT})


class _ReplayDriver(Algorithm):
    """Runs inside one replay segment's Trainer: tags and stores what the probes log."""

    def __init__(
        self,
        segment: Segment,
        store_dir: str,
        run_id: int,
        replay_id: str,
        index: int,
        ends_fit: bool = False,
    ) -> None:
        self.segment = segment
        self.index = index
        self.replay_id = replay_id
        self.run_id = run_id
        self.store = HindsightStore(store_dir, create=True)
        # What the segment that runs the record's last epoch logs after that epoch's checkpoint
        # event (a probe's fit_end, Composer's final counters) is the end of the recorded fit,
        # which the record tagged as the epoch after its last one, as the destination does here.
        kept = segment.requested | ({segment.last_epoch + 1} if ends_fit else set())
        self.destination = StoreDestination("replay", replay_id, keep=kept.__contains__)
        self.destination.open(self.store, run_id)
        self.batch_epochs: list[int] = []
        self._started = time.perf_counter()

    def match(self, event: Event, state: State) -> bool:
        self.destination.track(event, state)
        return event in _REPLAY_APPLIED_AT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.BATCH_START:
            self.batch_epochs.append(self.destination.epoch)
        else:
            self.destination.flush()

    def finish(self) -> None:
        self.destination.flush()
        self.store.add_replay_work(
            self.replay_id, self.run_id, self.index, self.segment.resume_from,
            self.segment.last_epoch, self.batch_epochs, time.perf_counter() - self._started,
        )  # fmt: skip
        self.store.close()


def building_a_replay() -> bool:
    """Whether the Trainer being built now is one of a hindsight replay's (which writes no
    checkpoint: other algorithms, such as ``Shrink``, stand aside in it)."""
    return _REPLAYING.get()


@contextlib.contextmanager
def _replaying() -> Iterator[None]:
    token = _REPLAYING.set(True)
    try:
        yield
    finally:
        _REPLAYING.reset(token)


def _probes(probe: Any) -> list[Callback]:
    if probe is None:
        return []
    probes = [probe] if not isinstance(probe, Iterable) else list(probe)
    for p in probes:
        if not isinstance(p, Callback):
            raise ConfigurationError(
                f"probe {p!r} is not a Composer Callback: pass a composer.Callback whose event "
                "methods call logger.log_metrics({...})."
            )
    return probes


def _recorded_model_state(entry: CheckpointEntry) -> dict:
    # Composer's checkpoints hold NumPy RNG state, which torch's weights-only loader refuses; the
    # bytes are checked against the recorded CRC-32 first, so only our own file is unpickled.
    data = verify_checkpoint(entry.path, entry.nbytes, entry.crc32)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)["state"]["model"]


def _reference(
    trainer_factory: Callable[..., Trainer], dirpath: str | os.PathLike | None
) -> tuple[dict, str, str | os.PathLike, Callable[[], str | None]]:
    """The factory's model (state and class), the record's directory (default: its
    ``Hindsight``'s) and the replay's ``explain`` (what its DataLoaders tell of why replayed
    values differ), from a Trainer built and closed without training."""
    with _replaying():
        # A replay writes no checkpoint, and resumes from the record's file, not from the newest
        # in a save folder: autoresume (which needs a save folder) is off too.
        reference = trainer_factory(save_folder=None, autoresume=False, loggers=[])
    if _drop_checkpoint_savers(reference.state):
        log.info(
            "replay: the factory's CheckpointSaver callbacks are not run in the replay's "
            "Trainers (a replay writes no checkpoint; the run's own files stay as they are)."
        )
    model = reference.state.model
    model_class = f"{type(model).__module__}.{type(model).__qualname__}"
    if dirpath is None:
        hindsight = next((a for a in reference.state.algorithms if isinstance(a, Hindsight)), None)
        if hindsight is None:
            raise ConfigurationError(
                "replay needs to know where the record is: build the Trainer with "
                "algorithms=[Hindsight(dirpath=...)], or pass replay(..., dirpath=...)."
            )
        dirpath = hindsight.dirpath
    model_state = model.state_dict()
    explain = functools.partial(persistent_workers_cause, persistent_loaders(reference.state))
    reference.close()
    return model_state, model_class, dirpath, explain


def replay(
    trainer_factory: Callable[..., Trainer],
    *,
    probe: Callback | Iterable[Callback] | None = None,
    run: int | str | None = None,
    epochs: int | Iterable[int] | None = None,
    workers: int = 1,
    init: str = "weak",
    dirpath: str | os.PathLike | None = None,
    dry_run: bool = False,
    loggers: str | None = "original",
) -> ReplayResult | ReplayEstimate:
    """Replay epochs of a recorded Composer run with new probes, from its checkpoints.

    The same arguments, and the same result, as :meth:`stalwart.Trainer.replay` (Lightning),
    with a factory for the run's Trainer in place of the module and data.

    Composer cannot skip an epoch, so each segment of the plan resumes from a checkpoint
    (``load_path``), re-executes every epoch after it and stops after its last epoch (its
    Trainer keeps the record's ``max_duration``, which schedules over the run read, and is
    stopped there); segments run in parallel worker processes. The factory's
    ``CheckpointSaver`` callbacks are not run. Values the probes log go to
    the store as ``source="replay"``, and every value the record logged is compared with the
    replayed one (the deferred check).

    Args:
        trainer_factory: builds the run's ``composer.Trainer``, as for recording, applying the
            keyword arguments it is called with last (``load_path``, ``max_duration``,
            ``save_folder``, ``autoresume`` and ``loggers``), e.g.
            ``lambda **kw: Trainer(**{**run_args, **kw})``.
        probe: a Composer ``Callback`` (or several) logging with ``logger.log_metrics``.
        run: run id or name in the record (``"run_0003"``, or the Composer ``run_name`` it
            was recorded under: the latest run of that name); default: the latest.
        epochs: which recorded epochs to replay (one epoch number, or several); default: all.
        workers: parallel worker processes, each replaying a contiguous segment.
        init: ``"weak"`` (each segment resumes from the checkpoint nearest before it) or
            ``"strong"`` (every segment starts from the earliest checkpoint and re-executes its
            way forward, rebuilding state the checkpoints did not capture).
        dirpath: the record's directory; default: that of the factory's ``Hindsight``.
        dry_run: log the plan (segments, checkpoints, batches, estimated seconds from the
            record's timings) and return it as a ``ReplayEstimate``; run and write nothing.
        loggers: ``"original"`` also writes the replay's new series, as ``replay/<name>`` at
            the record's batch steps, to the TensorBoard and MLflow destinations the recorded
            run logged to; ``None`` writes only to the store. The segments' own trainers log
            to no destination of the factory's.

    Returns:
        A :class:`ReplayResult` (``result.summary()`` puts the time next to the estimate), or
        with ``dry_run`` the :class:`ReplayEstimate`.

    Example::

        def make_trainer(**overrides):
            return Trainer(**{**run_args, "algorithms": [Hindsight("runs")], **overrides})

        make_trainer().fit()  # record
        result = replay(make_trainer, probe=WeightNormProbe(), epochs=range(3, 6), workers=2)
        result.metrics("probe/weight_norm")
    """
    probes = _probes(probe)
    model_state, model_class, dirpath, explain = _reference(trainer_factory, dirpath)
    setup = core.prepare(dirpath, _run_named(dirpath, run), epochs, workers, dry_run=dry_run)
    targets = core.logger_targets(setup.run, loggers)
    entries = setup.entries
    recorded_run = setup.run
    if recorded_run.config.get("framework") != "composer":
        raise ReplayError(
            f"{recorded_run.name} in {setup.store.root} was not recorded by Composer's Hindsight "
            "algorithm; replay it with stalwart.Trainer.replay (Lightning)."
        )
    core.check_same_model(
        recorded_run, _recorded_model_state(entries[min(entries)]), model_state, model_class
    )
    # Every replayed epoch re-executes its batches: Composer has no way to skip one, so no
    # epoch counts as memoized (the estimate then charges them too).
    segments = [
        dataclasses.replace(segment, memoized=frozenset())
        for segment in core.plan(setup, INNER, workers, init)
    ]
    # Read here: a worker must not use the store.
    length = _SegmentLength.of(setup, _segment_ends(setup, segments))
    replay_segment = functools.partial(_replay_segment, trainer_factory, probes, setup, length)
    outcome = core.run_segments(
        setup, INNER, segments, replay_segment, dry_run=dry_run, targets=targets, explain=explain
    )
    log.info("%s", outcome if dry_run else outcome.summary())
    return outcome


def _run_named(dirpath: str | os.PathLike, run: int | str | None) -> int | str | None:
    """``run=`` as the store names runs: a Composer ``run_name`` (``Trainer(run_name=...)``,
    kept in the record's config) becomes the latest recorded run of that name; anything else,
    such as ``"run_0003"`` or a name no run has, is left for the store to resolve or refuse."""
    if not isinstance(run, str):
        return run
    try:
        store = HindsightStore(dirpath)
    except StalwartError:
        return run  # no readable record there: the store says so when the replay opens it
    try:
        runs = store.runs()
        if any(r.name == run for r in runs):
            return run
        named = [r.run_id for r in runs if r.config.get("run_name") == run]
    finally:
        store.close()
    return named[-1] if named else run


@dataclasses.dataclass(frozen=True)
class _SegmentEnd:
    """Where a replay segment stops: after epoch ``last_epoch``, or at global step ``stop``
    (the recorded fit's own stop, possibly inside that epoch); ``ends_fit``: the segment runs
    the record's last epoch, so the recorded fit ended where it stops."""

    last_epoch: int
    stop: int | None
    ends_fit: bool


def _segment_ends(setup: core.ReplaySetup, segments: list[Segment]) -> list[_SegmentEnd]:
    # A fit that failed (or was still running) ended nowhere: no segment ends where it did.
    ended = setup.run.status == "completed"
    last = setup.recorded[-1] if setup.recorded and ended else None
    return [
        _SegmentEnd(segment.last_epoch, setup.stop_step(segment), segment.last_epoch == last)
        for segment in segments
    ]


class _StopAtSegmentEnd(Callback):
    """Stops a replay segment's fit at its end, in a Trainer that has the record's run length.

    The Trainer keeps the recorded ``max_duration``, so that everything reading the run's
    length (a scheduler's ``t_max="1dur"``, ``state.get_elapsed_duration()``) sees the
    recorded fit's; this callback, the Trainer's last, calls ``state.stop_training()`` once
    every other callback has handled the segment's last epoch end (or its stop batch, when the
    record stopped inside an epoch and the run length alone does not stop it there).
    """

    def __init__(self, end: _SegmentEnd) -> None:
        self.end = end

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        stop = self.end.stop
        if stop is None or int(state.timestamp.batch) < stop:
            return
        # A stop at an epoch's last batch waits for that epoch's end events.
        length = state.dataloader_len
        if length is None or int(state.timestamp.batch_in_epoch) < int(length):
            self._stop(state)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.epoch) > self.end.last_epoch:  # (already the next epoch's)
            self._stop(state)

    def _stop(self, state: State) -> None:
        if state.max_duration is None or state.timestamp < state.max_duration:
            state.stop_training()


@dataclasses.dataclass(frozen=True)
class _SegmentLength:
    """The ``max_duration`` a replay segment's Trainer runs with, and what stops it.

    A record keeps its ``max_duration``: every segment runs with it and
    :class:`_StopAtSegmentEnd` stops it. A record made before that was kept has only its
    epochs' ends: each segment then runs to its own end (``"<last + 1>ep"``, or the recorded
    stop ``"<step>ba"``), and what reads the run's length sees a shorter run than recorded.
    """

    recorded: str | None
    ends: list[_SegmentEnd]

    @classmethod
    def of(cls, setup: core.ReplaySetup, ends: list[_SegmentEnd]) -> _SegmentLength:
        recorded = setup.run.config.get("max_duration")
        if recorded is None:
            warnings.warn(
                f"{setup.run.name} was recorded before Hindsight kept the run's max_duration: "
                "each replay segment runs as if the fit ended with it, so schedules and "
                "algorithms that depend on the run's length (t_max='1dur', "
                "get_elapsed_duration()) may replay other values; re-record to replay exactly.",
                stacklevel=3,
            )
        return cls(recorded, ends)

    def max_duration(self, index: int) -> str:
        if self.recorded is not None:
            return self.recorded
        end = self.ends[index]
        return f"{end.last_epoch + 1}ep" if end.stop is None else f"{end.stop}ba"

    def apply(self, state: State, index: int) -> None:
        """Set the run length on a built Trainer and add the stop (as its last callback)."""
        if self.recorded is None:
            return
        # Set here as well as passed to the factory: Composer scales a max_duration passed to
        # the Trainer by its scale_schedule_ratio, and the recorded one is already scaled.
        state.max_duration = Time.from_timestring(self.recorded)
        state.callbacks.append(_StopAtSegmentEnd(self.ends[index]))


def _drop_checkpoint_savers(state: State) -> bool:
    """Take the Trainer's ``CheckpointSaver`` callbacks out (whether it had any): a replay
    writes no checkpoint, and one would overwrite the run's own files (its ``latest``
    included, from which autoresume would restart a finished run)."""
    savers = [c for c in state.callbacks if isinstance(c, CheckpointSaver)]
    state.callbacks[:] = [c for c in state.callbacks if not isinstance(c, CheckpointSaver)]
    return bool(savers)


def _replay_segment(
    trainer_factory: Callable[..., Trainer],
    probes: list[Callback],
    setup: core.ReplaySetup,
    length: _SegmentLength,
    index: int,
    segment: Segment,
    replay_id: str,
) -> None:
    """Run one segment of a replay (in this process or a forked worker)."""
    driver = _ReplayDriver(
        segment, str(setup.store.root), setup.run.run_id, replay_id, index,
        ends_fit=length.ends[index].ends_fit,
    )  # fmt: skip
    with _replaying():
        trainer = trainer_factory(
            load_path=str(setup.entries[segment.resume_from].path),
            max_duration=length.max_duration(index),
            save_folder=None,
            autoresume=False,
            loggers=[],  # the replayed values reach the user's loggers once, afterwards
        )
    _drop_checkpoint_savers(trainer.state)
    trainer.state.algorithms.append(driver)
    trainer.state.callbacks.extend(probes)
    _attach(trainer.state, trainer.logger, driver.destination)
    length.apply(trainer.state, index)
    restore = _nothing if length.ends[index].ends_fit else _skip_fit_end(trainer.engine)
    try:
        trainer.fit()
    finally:
        restore()
        driver.finish()
        trainer.close()


def _skip_fit_end(engine: Engine) -> Callable[[], None]:
    """Keep ``engine`` from handing ``Event.FIT_END`` to the Trainer's algorithms and callbacks
    (probes included); returns what puts it back.

    For a segment that stops before the record's end: the recorded fit went on there, so a
    probe's ``fit_end`` (or an algorithm matching ``FIT_END``, an ``ExportForInferenceCallback``)
    would see, at every segment's end, a fit end the record never had. The segment that ends
    where the recorded fit did keeps it, and runs it once. ``close`` and ``post_close``, which
    release what callbacks hold, still run in every segment's ``trainer.close()``. Shadowed on
    the instance, as the Trainer calls ``self.engine.run_event(Event.FIT_END)``.
    """
    run_event = engine.run_event

    def run_event_but_fit_end(event: Event | str, *args: Any, **kwargs: Any) -> Any:
        if event == Event.FIT_END:
            return {}  # the traces of no algorithm
        return run_event(event, *args, **kwargs)

    engine.run_event = run_event_but_fit_end  # type: ignore[method-assign]
    return lambda: vars(engine).pop("run_event", None)


def _nothing() -> None:
    pass


def _ends_after_this_epoch(state: State) -> bool:
    """Whether training stops at the epoch end Composer is at (``max_duration`` reached)."""
    elapsed = state.get_elapsed_duration()
    return elapsed is not None and elapsed.value >= 1
