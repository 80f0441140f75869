"""stalwart.Trainer: Lightning's Trainer plus ``replay`` (hindsight logging, Flor §2.2)."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import lightning as L
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import (
    Callback,
    Checkpoint,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    Timer,
)
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.compile import to_uncompiled
from lightning_utilities.core.apply_func import apply_to_collection
from torch._dynamo import OptimizedModule
from torch.utils.data import DataLoader

from stalwart.callbacks.hindsight import HindsightCallback
from stalwart.callbacks.lightning_internals import (
    detached_copy,
    fit_ends_after_this_epoch,
    hook_epoch_boundary,
    skip_fit_end_hooks,
    unhook_epoch_boundary,
    writing_no_files,
)
from stalwart.callbacks.replay import BATCH_LEVEL_HOOKS, FunctionProbe, ReplayDriver, probe_level
from stalwart.callbacks.replay_loggers import lightning_points, write_to_loggers
from stalwart.errors import ConfigurationError, ReplayError
from stalwart.hindsight import replay as core
from stalwart.hindsight.checkpoint_file import verify_checkpoint
from stalwart.hindsight.estimate import ReplayEstimate
from stalwart.hindsight.persistent_workers import persistent_workers_cause
from stalwart.hindsight.plan import Segment
from stalwart.hindsight.replay import Mismatch, ReplayResult
from stalwart.hindsight.store import RESUMED_FILE_KEY, CheckpointEntry
from stalwart.plugins.shrink_io import ShrinkCheckpointIO
from stalwart.shrink.container import is_shrunk_file

#: Whether ``replay`` logs its plan (dry run) or summary; the CLI prints them itself.
_ANNOUNCE: ContextVar[bool] = ContextVar("stalwart_replay_announce", default=True)


class Trainer(L.Trainer):
    """A Lightning ``Trainer`` that can also replay a recorded run with new probes.

    Everything Lightning's Trainer does is unchanged; :meth:`replay` is added.

    Example::

        trainer = stalwart.Trainer(max_epochs=20, callbacks=[stalwart.HindsightCallback("runs")])
        trainer.fit(model, datamodule)
        # later, with a question in mind:
        result = trainer.replay(model, datamodule, probe=GradNormProbe(), workers=2)
        result.metrics("grad_norm")
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A replay's fit talks to loggers where this one does (LearningRateMonitor refuses to
        # run without one), into one that keeps nothing (see _ReplayLogger): the replayed values
        # reach the store, and from it the loggers ``replay(loggers=...)`` names. The callbacks
        # are taken from ``self.callbacks`` when first needed (see fit and replay).
        replay_kwargs = {key: value for key, value in kwargs.items() if key != "callbacks"}
        replay_kwargs["logger"] = bool(self.loggers)
        self._init_args = (args, replay_kwargs)
        self._replay_callbacks: _ReplayCallbacks | None = None

    def fit(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``fit``; a Trainer that records takes the copies of its callbacks that
        its replays start from first, while no fit has used them (a fit leaves its state in
        every instance: SWA's averaged model, a progress bar's reference to this Trainer). The
        first fit's copies are kept: a second fit's callbacks are used ones."""
        recording = any(isinstance(c, HindsightCallback) for c in self.callbacks)
        if recording and self._replay_callbacks is None:
            self._replay_callbacks = _ReplayCallbacks.of(self.callbacks)
        return super().fit(*args, **kwargs)

    def replay(
        self,
        model: LightningModule,
        datamodule: LightningDataModule | None = None,
        *,
        probe: Callback | Iterable[Callback] | None = None,
        run: int | str | None = None,
        epochs: int | Iterable[int] | None = None,
        workers: int = 1,
        init: str = "weak",
        dirpath: str | os.PathLike | None = None,
        dry_run: bool = False,
        loggers: str | Iterable[Logger] | None = "original",
    ) -> ReplayResult | ReplayEstimate:
        """Replay a recorded run, re-executing only what the probes (or module edits) need.

        The same arguments, and the same result, as Composer's
        :func:`stalwart.algorithms.replay`, with the module and data in place of a factory for
        the run's Trainer.

        Args:
            model: the LightningModule, freshly built as for training (edits to its hooks count
                as probes); ``torch.compile(module)`` if the record trained it compiled.
            datamodule: the data, as for training.
            probe: a Callback (or several, or a :class:`FunctionProbe`) logging new values with
                ``pl_module.log``.
            run: run id or name in the record; default: the latest.
            epochs: which recorded epochs to replay (one epoch number, or several); default:
                all.
            workers: parallel worker processes, each replaying a contiguous segment.
            init: ``"weak"`` (resume from the nearest checkpoint) or ``"strong"`` (pseudoresume
                from the start, rebuilding state the checkpoints did not capture).
            dirpath: the record's directory; default: that of this Trainer's
                :class:`HindsightCallback`.
            dry_run: show the plan (segments, checkpoints, batches, estimated seconds from the
                record's timings) and return it as a :class:`ReplayEstimate`; run and write
                nothing.
            loggers: where the replay's new series are also written, as ``replay/<name>`` on
                the record's step axis: ``"original"`` (the TensorBoard, CSV and MLflow loggers
                the recorded run wrote to), ``None`` (only the store), or a list of Lightning
                loggers. The store is the source of truth: a logger whose files are gone is
                named in a warning and in ``result.logger_problems``.

        Returns:
            A :class:`ReplayResult` (``result.summary()`` puts the time next to the estimate),
            or with ``dry_run`` the :class:`ReplayEstimate`.
        """
        if dirpath is None:
            callback = next((c for c in self.callbacks if isinstance(c, HindsightCallback)), None)
            if callback is None:
                raise ConfigurationError(
                    "replay needs to know where the record is: add "
                    "HindsightCallback(dirpath=...) to this Trainer's callbacks, or pass "
                    "replay(..., dirpath=...)."
                )
            dirpath = callback.dirpath
        # A Trainer that never fit (built to replay) has unused callbacks: copied now.
        callbacks = self._replay_callbacks
        if callbacks is None:
            callbacks = _ReplayCallbacks.of(self.callbacks)
        args, kwargs = self._init_args
        return _replay(
            (args, {**kwargs, "callbacks": callbacks}), dirpath, model, datamodule, probe=probe,
            run=run, epochs=epochs, workers=workers, init=init, dry_run=dry_run, loggers=loggers,
        )  # fmt: skip


def _probes(probe: Any) -> list[Callback]:
    if probe is None:
        return []
    probes = (
        [probe] if isinstance(probe, Callback) or not isinstance(probe, Iterable) else list(probe)
    )
    for p in probes:
        if not isinstance(p, Callback):
            raise ConfigurationError(
                f"probe {p!r} is not a Lightning Callback: pass a Callback whose hooks call "
                "pl_module.log(...), or wrap a function as FunctionProbe('on_train_epoch_end', fn)."
            )
    return probes


def _replay(
    trainer_args: tuple[tuple, dict],
    dirpath: str | os.PathLike,
    model: LightningModule,
    datamodule: LightningDataModule | None = None,
    *,
    probe: Any = None,
    run: int | str | None = None,
    epochs: int | Iterable[int] | None = None,
    workers: int = 1,
    init: str = "weak",
    dry_run: bool = False,
    loggers: str | Iterable[Logger] | None = "original",
) -> ReplayResult | ReplayEstimate:
    """:meth:`Trainer.replay` for the Trainer built with ``trainer_args``, from ``dirpath``."""
    probes = _probes(probe)
    instances = _logger_instances(loggers)
    setup = core.prepare(dirpath, run, epochs, workers, dry_run=dry_run)
    targets = [] if instances is not None else core.logger_targets(setup.run, loggers)
    recorded_run, entries = setup.run, setup.entries
    _refuse_composer_record(recorded_run)
    # The record's own file (or the one its fit resumed from), checked against its size and
    # CRC-32; loaded in full, as every segment's start is (see _replay_segment).
    initial = _load_start(entries[min(entries)])["state_dict"]
    # A torch.compile'd module is checked as the LightningModule inside it: Lightning trains
    # that one (it unwraps the compiled wrapper itself), so its state and hooks are the record's.
    module = uncompiled(model)
    actual_class = f"{type(module).__module__}.{type(module).__qualname__}"
    core.check_same_model(recorded_run, initial, module.state_dict(), actual_class)
    level = probe_level(probes, core.edited_hooks(module, recorded_run))
    segments = core.plan(setup, level, workers, init)

    # Read here: a worker process must not use the store.
    last_batches = _last_epoch_batches(setup)
    taken = {entry.epoch for entry in recorded_run.checkpoints(include_initial=True)}

    def replay_segment(index: int, segment: Segment, replay_id: str) -> None:
        driver = ReplayDriver(
            segment, entries, str(setup.store.root), recorded_run.run_id, replay_id, index
        )
        _replay_segment(
            model, datamodule, probes, driver, entries[segment.resume_from], trainer_args,
            last_batches=last_batches if segment.last_epoch == max(setup.recorded) else None,
            load_in_training_dtype=segment.resume_from in taken,
            run_length=recorded_run.config, scratch=scratch,
        )  # fmt: skip

    # The segments' temporary folders are made in one of this process's, removed here whatever
    # became of the workers: a worker killed by a signal removes nothing of its own.
    with _scratch_folder(dry_run) as scratch:
        outcome = core.run_segments(
            setup, level, segments, replay_segment, dry_run=dry_run, targets=targets,
            logger_axis=lightning_points, also=lambda points: write_to_loggers(instances, points),
            batch_hooks=BATCH_LEVEL_HOOKS,
            explain=lambda: _mismatch_cause(model, datamodule, trainer_args[1], setup),
        )  # fmt: skip
    if _ANNOUNCE.get():
        rank_zero_info(str(outcome) if dry_run else outcome.summary())
    return outcome


def _scratch_folder(dry_run: bool) -> contextlib.AbstractContextManager[str | None]:
    """A replay's temporary folder, for its segments' own (none for a dry run: it writes
    nothing)."""
    if dry_run:
        return contextlib.nullcontext(None)
    return tempfile.TemporaryDirectory(prefix="stalwart-replay-")


def _refuse_composer_record(run: Any) -> None:
    """A Composer record is replayed by Composer: its checkpoints are Composer's state, which
    no Lightning fit can load (the reverse is refused on Composer's side too)."""
    if run.config.get("framework") == "composer":
        raise ReplayError(
            f"{run.name} in {run.store.root} was recorded by Composer's Hindsight algorithm, not "
            "by Lightning's HindsightCallback; replay it with "
            "stalwart.algorithms.replay(make_trainer, ...) (Composer)."
        )


@contextlib.contextmanager
def quiet_replay() -> Iterator[None]:
    """Within the block, ``replay`` returns its plan or result without logging it (for a caller
    that prints it itself, such as the ``stalwart replay`` command)."""
    token = _ANNOUNCE.set(False)
    try:
        yield
    finally:
        _ANNOUNCE.reset(token)


def uncompiled(model: Any) -> LightningModule:
    """The LightningModule inside a ``torch.compile``'d one (``model`` itself if not compiled).

    Lightning trains that module (``trainer.fit`` unwraps the compiled wrapper), so it is what a
    record saved and fingerprinted: its state has no ``_orig_mod.`` prefix, and the wrapper's
    class is torch's, whose methods fingerprint as none of the user's hooks.
    """
    return model._orig_mod if isinstance(model, OptimizedModule) else model


def is_compiled(model: Any) -> bool:
    """Whether ``model`` trains compiled: a ``torch.compile`` wrapper, or a LightningModule that
    Lightning's ``from_compiled`` (or a fit of a compiled module) left with compiled steps."""
    return uncompiled(model) is not model or getattr(model, "_compiler_ctx", None) is not None


def training_copy(model: Any) -> Any:
    """A copy of ``model`` for one replay segment to train, compiled as ``model`` is.

    A module that a fit has trained compiled keeps Lightning's compiled wrappers of its step
    methods as instance attributes, and a deep copy shares them: they call the *caller's* bound
    methods, so the copy would train and log the caller's weights. The copy gets its own methods
    back (``to_uncompiled`` restores the bound methods the copy rebound to itself) and is wrapped
    again with the same compiler settings, for Lightning to compile as it did in the record.
    """
    copied = detached_copy(model)
    inner = uncompiled(copied)
    context = getattr(inner, "_compiler_ctx", None)
    if context is None:
        return copied
    to_uncompiled(inner)
    return OptimizedModule(inner, context["dynamo_ctx"])


def _mismatch_cause(
    model: Any,
    datamodule: LightningDataModule | None,
    trainer_kwargs: dict[str, Any],
    setup: core.ReplaySetup,
) -> str | None:
    """What the replay's setup can tell about why values differ from the record, or None.

    Asked only once replayed values have differed. Every cause found is named, the one that no
    ``init`` can change first.
    """
    causes = [
        _continued_fit_cause(setup),
        _reload_cause(trainer_kwargs, setup.init),
        _data_cause(uncompiled(model), datamodule),
        _compiled_cause(model, setup.run.config.get("compiled")),
    ]
    return " ".join(cause for cause in causes if cause) or None


def _continued_fit_cause(setup: core.ReplaySetup) -> str | None:
    """A run that starts past epoch 0 without resuming from a checkpoint: a second ``fit()`` on
    the same Trainer, continued to a higher ``max_epochs``.

    Lightning builds that fit's first training iterator twice (``FitLoop.setup_data``, then the
    epoch loop's start, since the epoch is past 0 and nothing resumes), each drawing a seed from
    the global RNG; a replay resumes from a checkpoint and builds it once, so it draws other
    data whichever ``init`` it is given.
    """
    run = setup.run
    resumed = run.resumed_from is not None or RESUMED_FILE_KEY in run.config
    if not setup.recorded or setup.recorded[0] <= 0 or resumed:
        return None
    return (
        f"{run.name} starts at epoch {setup.recorded[0]} without resuming from a checkpoint: a "
        "fit() continued on the same Trainer. Lightning built that fit's first data iterator "
        "twice, drawing a seed from the global RNG each time, where a fit resumed from a "
        "checkpoint (every replay) builds it once, so the replay draws other data even with "
        "init='strong'. To continue a run replayably, resume it instead: a new Trainer's "
        "fit(..., ckpt_path=...) from one of the record's checkpoints."
    )


def _reload_cause(trainer_kwargs: dict[str, Any], init: str) -> str | None:
    """``reload_dataloaders_every_n_epochs``: each reloaded epoch's iterator is built twice in
    the record (``FitLoop.setup_data``, then the epoch loop's start, each drawing a seed from
    the global RNG), once in a fit resumed from that epoch's checkpoint; a strong replay runs
    the fit from its start as the record did."""
    if not trainer_kwargs.get("reload_dataloaders_every_n_epochs") or init != "weak":
        return None
    return (
        "The Trainer reloads its DataLoaders (reload_dataloaders_every_n_epochs): the recorded "
        "fit built each reloaded epoch's data iterator twice, drawing a seed from the global RNG "
        "each time, where a fit resumed from an epoch's checkpoint builds it once, so a replay "
        "from one draws other data. init='strong' replays from the start of the fit as recorded."
    )


def _compiled_cause(model: Any, recorded_compiled: bool | None = None) -> str | None:
    """A compiled module: a replay compiles it again as Lightning did in the record, which
    reproduces a record made compiled bit for bit (same torch, same compile options); against a
    record made in eager mode, or compiled otherwise, kernels that fuse and reorder operations
    round differently, and no ``init`` changes that. ``recorded_compiled``: whether the record
    was made compiled (None for records that did not say)."""
    if not is_compiled(model) and not recorded_compiled:
        return None
    return (
        "The module is compiled (torch.compile): compiled kernels fuse and reorder floating-point "
        "operations, so they round differently from eager mode and from another compilation "
        "(other compile options, another torch, mode='max-autotune', which picks kernels by "
        "timing them). Replay with the module compiled exactly as in the recorded fit, or "
        "uncompiled if the record was made uncompiled; init='strong' does not change this."
    )


def _data_cause(model: LightningModule, datamodule: LightningDataModule | None) -> str | None:
    """Why replayed values differ where the data can tell: DataLoaders with persistent workers.

    Their random state (a dataset's random augmentation) lives in worker processes that no
    checkpoint captures, so an epoch replayed from a checkpoint draws other data than the record
    did, whichever ``init``; workers started afresh each epoch are seeded from the RNG state that
    checkpoints hold. Built here from a copy of the data, only once values have differed.
    """
    source = detached_copy(datamodule if datamodule is not None else model)
    try:
        source.setup("fit")
    except Exception:  # data that can be set up only inside a fit: no cause known
        return None
    persistent = []
    for kind, build in (("training", "train_dataloader"), ("validation", "val_dataloader")):
        try:
            loaders = getattr(source, build)()
        except Exception:  # none defined, or built only inside a fit (it asks its Trainer)
            continue
        found: list[DataLoader] = []
        apply_to_collection(loaders, DataLoader, found.append)
        if any(loader.persistent_workers and loader.num_workers for loader in found):
            persistent.append(kind)
    return persistent_workers_cause(persistent)


def _logger_instances(loggers: Any) -> list[Logger] | None:
    """The Lightning loggers passed as ``loggers=[...]``, or None for "original"/None."""
    if loggers is None or isinstance(loggers, str):
        return None
    instances = [loggers] if isinstance(loggers, Logger) else list(loggers)
    for logger in instances:
        if not isinstance(logger, Logger):
            raise ConfigurationError(
                f"loggers: {logger!r} is not a Lightning logger; pass 'original', None, or "
                "Lightning loggers such as CSVLogger('logs')."
            )
    return instances


#: What a replay leaves out of the Trainer's callbacks: the record and checkpointing (a replay
#: records nothing of its own; Lightning's own ModelCheckpoint is kept, writing no file: see
#: writing_no_files), Lightning's display (the replay's Trainer adds its own), and the time
#: limit (a replay stops where the record says instead; see _replay_segment).
_NOT_REPLAYED = (HindsightCallback, Checkpoint, ProgressBar, ModelSummary, Timer)


def _replayed(callback: Callback, checkpointing: bool) -> bool:
    if type(callback) is ModelCheckpoint:
        return checkpointing
    return not isinstance(callback, _NOT_REPLAYED)


@dataclass
class _ReplayCallbacks:
    """Copies of the callbacks a replay segment runs again, taken before any fit used them.

    ``copies``: made by one deep copy of the list, so callbacks sharing an object still share
    one copy of it. ``timed``: whether the Trainer had a time limit (``max_time``, a ``Timer``).
    ``uncopyable``: the callback that could not be copied and why, named when a replay needs
    it, not here (a Trainer that never replays must still fit). ``checkpointing``: whether the
    replay's Trainer may have Lightning's checkpointing (its ``trainer.checkpoint_callback``):
    every ``ModelCheckpoint`` callback was Lightning's own class, copied with the rest. A
    Trainer with a subclass (a ``ShrinkCheckpoint``, the user's), alone or beside Lightning's,
    replays without checkpointing, rather than with Lightning's default ``ModelCheckpoint`` in
    its place, which would show paths and scores the record never had.
    """

    copies: list[Callback]
    timed: bool
    uncopyable: tuple[Callback, Exception] | None = None
    checkpointing: bool = False

    @classmethod
    def of(cls, callbacks: list[Callback]) -> _ReplayCallbacks:
        # Only ModelCheckpoints make trainer.checkpoint_callback (an OnExceptionCheckpoint
        # beside one is left out, as every other Checkpoint, and does not stop it being kept).
        checkpointing = all(
            type(c) is ModelCheckpoint for c in callbacks if isinstance(c, ModelCheckpoint)
        )
        kept = [c for c in callbacks if _replayed(c, checkpointing)]
        timed = any(isinstance(c, Timer) for c in callbacks)
        try:
            return cls(copy.deepcopy(kept), timed, checkpointing=checkpointing)
        except Exception:  # whatever stops a copy is reported at replay
            pass
        for callback in kept:  # one at a time, only to name the one that cannot be copied
            try:
                copy.deepcopy(callback)
            except Exception as error:
                return cls([], timed, (callback, error))
        return cls([], timed, (kept[0], RuntimeError("the callbacks together cannot be copied")))

    def fresh(self) -> list[Callback]:
        """A segment's own copies (never ones a fit used)."""
        if self.uncopyable is not None:
            callback, error = self.uncopyable
            raise ConfigurationError(
                f"replay runs a fresh copy of each of the Trainer's callbacks, and "
                f"{type(callback).__name__} cannot be copied "
                f"({type(error).__name__}: {error}). Make it copyable "
                "(copy.deepcopy), or replay from a Trainer built without it."
            )
        return copy.deepcopy(self.copies)


class _ReplayLogger(DummyLogger):
    """The logger of a replay segment whose recorded Trainer had loggers: it keeps nothing, but
    has a folder of its own (``save_dir`` and ``log_dir``, so ``trainer.log_dir`` too), a name
    and an integer version, for callbacks that write files there or format them. The folder is
    a temporary one per segment, never the record's: nothing a replayed callback writes can
    overwrite the recorded run's files."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self._folder = folder

    @property
    def name(self) -> str:
        return "replay"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str:
        return self._folder

    @property
    def log_dir(self) -> str:
        return self._folder


def _replay_segment(
    model: Any,
    datamodule: LightningDataModule | None,
    probes: list[Callback],
    driver: ReplayDriver,
    start: CheckpointEntry,
    trainer_args: tuple[tuple, dict],
    last_batches: int | None,
    load_in_training_dtype: bool,
    run_length: dict[str, Any] | None = None,
    scratch: str | None = None,
) -> None:
    """Run one segment: a fit of a copy of ``model`` from ``start`` with the probes and driver.

    ``last_batches``: the training batches the record's last epoch ran, for the segment that
    ends with it (else None); ``load_in_training_dtype``: put the module in the precision's dtype
    before the start is loaded (the record's own checkpoints; see :func:`_in_training_dtype`);
    ``run_length``: the record's config, for the recorded fit's ``max_epochs``/``max_steps``;
    ``scratch``: the replay's temporary folder, which the replaying process removes.
    """
    args, recorded = trainer_args
    # The segment's log folder: its own, removed after the fit (see _ReplayLogger), and inside
    # the replay's, which the replaying process removes even if this is a worker that dies.
    prefix = f"stalwart-replay-segment-{driver.index}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=scratch) as log_dir:
        kwargs = _segment_kwargs(recorded, probes, driver, last_batches, run_length or {})
        kwargs["logger"] = _ReplayLogger(log_dir) if recorded.get("logger") else False
        if is_shrunk_file(start.path):
            kwargs = _reading_shrunken_files(kwargs)
        trainer = L.Trainer(*args, **kwargs)
        for checkpoint in trainer.checkpoint_callbacks:  # only ModelCheckpoints (see fresh)
            writing_no_files(checkpoint)
        module = training_copy(model)
        if load_in_training_dtype:
            module = _in_training_dtype(trainer, module)
        with warnings.catch_warnings():
            # The record's checkpoints carry HindsightCallback state this trainer does not need.
            warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint.*")
            # weights_only=False: the start is the record's own checkpoint, or the file the
            # recorded fit resumed from (which that fit loaded itself), and plan() has checked it
            # against the size and CRC-32 the record holds for it, so it is the file the record
            # names. Callbacks' state may hold objects a weights-only load refuses
            # (StochasticWeightAveraging's scheduler keeps a function).
            trainer.fit(module, detached_copy(datamodule), ckpt_path=start.path, weights_only=False)


def _segment_kwargs(
    recorded: dict[str, Any],
    probes: list[Callback],
    driver: ReplayDriver,
    last_batches: int | None,
    run_length: dict[str, Any],
) -> dict[str, Any]:
    """The Trainer arguments of one segment (its logger aside): the recorded Trainer's, with
    fresh callbacks, the probes and driver, the record's run length and no time limit."""
    snapshot: _ReplayCallbacks = recorded["callbacks"]
    callbacks = snapshot.fresh()
    # No wall-clock limit: a replay (slower, with probes) would reach it elsewhere than the
    # recorded fit did. Where it cut the record's last epoch short, the segment ending there
    # requests the stop after the batch that epoch ended with instead, as the Timer did; a limit
    # that never fired stops nothing.
    last_epoch = driver.segment.last_epoch
    if snapshot.timed and last_batches:
        callbacks.append(_StopAfterBatch(last_epoch, last_batches))
    # The recorded run's length (max_epochs, max_steps), so that code reading it
    # (trainer.max_epochs, estimated_stepping_batches) sees what the record saw and a fit that
    # max_steps stopped stops there again; the segment stops at its own last epoch's end.
    callbacks.append(_StopAtSegmentEnd(last_epoch))
    kwargs = {key: value for key, value in recorded.items() if key != "max_time"}
    max_epochs = run_length.get("max_epochs")
    kwargs.update(
        callbacks=[*callbacks, *copy.deepcopy(probes), driver],
        max_epochs=max_epochs if max_epochs is not None else last_epoch + 1,
        # As recorded (Lightning's default ModelCheckpoint included), so user code reading
        # trainer.checkpoint_callback works; its files are never written (writing_no_files).
        enable_checkpointing=snapshot.checkpointing
        and recorded.get("enable_checkpointing") is not False,
        num_sanity_val_steps=0,
    )
    if "max_steps" in run_length:  # records made before it was kept: max_steps as given
        kwargs["max_steps"] = run_length["max_steps"]
    return kwargs


def _load_start(entry: CheckpointEntry) -> dict[str, Any]:
    """A replay's start checked against its size and CRC-32 and loaded in full: the record's own
    checkpoint, or the file the recorded fit resumed from, which may be a ``ShrinkCheckpoint``
    file (its format is read here, by the adapter: the hindsight core knows plain
    ``torch.save`` files only).

    weights_only=False as for every segment's start (see _replay_segment).
    """
    if not is_shrunk_file(entry.path):
        return entry.load(weights_only=False)
    verify_checkpoint(entry.path, entry.nbytes, entry.crc32)
    # A plugin of its own: loading makes a plugin continue the loaded file's chain.
    return ShrinkCheckpointIO().load_checkpoint(entry.path, weights_only=False)


def _reading_shrunken_files(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with a checkpoint IO that reads the shrunken file a segment starts from: the
    file a recorded fit resumed from with ``ShrinkCheckpoint``, whose plugin a replay leaves out
    with the callback (it saves nothing).

    A fresh ``ShrinkCheckpointIO``, never one the user passed: loading makes a plugin continue
    the loaded file's chain, and the recorded Trainer's must stay where its fit left it. It
    reads other files with the checkpoint IO the user passed, which it replaces (Lightning takes
    one). A strategy given with a checkpoint IO of its own is left as it is (Lightning refuses a
    second one).
    """
    strategy = kwargs.get("strategy")
    if isinstance(strategy, Strategy) and strategy._checkpoint_io is not None:
        return kwargs
    plugins = kwargs.get("plugins")
    given = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
    others = [plugin for plugin in given if not isinstance(plugin, CheckpointIO)]
    delegate = next((plugin for plugin in given if isinstance(plugin, CheckpointIO)), None)
    if isinstance(delegate, ShrinkCheckpointIO):
        delegate = delegate.delegate
    return {**kwargs, "plugins": [*others, ShrinkCheckpointIO(delegate=delegate)]}


class _StopAtSegmentEnd(Callback):
    """Stops a replay segment's fit once its last epoch has ended, in a Trainer that has the
    record's run length (``max_epochs``).

    Requested at the fit loop's epoch boundary, after everything the epoch runs (validation,
    every ``on_train_epoch_end``, the epoch-interval LR step), so no hook of the epoch sees a
    stop the record did not have. ``min_epochs``/``min_steps`` would veto the stop there; they
    are lifted then, since nothing of the segment's fit is left to hold back.

    The recorded fit went on from there, so the fit this stops runs no end-of-fit hook
    (``on_train_end``, ``on_fit_end``) of a callback, probe or the LightningModule: a probe
    there would see, at every segment's end, a fit end the record never had. The segment that
    ends where the recorded fit did ends by itself, and runs them once. The replay's own
    callbacks end in ``teardown``, which every segment runs.
    """

    def __init__(self, last_epoch: int) -> None:
        self.last_epoch = last_epoch
        self._restore_end_hooks = _nothing

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        hook_epoch_boundary(trainer, on_end=lambda: self._epoch_ended(trainer), on_error=_nothing)

    def _epoch_ended(self, trainer: L.Trainer) -> None:
        loop = trainer.fit_loop
        if trainer.current_epoch <= self.last_epoch or fit_ends_after_this_epoch(trainer):
            return
        trainer.should_stop = True
        if not loop._can_stop_early:
            loop.min_epochs = None
            loop.epoch_loop.min_steps = None
        self._restore_end_hooks = skip_fit_end_hooks(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        unhook_epoch_boundary(trainer)
        self._restore_end_hooks()


def _nothing() -> None:
    pass


class _StopAfterBatch(Callback):
    """A time limit's stop (``Trainer(max_time=...)``, a ``Timer``) where the recorded fit's
    came: after the ``batches``-th training batch of ``epoch``, by ``trainer.should_stop`` as
    the Timer requests it at a batch's end (a fit stopped that way still validates first).
    Counted in batches, not optimizer steps: with gradient accumulation a Timer can stop
    between two steps."""

    def __init__(self, epoch: int, batches: int) -> None:
        self.epoch = epoch
        self.batches = batches

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # An epoch of that many batches or fewer ended by itself: no time limit stopped it.
        short = self.batches < trainer.num_training_batches
        if trainer.current_epoch == self.epoch and batch_idx + 1 >= self.batches and short:
            trainer.should_stop = True


def _last_epoch_batches(setup: core.ReplaySetup) -> int | None:
    """The training batches the record's last epoch ran (None: not recorded)."""
    if not setup.recorded:
        return None
    ran = setup.run.epoch_work().set_index("epoch").batches
    last = setup.recorded[-1]
    return int(ran[last]) if last in ran.index else None


def _in_training_dtype(trainer: L.Trainer, module: Any) -> Any:
    """``module`` converted as ``trainer``'s precision converts it (``"64-true"``,
    ``"bf16-true"``, ``"16-true"``), before a checkpoint is loaded into it.

    Lightning loads ``ckpt_path`` into the module before its precision converts it, so float64
    weights of a ``"64-true"`` fit are rounded to float32 on the way in (a plain resume of such
    a fit is too). The recorded fit's state never was: a segment starting from one of the
    record's checkpoints must load it whole. A fit the record itself resumed did load its file
    rounded, so a segment starting there does not convert (see ``_replay``).
    """
    precision = trainer.precision_plugin
    if isinstance(precision, (DoublePrecision, HalfPrecision)):
        return precision.convert_module(module)
    return module


__all__ = ["FunctionProbe", "Mismatch", "ReplayEstimate", "ReplayResult", "Trainer"]
