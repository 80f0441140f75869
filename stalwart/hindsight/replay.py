"""Replay of a recorded run, the framework-neutral part (Flor §2.2, §3.3.3).

What a replay needs before any training runs (the record, the epochs, a model that matches it,
the plan, verified start checkpoints), running its segments in parallel worker processes, and
what it reports afterwards (the work each segment did and the deferred correctness check). The
Lightning and Composer adapters supply only the function that replays one segment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from stalwart.errors import ConfigurationError, ReplayError
from stalwart.hindsight.checkpoint_file import verify_checkpoint
from stalwart.hindsight.estimate import ReplayEstimate, estimate_replay
from stalwart.hindsight.fingerprint import hook_fingerprints
from stalwart.hindsight.numerics import NUMERICS_KEY, recorded_numerics, restore_numerics
from stalwart.hindsight.plan import Segment, plan_replay
from stalwart.hindsight.store import CheckpointEntry, HindsightStore, Run
from stalwart.hindsight.writeback import LOGGERS_KEY, target_problem, write_back

log = logging.getLogger(__name__)


@dataclass(frozen=True, repr=False)
class Mismatch:
    """A recorded metric the replay did not reproduce (Flor's deferred correctness check).

    Printed, it is a one-line summary (how many values differ, the first, the largest
    difference); the full series stay in ``recorded`` and ``replayed``.
    """

    name: str
    epoch: int
    recorded: list[float]
    replayed: list[float]

    @property
    def differing(self) -> np.ndarray:
        """Indices (in the shorter series) whose values differ; NaN equals NaN here."""
        n = min(len(self.recorded), len(self.replayed))
        a, b = np.asarray(self.recorded[:n], float), np.asarray(self.replayed[:n], float)
        return np.flatnonzero((a != b) & ~(np.isnan(a) & np.isnan(b)))

    @property
    def max_difference(self) -> float:
        """The largest absolute difference of the compared values (0.0: only lengths differ)."""
        index = self.differing
        if index.size == 0:
            return 0.0
        a, b = np.asarray(self.recorded, float), np.asarray(self.replayed, float)
        return float(np.nanmax(np.abs(a[index] - b[index]), initial=0.0))

    def __repr__(self) -> str:
        index = self.differing
        parts = [f"{self.name!r} epoch {self.epoch}: {index.size} of {len(self.recorded)} differ"]
        if index.size:
            first = int(index[0])
            parts.append(
                f"first at {first} ({self.recorded[first]!r} recorded, "
                f"{self.replayed[first]!r} replayed), max |difference| {self.max_difference:.3g}"
            )
        if len(self.recorded) != len(self.replayed):
            parts.append(f"{len(self.recorded)} recorded vs {len(self.replayed)} replayed values")
        return f"Mismatch({', '.join(parts)})"

    __str__ = __repr__


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
    #: The plan's cost estimate, made before the replay ran (see ``dry_run``).
    estimate: ReplayEstimate | None = None
    #: The loggers the replayed values were also written to (see ``loggers``).
    logged_to: list[str] = field(default_factory=list)
    #: The record's loggers that could not be written to, and why.
    logger_problems: list[str] = field(default_factory=list)

    @property
    def batches_executed(self) -> int:
        """Training batches (``training_step`` calls) the replay ran."""
        return len(self.batch_epochs)

    def summary(self) -> str:
        """One line: the work done, the time it took next to the estimate, the deferred check."""
        estimated = f" (estimated {self.estimate.seconds:.1f}s)" if self.estimate else ""
        return (
            f"replay {self.replay_id} of {self.run.name}: {self.level}-loop, "
            f"{len(self.segments)} segment(s), {self.batches_executed} training batches, "
            f"{self.seconds:.1f}s{estimated}, {len(self.mismatches)} mismatch(es)"
        )

    def metrics(self, name: str) -> pd.DataFrame:
        """The values this replay logged under ``name``: epoch, step, value, source, hook."""
        frame = self.run.metrics(name, source="replay")
        frame = frame[frame.replay_id == self.replay_id]
        # Workers write concurrently; within an epoch, rows keep the order they were logged in.
        return frame.sort_values("epoch", kind="stable").reset_index(drop=True)


@dataclass
class ReplaySetup:
    """A validated replay request: the record, the epochs wanted and their checkpoints."""

    store: HindsightStore
    run: Run
    wanted: list[int]
    entries: dict[int, CheckpointEntry]


def prepare(
    dirpath: Any,
    run: int | str | None,
    epochs: Iterable[int] | None,
    workers: int,
    dry_run: bool = False,
) -> ReplaySetup:
    """Open the record and check the request against it, before any work.

    A dry run opens the record read-only in effect: nothing is created or swept.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ConfigurationError(f"workers={workers!r}: pass a whole number >= 1.")
    store = HindsightStore(dirpath, create=not dry_run)
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
    return ReplaySetup(store, recorded_run, wanted, entries)


def check_same_model(
    run: Run, recorded: Mapping[str, Any], actual: Mapping[str, Any], actual_class: str
) -> None:
    """Refuse a model whose state (names and shapes) differs from the one the run recorded."""
    recorded_shapes = {k: tuple(v.shape) for k, v in recorded.items()}
    actual_shapes = {k: tuple(v.shape) for k, v in actual.items()}
    if recorded_shapes != actual_shapes:
        differing = sorted(set(recorded_shapes.items()) ^ set(actual_shapes.items()))[:5]
        raise ReplayError(
            f"{run.name} was recorded from a different model ({run.config.get('module_class')}): "
            f"its state differs from {actual_class}'s in {differing}. "
            "Pass the model the run was trained with."
        )


def edited_hooks(model: object, run: Run) -> set[str]:
    """The model's methods whose source differs from the record's fingerprints."""
    recorded = run.fingerprints.get("module", {})
    current = hook_fingerprints(model)
    return {
        name for name in set(recorded) | set(current) if recorded.get(name) != current.get(name)
    }


def plan(setup: ReplaySetup, level: str, workers: int, init: str) -> list[Segment]:
    """Plan the segments and verify every checkpoint one starts from (fail before any work)."""
    segments = plan_replay(setup.wanted, setup.entries, level, workers=workers, init=init)
    for segment in segments:
        entry = setup.entries[segment.resume_from]
        verify_checkpoint(entry.path, entry.nbytes, entry.crc32)
    return segments


def run_segments(
    setup: ReplaySetup,
    level: str,
    segments: list[Segment],
    replay_segment: Callable[[int, Segment, str], None],
    dry_run: bool = False,
    targets: Sequence[dict] = (),
    logger_axis: Callable[[pd.DataFrame], pd.DataFrame] = lambda rows: rows,
    also: Callable[[pd.DataFrame], list[str]] = lambda points: [],
) -> ReplayResult | ReplayEstimate:
    """Run ``replay_segment(index, segment, replay_id)`` for every segment and collect results.

    One segment runs in this process; several run in forked worker processes, one per segment,
    each with the record's numerics settings. Each segment stores its work in ``replay_work``.
    With ``dry_run`` nothing runs: the plan's :class:`ReplayEstimate` is returned instead.

    Afterwards the replay's new series go to the record's loggers (``targets``, see
    :mod:`stalwart.hindsight.writeback`), placed on their step axis by ``logger_axis``, and to
    ``also(points)``, which returns a description of each further logger it wrote to.
    """
    estimate = estimate_replay(setup.run, level, segments, setup.entries)
    if dry_run:
        setup.store.close()
        problems = [p for p in map(target_problem, targets) if p is not None]
        return dataclasses.replace(estimate, logger_problems=problems)
    replay_id = uuid.uuid4().hex[:12]
    numerics = setup.run.config.get(NUMERICS_KEY, {})
    started = time.perf_counter()
    # Every segment computes with the record's settings (threads included, even if the workers
    # then share the cores): a reduction split over 2 threads sums differently than over 1.
    with recorded_numerics(numerics):
        _execute(segments, replay_segment, replay_id, numerics)
    seconds = time.perf_counter() - started

    store, recorded_run = setup.store, setup.run
    work = store.query(
        "SELECT segment, batch_epochs FROM replay_work WHERE replay_id = ? ORDER BY segment",
        (replay_id,),
    )
    if len(work) != len(segments):
        raise ReplayError(f"replay {replay_id}: {len(segments) - len(work)} worker(s) failed.")
    batch_epochs = [e for text in work.batch_epochs for e in json.loads(text)]
    result = ReplayResult(
        replay_id, recorded_run, level, segments, batch_epochs, seconds, estimate=estimate
    )
    result.mismatches = deferred_check(store, recorded_run.run_id, replay_id, setup.wanted)
    if result.mismatches:
        first = result.mismatches[0]
        hint = (
            "State the checkpoints missed may differ; try init='strong'."
            if numerics
            else "The record predates stored numerics settings (torch threads, deterministic "
            "flags), so the replay may compute differently; re-record to compare exactly."
        )
        warnings.warn(
            f"replay {replay_id} of {recorded_run.name} does not reproduce {len(result.mismatches)}"
            f" recorded value series, first {first}. {hint}",
            stacklevel=4,
        )
    points = logger_axis(new_series(result))
    if not points.empty:
        written, result.logger_problems = write_back(points, targets, replay_id)
        result.logged_to = [*written, *also(points)]
        for problem in result.logger_problems:
            warnings.warn(f"replay {replay_id}: {problem}", stacklevel=4)
    return result


def new_series(result: ReplayResult) -> pd.DataFrame:
    """The replay's values of series the record did not log (name, epoch, step, value, hook).

    Series the record logged too are not repeated: the deferred check compared them.
    """
    rows = result.run.store.query(
        "SELECT name, epoch, step, value, hook FROM metrics WHERE run_id = ? AND replay_id = ?"
        " AND name NOT IN (SELECT DISTINCT name FROM metrics WHERE run_id = ? AND"
        " source = 'record') ORDER BY rowid",
        (result.run.run_id, result.replay_id, result.run.run_id),
    )
    return rows.sort_values(["epoch", "step"], kind="stable").reset_index(drop=True)


def logger_targets(run: Run, loggers: Any) -> list[dict]:
    """The write-back targets for ``loggers="original"`` (the record's) or ``None`` (none)."""
    if loggers is None:
        return []
    if loggers == "original":
        return list(run.config.get(LOGGERS_KEY, []))
    raise ConfigurationError(
        f"loggers={loggers!r}: pass 'original' (the recorded run's loggers), None, or a list "
        "of logger objects."
    )


def _execute(
    segments: Sequence[Segment], replay_segment: Callable, replay_id: str, numerics: Mapping
) -> None:
    """Run every segment: one here; several in forked workers (in turn here if CUDA is in use)."""
    if len(segments) == 1 or torch.cuda.is_initialized():
        if len(segments) > 1:
            # A forked child cannot use the CUDA context this process holds.
            log.warning(
                "CUDA is initialized in this process, so its %d replay segments run one "
                "after another here instead of in forked workers.", len(segments),
            )  # fmt: skip
        for index, segment in enumerate(segments):
            replay_segment(index, segment, replay_id)
    else:
        context = multiprocessing.get_context("fork")
        processes = [
            context.Process(
                target=_worker_main, args=(numerics, replay_segment, index, segment, replay_id)
            )
            for index, segment in enumerate(segments)
        ]
        # Forked from a thread that never ran a parallel region: OpenMP's worker pool belongs
        # to the thread that used it, and a child forked from that thread waits forever for
        # pool threads that fork did not copy (as soon as it runs with more than 1 thread).
        starter = threading.Thread(target=lambda: [p.start() for p in processes])
        starter.start()
        starter.join()
        for process in processes:
            process.join()


def _worker_main(
    numerics: Mapping[str, Any],
    replay_segment: Callable,
    index: int,
    segment: Segment,
    replay_id: str,
) -> None:
    # Set again in the child: a forked process's thread pool does not carry the parent's setting.
    restore_numerics(numerics)
    replay_segment(index, segment, replay_id)


def deferred_check(
    store: HindsightStore, run_id: int, replay_id: str, epochs: Sequence[int]
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
        candidate = Mismatch(name, int(epoch), recorded, replayed)
        if len(recorded) != len(replayed) or candidate.differing.size:
            mismatches.append(candidate)
    return mismatches
