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
import multiprocessing.connection
import numbers
import re
import signal
import sqlite3
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from stalwart import durable
from stalwart.errors import (
    ConfigurationError,
    CorruptCheckpointError,
    ReplayError,
    RunDirectoryError,
    RunNotFoundError,
    StalwartError,
)
from stalwart.hindsight.check import BatchMismatch, Mismatch, batch_check, deferred_check, hint
from stalwart.hindsight.checkpoint_file import verify_checkpoint
from stalwart.hindsight.estimate import ReplayEstimate, estimate_replay
from stalwart.hindsight.fingerprint import hook_fingerprints
from stalwart.hindsight.numerics import NUMERICS_KEY, recorded_numerics, restore_numerics
from stalwart.hindsight.plan import Segment, plan_replay
from stalwart.hindsight.store import RESUMED_FILE_KEY, CheckpointEntry, HindsightStore, Run
from stalwart.hindsight.writeback import LOGGERS_KEY, target_problem, write_back

log = logging.getLogger(__name__)


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
    #: Recorded values the replay did not compare: those inside memoized epochs (e.g. mid-epoch
    #: validation with ``val_check_interval``; memoized epochs re-run only their epoch end) and
    #: series that time the run (``check.MACHINE_MEASURES``), which differ in every run.
    not_rerun: int = 0
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
        line = (
            f"replay {self.replay_id} of {self.run.name}: {self.level}-loop, "
            f"{len(self.segments)} segment(s), {self.batches_executed} training batches, "
            f"{self.seconds:.1f}s{estimated}, {len(self.mismatches)} mismatch(es)"
        )
        short = [m for m in self.mismatches if isinstance(m, BatchMismatch)]
        if short:
            ran, recorded = (int(sum(m.replayed[0] for m in short)),
                             int(sum(m.recorded[0] for m in short)))  # fmt: skip
            line += (
                f" (epoch(s) {', '.join(str(m.epoch) for m in short)} ran {ran} of the "
                f"{recorded} training batches the record ran in them)"
            )
        if self.not_rerun:
            line += (
                f"; {self.not_rerun} recorded value(s) not compared (series that time the run, "
                "and what memoized epochs do not re-run: only an epoch's end is)"
            )
        return line

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
    #: Why the state a resumed run started from cannot be replayed from (None: it can, or the
    #: run did not resume).
    unusable_start: str | None = None
    #: The plan's ``init`` (set by :func:`plan`).
    init: str = "weak"
    #: The epochs whose end the record noted (every epoch a replay can run).
    recorded: list[int] = field(default_factory=list)

    def step_at_end(self, epoch: int, start: int) -> int | None:
        """The global step at which the recorded fit ended ``epoch``: checkpoint ``start``'s
        step plus the training batches every epoch after it ran (the epoch a fit stopped in
        ran fewer than a whole one). None where the record cannot tell: a start whose step is
        not known, or an epoch recorded before batch counts were kept."""
        entry = self.entries.get(start)
        if entry is None or entry.step < 0:
            return None
        ran = self.run.epoch_work().set_index("epoch").batches
        epochs = range(start + 1, epoch + 1)
        if any(e not in ran.index for e in epochs):
            return None
        return entry.step + int(sum(ran[e] for e in epochs))

    def stop_step(self, segment: Segment) -> int | None:
        """Where a replay segment stops: the step at which the recorded fit stopped, for the
        segment that runs the record's last epoch (which may have stopped mid-epoch); None for
        any other segment (it runs whole epochs) or where the record cannot tell."""
        if not self.recorded or segment.last_epoch != self.recorded[-1]:
            return None
        return self.step_at_end(segment.last_epoch, segment.resume_from)


def prepare(
    dirpath: Any,
    run: int | str | None,
    epochs: Iterable[int] | None,
    workers: int,
    dry_run: bool = False,
) -> ReplaySetup:
    """Open the record and check the request against it, before any work.

    The record must exist: a replay never creates one (a mistyped or moved ``dirpath`` would
    otherwise be left holding an empty database). A dry run writes nothing at all.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ConfigurationError(f"workers={workers!r}: pass a whole number >= 1.")
    store = HindsightStore(dirpath)
    if not dry_run:
        store.add_missing_tables()  # a record made before a table existed, as a record's start
    recorded_run = store.run(run)
    recorded_epochs = sorted(recorded_run.decisions().epoch.tolist())
    entries = {e.epoch: e for e in recorded_run.checkpoints(include_initial=True)}
    start, unusable = (
        resumed_start(recorded_run, recorded_epochs[0]) if recorded_epochs else (None, None)
    )
    if start is not None:
        entries.setdefault(start.epoch, start)
    wanted = recorded_epochs if epochs is None else requested_epochs(epochs)
    setup = ReplaySetup(store, recorded_run, wanted, entries, unusable, recorded=recorded_epochs)
    # An epoch holding recorded values that no replay can run is said, never left out silently:
    # a replay of "every epoch" used to return the others alone, and no mismatch showed it. Asked
    # for by name it is an error; in "every epoch" (a failed run: the usual case to debug) the
    # others are replayed and a warning says what is left out.
    unended = unended_epochs(setup)
    if unended and set(wanted) & set(unended):
        raise ReplayError(_unended_reason(recorded_run, unended, recorded_epochs))
    if unended and epochs is None:
        warnings.warn(_unended_reason(recorded_run, unended, recorded_epochs), stacklevel=3)
    outside = sorted(set(wanted) - set(recorded_epochs))
    if outside:
        raise ReplayError(
            f"epochs {outside} are not in {recorded_run.name}, which recorded epochs "
            f"{recorded_epochs[0]}..{recorded_epochs[-1]}." if recorded_epochs else
            f"{recorded_run.name} recorded no epoch."
        )  # fmt: skip
    if not entries:
        raise ReplayError(
            f"{recorded_run.name} has no checkpoint to replay from."
            + (f" {unusable}" if unusable else "")
        )
    return setup


def requested_epochs(epochs: Any) -> list[int]:
    """The epochs a replay's ``epochs=`` names, sorted: one epoch number, or several."""
    if isinstance(epochs, numbers.Integral) and not isinstance(epochs, bool):
        return [int(epochs)]
    if not isinstance(epochs, Iterable) or isinstance(epochs, str):
        raise ConfigurationError(
            f"epochs={epochs!r}: pass an epoch number or several, e.g. epochs=3, "
            "epochs=[3, 4] or epochs=range(10, 20)."
        )
    return sorted(set(epochs))


def unended_epochs(setup: ReplaySetup) -> list[int]:
    """Epochs after the last one whose end the record noted, holding values the fit logged
    while it trained in them: a replay cannot tell where such an epoch stopped.

    In a run that did not complete (failed, or still running), that is every later epoch with
    a value. A completed run notes the epoch it stopped in; one recorded before that was noted
    holds values of it past the step where its last noted epoch ended, where a run that
    stopped at an epoch's end holds only what the framework logs once the fit is over (a
    Composer fit's closing counters, at that very step).
    """
    run, recorded = setup.run, setup.recorded
    last = recorded[-1] if recorded else -1
    rows = setup.store.query(
        "SELECT epoch, max(step) AS step FROM metrics WHERE run_id = ? AND source = 'record'"
        " AND epoch > ? GROUP BY epoch ORDER BY epoch",
        (run.run_id, last),
    )
    if run.status != "completed" or rows.empty:
        return [int(e) for e in rows.epoch]
    starts = [e for e in setup.entries if e <= last]
    end = setup.step_at_end(last, max(starts)) if starts else None
    if end is None:
        return []  # a record too old to tell where its epochs ended: nothing to compare with
    return [int(e) for e in rows.epoch[rows.step > end]]


def _unended_reason(run: Run, unended: list[int], recorded: list[int]) -> str:
    """Why ``unended`` epochs cannot be replayed, and which epochs can."""
    why = {
        "failed": "the fit failed inside it",
        "running": "the fit was still in it when the record was read (or its process died)",
    }.get(
        run.status,
        "the record was made before stalwart noted the epoch a fit stops in; re-record the "
        "run to replay it",
    )
    which = "epoch" if len(unended) == 1 else "epochs"
    said = ", ".join(map(str, unended))
    others = (
        f"The epochs it did record can be replayed: epochs={recorded}." if recorded
        else "No epoch of it can be replayed."
    )  # fmt: skip
    return (
        f"{run.name} holds recorded values of {which} {said} but not where the fit stopped in "
        f"it ({why}), so no replay can run it. {others}"
    )


#: ``Run.resumed_from``: the record and run whose state the resumed fit loaded, and its epoch.
_RESUMED_FROM = re.compile(r"^(?P<dirpath>.*)#(?P<run>run_\d+)@epoch=(?P<epoch>-?\d+)$")


def resumed_start(run: Run, first_epoch: int) -> tuple[CheckpointEntry | None, str | None]:
    """The state a resumed run started from, as a start for replays of its first epochs.

    A fit resumed with ``ckpt_path`` writes no ``init.ckpt``: its first epochs replay from the
    file it resumed from. That is the file the fit noted (the recording callback notes a local
    ``ckpt_path`` with its size and CRC-32 before training), else the record's own checkpoint of
    the state ``run.resumed_from`` names (records made before files were noted). Either is
    checked whole against its size and CRC-32 here.

    Returns ``(entry, None)``; ``(None, why)`` when the run resumed but that state cannot be
    used; ``(None, None)`` for a run that did not resume.
    """
    noted = run.config.get(RESUMED_FILE_KEY)
    named = _RESUMED_FROM.match(run.resumed_from or "")
    if noted is None and named is None:
        return None, None
    epoch = int(named["epoch"]) if named else first_epoch - 1
    state = f"the state after epoch {epoch} of {named['run']}" if named else "a checkpoint"
    said = f"{run.name} resumed from {state}"
    if noted is not None:
        # Its global step is not known without loading it; nothing reads a start's step.
        entry = CheckpointEntry(
            run.run_id, epoch, -1, Path(noted["path"]), noted["nbytes"], noted["crc32"]
        )
    else:
        entry = _recorded_checkpoint(run, named["dirpath"], named["run"], epoch)
        if entry is None:
            return None, (
                f"{said} ({run.resumed_from}): that record holds no checkpoint of it, and the "
                "fit did not note the file it resumed from (only a local ckpt_path is noted, "
                "by records made with this version or later)."
            )
    if not entry.path.is_file():
        return None, f"{said} in {entry.path}, which is gone; put it back to replay from it."
    try:
        durable.verify_file(entry.path, entry.nbytes, entry.crc32)
    except CorruptCheckpointError:
        when = "the fit resumed from it" if noted is not None else "it was written"
        return None, (
            f"{said} in {entry.path}, which no longer holds that state: its size or CRC-32 "
            f"differ from when {when} (e.g. a last.ckpt the fit went on to overwrite)."
        )
    return entry, None


def _recorded_checkpoint(run: Run, dirpath: str, name: str, epoch: int) -> CheckpointEntry | None:
    """Run ``name``'s checkpoint of ``epoch`` in the record at ``dirpath`` (often ``run``'s)."""
    same = Path(dirpath).expanduser().resolve() == run.store.root.resolve()
    try:
        store = run.store if same else HindsightStore(dirpath)
    except (RunNotFoundError, RunDirectoryError):
        return None  # that record is gone (or moved)
    try:
        return store.run(name).checkpoint(epoch)
    except RunNotFoundError:
        return None
    finally:
        if not same:
            store.close()


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
    first = min(setup.wanted, default=None)
    if setup.unusable_start and first is not None and not any(e < first for e in setup.entries):
        raise ReplayError(
            f"no checkpoint before epoch {first} to start from: {setup.unusable_start} "
            f"Replay epochs from {min(setup.entries) + 1} on, or re-record the run."
        )
    setup.init = init
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
    batch_hooks: Collection[str] = frozenset(),
    explain: Callable[[], str | None] = lambda: None,
) -> ReplayResult | ReplayEstimate:
    """Run ``replay_segment(index, segment, replay_id)`` for every segment and collect results.

    One segment runs in this process; several run in forked worker processes, one per segment,
    each with the record's numerics settings. Each segment stores its work in ``replay_work``.
    With ``dry_run`` nothing runs: the plan's :class:`ReplayEstimate` is returned instead.

    Afterwards the deferred check compares the replay with the record (see
    :mod:`stalwart.hindsight.check`; ``batch_hooks`` are the framework's per-batch hooks), and
    ``explain()``, asked only when replayed values differ, names a cause the adapter can tell.
    The replay's new series go to the record's loggers (``targets``, see
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
    work = _execute_whole(setup, segments, replay_segment, replay_id)
    seconds = time.perf_counter() - started

    store, recorded_run = setup.store, setup.run
    work["batch_epochs"] = work.batch_epochs.map(json.loads)
    batch_epochs = [e for ran in work.batch_epochs for e in ran]
    result = ReplayResult(
        replay_id, recorded_run, level, segments, batch_epochs, seconds, estimate=estimate
    )
    series, result.not_rerun = deferred_check(
        store, recorded_run.run_id, replay_id, segments, setup.entries, batch_hooks
    )
    # An epoch that ran short explains the series that differ in it: it goes first.
    result.mismatches = [*batch_check(recorded_run, segments, work), *series]
    if result.mismatches:
        differ = any(m.differing.size for m in result.mismatches)
        why = hint(result.mismatches, numerics, setup.init, explain() if differ else None)
        warnings.warn(
            f"replay {replay_id} of {recorded_run.name} does not reproduce the record: "
            f"{len(result.mismatches)} mismatch(es), first {result.mismatches[0]}. {why}",
            stacklevel=4,
        )
    points = logger_axis(new_series(result))
    if not points.empty:
        written, result.logger_problems = write_back(points, targets, replay_id)
        result.logged_to = [*written, *also(points)]
        for problem in result.logger_problems:
            warnings.warn(f"replay {replay_id}: {problem}", stacklevel=4)
    return result


def _execute_whole(
    setup: ReplaySetup, segments: list[Segment], replay_segment: Callable, replay_id: str
) -> pd.DataFrame:
    """Run every segment and return their ``replay_work`` rows; or, if any segment fails, drop
    every row the replay wrote and raise: values of some batches only are no result, and must
    not be read back as one (nor reach a logger). Registered as under way while it runs, so
    that readers do not serve its rows until it finished, nor ever those of a replaying
    process killed part-way, which the next replay deletes."""
    numerics = setup.run.config.get(NUMERICS_KEY, {})
    abandoned = setup.store.begin_replay(replay_id, setup.run.run_id)
    if abandoned:
        log.warning(
            "deleted the values of replay(s) %s: their process was killed before they finished",
            ", ".join(abandoned),
        )
    try:
        # Every segment computes with the record's settings (threads included, even if the
        # workers then share the cores): a reduction split over 2 threads sums differently.
        with recorded_numerics(numerics):
            failures, stopped = _execute(segments, replay_segment, replay_id, numerics)
        if failures:
            raise ReplayError(_failed_replay(replay_id, setup.run, failures, stopped))
        work = setup.store.query(
            "SELECT segment, batch_epochs FROM replay_work WHERE replay_id = ? ORDER BY segment",
            (replay_id,),
        )
        if len(work) != len(segments):  # a worker that ended without an error, nor its work
            missing = sorted(set(range(len(segments))) - set(work.segment))
            raise ReplayError(
                f"replay {replay_id} of {setup.run.name}: segment(s) {missing} ended without "
                "storing their work; nothing of this replay was kept. Replay again."
            )
        setup.store.finish_replay(replay_id)
    except BaseException:
        _discard(setup.store, replay_id)
        raise
    return work


def _discard(store: HindsightStore, replay_id: str) -> None:
    try:
        store.discard_replay(replay_id)
    except (sqlite3.Error, StalwartError) as exc:  # the replay's own error matters more
        log.warning("could not delete the rows of failed replay %s: %s", replay_id, exc)


@dataclass(frozen=True)
class WorkerFailure:
    """How the worker process of one replay segment failed."""

    index: int
    segment: Segment
    exitcode: int | None
    #: What the worker raised (type, message, last frames), as it sent it; None when it sent
    #: nothing (killed by a signal, or it exited on its own).
    report: str | None = None

    def __str__(self) -> str:
        epochs = self.segment.epochs
        said = f"epoch {epochs[0]}" if len(epochs) == 1 else f"epochs {epochs[0]}..{epochs[-1]}"
        where = f"segment {self.index} ({said})"
        if self.report is not None:
            return f"{where} raised {self.report}"
        if self.exitcode is not None and self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            oom = (
                " (the kernel's out-of-memory killer sends it: if memory ran short, replay with "
                "fewer workers)" if -self.exitcode == signal.SIGKILL else ""
            )  # fmt: skip
            return f"{where}: its worker process was killed by {name}{oom}"
        return f"{where}: its worker process exited with code {self.exitcode}, raising nothing"


def _failed_replay(replay_id: str, run: Run, failures: list[WorkerFailure], stopped: int) -> str:
    """The message of a replay whose workers failed: which segments, why, and what was kept."""
    first, *others = failures
    said = [f"replay {replay_id} of {run.name} failed: {str(first).rstrip()}"]
    said += [f"Also {str(other).rstrip()}" for other in others]
    if stopped:
        said.append(f"{stopped} other worker(s), still running then, were stopped.")
    said.append(
        "Nothing of this replay was kept (its values were deleted from the record; no logger "
        "was written to). Fix the cause and replay again; with workers=1 the replay runs in "
        "this process, where a debugger can stop at the error."
    )
    return "\n".join(said)


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
) -> tuple[list[WorkerFailure], int]:
    """Run every segment: one here; several in forked workers (in turn here if CUDA is in use).

    A segment run here raises its own error. Returns the workers that failed, and how many
    others were stopped then (the replay has failed: their work would be thrown away)."""
    if len(segments) == 1 or torch.cuda.is_initialized():
        if len(segments) > 1:
            # A forked child cannot use the CUDA context this process holds.
            log.warning(
                "CUDA is initialized in this process, so its %d replay segments run one "
                "after another here instead of in forked workers.", len(segments),
            )  # fmt: skip
        for index, segment in enumerate(segments):
            replay_segment(index, segment, replay_id)
        return [], 0
    context = multiprocessing.get_context("fork")
    # One pipe per worker, for its error: a child's traceback on its stderr reaches no caller.
    pipes = [context.Pipe(duplex=False) for _ in segments]
    processes = [
        context.Process(
            target=_worker_main,
            args=(numerics, replay_segment, index, segment, replay_id, pipes[index][1]),
        )
        for index, segment in enumerate(segments)
    ]
    try:
        # Forked from a thread that never ran a parallel region: OpenMP's worker pool belongs
        # to the thread that used it, and a child forked from that thread waits forever for
        # pool threads that fork did not copy (as soon as it runs with more than 1 thread).
        starter = threading.Thread(target=lambda: [p.start() for p in processes])
        starter.start()
        starter.join()
        failures = _await_workers(processes, [reader for reader, _ in pipes], segments)
    finally:
        # Still running only after a failure (or an interrupt here): that replay is over.
        stopped = [p for p in processes if p.is_alive()]
        for process in stopped:
            process.terminate()
        for process in processes:
            if process.pid is not None:
                process.join()
        for reader, writer in pipes:
            reader.close()
            writer.close()
    return failures, len(stopped)


def _await_workers(
    processes: list, readers: list, segments: Sequence[Segment]
) -> list[WorkerFailure]:
    """Wait until every worker has ended, or one has failed (then no longer: the replay has
    failed). A failed worker's report is read from its pipe; it sent none if it was killed."""
    running = {process.sentinel: index for index, process in enumerate(processes)}
    failures: list[WorkerFailure] = []
    while running and not failures:
        for sentinel in multiprocessing.connection.wait(list(running)):
            index = running.pop(sentinel)
            process = processes[index]
            process.join()
            if process.exitcode != 0:
                report = readers[index].recv() if readers[index].poll() else None
                failures.append(WorkerFailure(index, segments[index], process.exitcode, report))
    return failures


#: How much of a worker's error travels back: its last frames (the probe's, usually; those
#: above are the framework's fit loop), and a bounded message (a pipe holds 64 KiB unread).
_REPORTED_FRAMES = 6
_REPORTED_CHARS = 4000


def _worker_main(
    numerics: Mapping[str, Any],
    replay_segment: Callable,
    index: int,
    segment: Segment,
    replay_id: str,
    report: multiprocessing.connection.Connection,
) -> None:
    # Set again in the child: a forked process's thread pool does not carry the parent's setting.
    restore_numerics(numerics)
    try:
        replay_segment(index, segment, replay_id)
    except BaseException as exc:
        report.send(failure_report(exc))
        raise SystemExit(1) from None  # exit 1, the error said once: in the caller's ReplayError


def failure_report(exc: BaseException) -> str:
    """``RuntimeError: message`` and the last frames of where it was raised, bounded."""
    line = "".join(traceback.format_exception_only(exc)).strip()[: _REPORTED_CHARS // 2]
    frames = traceback.format_tb(exc.__traceback__)[-_REPORTED_FRAMES:]
    text = f"{line}\nIts last frames (most recent call last):\n{''.join(frames)}"
    return text[:_REPORTED_CHARS]
