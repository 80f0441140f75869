"""stalwart.Trainer: Lightning's Trainer plus ``replay`` (hindsight logging, Flor §2.2)."""

from __future__ import annotations

import copy
import json
import math
import multiprocessing
import os
import time
import uuid
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import pandas as pd
import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import Callback, Checkpoint

from stalwart.callbacks.hindsight import HindsightCallback
from stalwart.callbacks.replay import FunctionProbe, ReplayDriver, probe_level
from stalwart.errors import ConfigurationError, ReplayError
from stalwart.hindsight.checkpoint_file import verify_checkpoint
from stalwart.hindsight.fingerprint import hook_fingerprints
from stalwart.hindsight.plan import Segment, plan_replay
from stalwart.hindsight.store import HindsightStore, Run


@dataclass(frozen=True)
class Mismatch:
    """A recorded metric the replay did not reproduce (Flor's deferred correctness check)."""

    name: str
    epoch: int
    recorded: list[float]
    replayed: list[float]


@dataclass
class ReplayResult:
    """What a replay produced: the probes' values, the work done, and the deferred check."""

    replay_id: str
    run: Run
    level: str
    segments: list[Segment]
    batch_epochs: list[int]
    seconds: float
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def batches_executed(self) -> int:
        """Training batches (``training_step`` calls) the replay ran."""
        return len(self.batch_epochs)

    def metrics(self, name: str) -> pd.DataFrame:
        """The values this replay logged under ``name``: epoch, step, value, source, hook."""
        frame = self.run.metrics(name, source="replay")
        frame = frame[frame.replay_id == self.replay_id]
        # Workers write concurrently; within an epoch, rows keep the order they were logged in.
        return frame.sort_values("epoch", kind="stable").reset_index(drop=True)


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
    ) -> ReplayResult:
        """Replay a recorded run, re-executing only what the probes (or module edits) need.

        Args:
            model: the LightningModule, freshly built as for training (edits to its hooks count
                as probes).
            datamodule: the data, as for training.
            probe: a Callback (or several, or a :class:`FunctionProbe`) logging new values with
                ``pl_module.log``.
            run: run id or name in the HindsightCallback's dirpath; default: the latest.
            epochs: which recorded epochs to replay; default: all.
            workers: parallel worker processes, each replaying a contiguous segment.
            init: ``"weak"`` (resume from the nearest checkpoint) or ``"strong"`` (pseudoresume
                from the start, rebuilding state the checkpoints did not capture).
        """
        callback = next((c for c in self.callbacks if isinstance(c, HindsightCallback)), None)
        if callback is None:
            raise ConfigurationError(
                "replay needs to know where the record is: add HindsightCallback(dirpath=...) "
                "to this Trainer's callbacks."
            )
        return replay(
            self._init_args, callback.dirpath, model, datamodule, probe=probe, run=run,
            epochs=epochs, workers=workers, init=init,
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


def _check_same_model(model: LightningModule, run: Run, initial: dict) -> None:
    recorded_class = run.config.get("module_class")
    actual_class = f"{type(model).__module__}.{type(model).__qualname__}"
    recorded = {k: tuple(v.shape) for k, v in initial["state_dict"].items()}
    actual = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if recorded != actual:
        differing = sorted(set(recorded.items()) ^ set(actual.items()))[:5]
        raise ReplayError(
            f"{run.name} was recorded from a different model ({recorded_class}): its state "
            f"differs from {actual_class}'s in {differing}. "
            "Pass the model the run was trained with."
        )


def _edited_hooks(model: LightningModule, run: Run) -> set[str]:
    recorded = run.fingerprints.get("module", {})
    current = hook_fingerprints(model)
    return {
        name for name in set(recorded) | set(current) if recorded.get(name) != current.get(name)
    }


def replay(
    trainer_args: tuple[tuple, dict],
    dirpath: Any,
    model: LightningModule,
    datamodule: LightningDataModule | None = None,
    *,
    probe: Any = None,
    run: int | str | None = None,
    epochs: Iterable[int] | None = None,
    workers: int = 1,
    init: str = "weak",
) -> ReplayResult:
    """Framework-facing core of :meth:`Trainer.replay` (see there)."""
    probes = _probes(probe)
    if not isinstance(workers, int) or workers < 1:
        raise ConfigurationError(f"workers={workers!r}: pass a whole number >= 1.")
    store = HindsightStore(dirpath, create=True)
    recorded_run = store.run(run)
    recorded_epochs = sorted(recorded_run.decisions().epoch.tolist())
    wanted = recorded_epochs if epochs is None else sorted(set(epochs))
    outside = sorted(set(wanted) - set(recorded_epochs))
    if outside:
        raise ReplayError(
            f"epochs {outside} are not in {recorded_run.name}, which recorded epochs "
            f"{recorded_epochs[0]}..{recorded_epochs[-1]}." if recorded_epochs else
            f"{recorded_run.name} recorded no epoch."
        )  # fmt: skip
    entries = {e.epoch: e for e in recorded_run.checkpoints(include_initial=True)}
    if not entries:
        raise ReplayError(f"{recorded_run.name} has no checkpoint to replay from.")
    _check_same_model(model, recorded_run, entries[min(entries)].load())
    edited = _edited_hooks(model, recorded_run)
    level = probe_level(probes, edited)
    segments = plan_replay(wanted, entries, level, workers=workers, init=init)
    for segment in segments:  # fail before any work on a torn file
        entry = entries[segment.resume_from]
        verify_checkpoint(entry.path, entry.nbytes, entry.crc32)

    replay_id = uuid.uuid4().hex[:12]
    started = time.perf_counter()
    jobs = [
        (index, segment, trainer_args, str(store.root), recorded_run.run_id, replay_id, entries)
        for index, segment in enumerate(segments)
    ]
    if len(jobs) == 1:
        _replay_segment(model, datamodule, probes, *jobs[0])
    else:
        _run_workers(model, datamodule, probes, jobs)
    seconds = time.perf_counter() - started

    work = store.query(
        "SELECT segment, batch_epochs FROM replay_work WHERE replay_id = ? ORDER BY segment",
        (replay_id,),
    )
    if len(work) != len(segments):
        raise ReplayError(f"replay {replay_id}: {len(segments) - len(work)} worker(s) failed.")
    batch_epochs = [e for text in work.batch_epochs for e in json.loads(text)]
    result = ReplayResult(replay_id, recorded_run, level, segments, batch_epochs, seconds)
    result.mismatches = deferred_check(store, recorded_run.run_id, replay_id, wanted)
    if result.mismatches:
        first = result.mismatches[0]
        warnings.warn(
            f"replay {replay_id} of {recorded_run.name} does not reproduce {len(result.mismatches)}"
            f" recorded value series, first {first.name!r} at epoch {first.epoch}: recorded "
            f"{first.recorded[:3]}, replayed {first.replayed[:3]}. State the checkpoints missed "
            "may differ; try init='strong'.",
            stacklevel=3,
        )
    return result


def _run_workers(model, datamodule, probes, jobs) -> None:
    """One forked process per segment, each with an equal share of the cores."""
    context = multiprocessing.get_context("fork")
    threads = max(1, (os.cpu_count() or 1) // len(jobs))
    processes = [
        context.Process(target=_worker_main, args=(threads, model, datamodule, probes, job))
        for job in jobs
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()


def _worker_main(threads: int, model, datamodule, probes, job) -> None:
    torch.set_num_threads(threads)
    _replay_segment(model, datamodule, probes, *job)


def _detached_copy(module: Any) -> Any:
    """A deep copy that does not drag along the Trainer the object may be attached to."""
    if module is None:
        return None
    trainer = getattr(module, "_trainer", None)
    module._trainer = None
    try:
        return copy.deepcopy(module)
    finally:
        module._trainer = trainer


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
        trainer.fit(_detached_copy(model), _detached_copy(datamodule), ckpt_path=start.path)


def deferred_check(
    store: HindsightStore, run_id: int, replay_id: str, epochs: list[int]
) -> list[Mismatch]:
    """Compare every recorded value series with the replayed one, per (name, epoch)."""
    rows = store.query(
        "SELECT name, epoch, value, source FROM metrics WHERE run_id = ? AND epoch IN"
        f" ({','.join('?' * len(epochs))}) AND (source = 'record' OR replay_id = ?)"
        " ORDER BY rowid",
        (run_id, *epochs, replay_id),
    )
    mismatches = []
    for (name, epoch), group in rows.groupby(["name", "epoch"], sort=True):
        recorded = group[group.source == "record"].value.tolist()
        replayed = group[group.source == "replay"].value.tolist()
        if not recorded or not replayed:
            continue  # only one side logged it: a new probe, or a memoized training metric
        same = len(recorded) == len(replayed) and all(
            a == b or (math.isnan(a) and math.isnan(b))
            for a, b in zip(recorded, replayed, strict=False)
        )
        if not same:
            mismatches.append(Mismatch(name, int(epoch), recorded, replayed))
    return mismatches


__all__ = ["FunctionProbe", "Mismatch", "ReplayResult", "Trainer", "replay"]
