"""stalwart.Trainer: Lightning's Trainer plus ``replay`` (hindsight logging, Flor §2.2)."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterable
from typing import Any

import lightning as L
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_info

from stalwart.callbacks.hindsight import HindsightCallback
from stalwart.callbacks.lightning_internals import detached_copy
from stalwart.callbacks.replay import FunctionProbe, ReplayDriver, probe_level
from stalwart.callbacks.replay_loggers import lightning_points, write_to_loggers
from stalwart.errors import ConfigurationError
from stalwart.hindsight import replay as core
from stalwart.hindsight.estimate import ReplayEstimate
from stalwart.hindsight.plan import Segment
from stalwart.hindsight.replay import Mismatch, ReplayResult


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
        self._init_args = (args, dict(kwargs))

    def replay(
        self,
        model: LightningModule,
        datamodule: LightningDataModule | None = None,
        *,
        probe: Callback | Iterable[Callback] | None = None,
        run: int | str | None = None,
        epochs: Iterable[int] | None = None,
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
                as probes).
            datamodule: the data, as for training.
            probe: a Callback (or several, or a :class:`FunctionProbe`) logging new values with
                ``pl_module.log``.
            run: run id or name in the record; default: the latest.
            epochs: which recorded epochs to replay; default: all.
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
        return _replay(
            self._init_args, dirpath, model, datamodule, probe=probe, run=run,
            epochs=epochs, workers=workers, init=init, dry_run=dry_run, loggers=loggers,
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
    epochs: Iterable[int] | None = None,
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
    initial = entries[min(entries)].load()["state_dict"]
    actual_class = f"{type(model).__module__}.{type(model).__qualname__}"
    core.check_same_model(recorded_run, initial, model.state_dict(), actual_class)
    level = probe_level(probes, core.edited_hooks(model, recorded_run))
    segments = core.plan(setup, level, workers, init)

    def replay_segment(index: int, segment: Segment, replay_id: str) -> None:
        _replay_segment(
            model, datamodule, probes, index, segment, trainer_args, str(setup.store.root),
            recorded_run.run_id, replay_id, entries,
        )  # fmt: skip

    outcome = core.run_segments(
        setup, level, segments, replay_segment, dry_run=dry_run, targets=targets,
        logger_axis=lightning_points, also=lambda points: write_to_loggers(instances, points),
    )  # fmt: skip
    rank_zero_info(str(outcome) if dry_run else outcome.summary())
    return outcome


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


def _replay_segment(
    model, datamodule, probes, index, segment, trainer_args, store_dir, run_id, replay_id, entries
) -> None:
    args, kwargs = trainer_args
    kept = [
        copy.deepcopy(c)
        for c in kwargs.get("callbacks") or []
        if not isinstance(c, (HindsightCallback, Checkpoint))
    ]
    driver = ReplayDriver(segment, entries, store_dir, run_id, replay_id, index)
    kwargs = {
        **kwargs,
        "callbacks": [*kept, *copy.deepcopy(probes), driver],
        "max_epochs": segment.last_epoch + 1,
        "logger": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
    }
    trainer = L.Trainer(*args, **kwargs)
    start = entries[segment.resume_from]
    with warnings.catch_warnings():
        # The record's checkpoints carry HindsightCallback state this trainer does not need.
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint.*")
        trainer.fit(detached_copy(model), detached_copy(datamodule), ckpt_path=start.path)


__all__ = ["FunctionProbe", "Mismatch", "ReplayEstimate", "ReplayResult", "Trainer"]
