"""Replay's deferred correctness check (Flor §3.3.3): does the replay reproduce the record?

Run after every segment has finished. Each value the record logged in a replayed epoch is compared
with the replayed value at the same global step, and every epoch a segment re-executed must have
run the training batches the record ran in it. What is compared where:

- an epoch the replay *re-executed* reproduces every value the record has of it;
- a *memoized* epoch re-runs only its epoch-level work at its end: the record's values at its
  checkpoint's step (validation, epoch-end hooks) are compared, values of per-batch hooks are not
  expected, and other recorded values (mid-epoch validation with ``val_check_interval``) are not
  re-run, only counted;
- a value the replay logged at a step where the record has none of that name is a mismatch;
- series that measure the machine rather than the model (:data:`MACHINE_MEASURES`: wall-clock
  time, throughput) differ in every run, so they are not compared, only counted as not re-run.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd

from stalwart.hindsight.plan import Segment
from stalwart.hindsight.store import CheckpointEntry, HindsightStore, Run

#: The name a :class:`BatchMismatch` goes by in ``result.mismatches``.
TRAINING_BATCHES = "training batches"

#: The series the deferred check does not compare: they time the run (wall clock, throughput),
#: so no replay, however exact, logs the recorded values. Each one recorded in a replayed epoch
#: counts as not re-run (``result.not_rerun``). Composer: ``SpeedMonitor``'s ``throughput/...``
#: and ``time/train``, ``time/val``, ``time/total``, ``RuntimeEstimator``'s
#: ``time/remaining_estimate``, older versions' ``wall_clock/...`` (Composer's other ``time/``
#: series count batches and samples, and are compared). Lightning: ``ThroughputMonitor``'s
#: ``<stage>|time`` and ``...per_sec`` / ``mfu`` (default separator ``|``).
MACHINE_MEASURES = re.compile(
    r"throughput/.*|wall_clock/.*|time/(train|val|total|remaining_estimate)"
    r"|\w+\|(time|(.*\|)?(\w+_per_sec|mfu))"
)


def measures_the_machine(name: str) -> bool:
    """Whether the series ``name`` times the run (see :data:`MACHINE_MEASURES`)."""
    return MACHINE_MEASURES.fullmatch(name) is not None


@dataclass(frozen=True, repr=False)
class Mismatch:
    """A recorded metric the replay did not reproduce (Flor's deferred correctness check).

    Printed, it is a one-line summary (how many values differ, the first, the largest
    difference, values one side has at a step the other has none at); the full series stay in
    ``recorded`` and ``replayed``, their global steps in ``recorded_steps`` and
    ``replayed_steps``. Without steps, values are compared by position.
    """

    name: str
    epoch: int
    recorded: list[float]
    replayed: list[float]
    recorded_steps: list[int] | None = None
    replayed_steps: list[int] | None = None

    @cached_property  # (a frozen dataclass: computed once, the series never change)
    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Indices into ``recorded`` and ``replayed`` of the values compared with each other:
        the k-th value logged at a step with the k-th replayed one at that step."""
        if self.recorded_steps is None or self.replayed_steps is None:
            n = min(len(self.recorded), len(self.replayed))
            return np.arange(n), np.arange(n)
        replayed = {key: i for i, key in enumerate(_occurrences(self.replayed_steps))}
        pairs = [
            (i, replayed[key])
            for i, key in enumerate(_occurrences(self.recorded_steps))
            if key in replayed
        ]
        index = np.asarray(pairs, dtype=int).reshape(-1, 2)
        return index[:, 0], index[:, 1]

    @property
    def differing(self) -> np.ndarray:
        """Indices into ``recorded`` whose value differs from the replayed one it is compared
        with (by step, else by position); NaN equals NaN here."""
        mine, theirs = self.pairs
        a = np.asarray(self.recorded, float)[mine]
        b = np.asarray(self.replayed, float)[theirs]
        return mine[(a != b) & ~(np.isnan(a) & np.isnan(b))]

    @property
    def max_difference(self) -> float:
        """The largest absolute difference of the compared values (0.0: none differ)."""
        mine, theirs = self.pairs
        a = np.asarray(self.recorded, float)[mine]
        b = np.asarray(self.replayed, float)[theirs]
        return float(np.nanmax(np.abs(a - b), initial=0.0)) if self.differing.size else 0.0

    @property
    def unreplayed(self) -> np.ndarray:
        """Indices into ``recorded`` with no replayed value to compare with."""
        return np.setdiff1d(np.arange(len(self.recorded)), self.pairs[0])

    @property
    def unrecorded(self) -> np.ndarray:
        """Indices into ``replayed`` with no recorded value to compare with."""
        return np.setdiff1d(np.arange(len(self.replayed)), self.pairs[1])

    @property
    def reproduced(self) -> bool:
        """Every value compared equal, and neither side has one the other lacks."""
        return not (self.differing.size or self.unreplayed.size or self.unrecorded.size)

    def __repr__(self) -> str:
        index = self.differing
        by_step = self.recorded_steps is not None and self.replayed_steps is not None
        compared = self.pairs[0].size if by_step else len(self.recorded)
        parts = [f"{index.size} of {compared} differ"] if compared or not by_step else []
        if index.size:
            first = int(index[0])
            at = f"step {self.recorded_steps[first]}" if by_step else f"{first}"
            replayed = self.replayed[int(self.pairs[1][np.searchsorted(self.pairs[0], first)])]
            parts.append(
                f"first at {at} ({self.recorded[first]!r} recorded, {replayed!r} replayed), "
                f"max |difference| {self.max_difference:.3g}"
            )
        if not by_step:
            if len(self.recorded) != len(self.replayed):
                parts.append(
                    f"{len(self.recorded)} recorded vs {len(self.replayed)} replayed values"
                )
        else:
            if self.unreplayed.size:
                steps = _span([self.recorded_steps[i] for i in self.unreplayed])
                parts.append(f"{self.unreplayed.size} recorded value(s) at {steps} not replayed")
            if self.unrecorded.size:
                steps = _span([self.replayed_steps[i] for i in self.unrecorded])
                parts.append(f"{self.unrecorded.size} replayed value(s) at {steps} not recorded")
        return f"Mismatch({self.name!r} epoch {self.epoch}: {', '.join(parts)})"

    __str__ = __repr__


@dataclass(frozen=True, repr=False)
class BatchMismatch(Mismatch):
    """An epoch the replay re-executed ran another number of training batches than the record:
    ``recorded`` and ``replayed`` hold the one count each."""

    def __repr__(self) -> str:
        return (
            f"Mismatch(epoch {self.epoch} ran {int(self.replayed[0])} of the "
            f"{int(self.recorded[0])} training batches the record ran in it)"
        )

    __str__ = __repr__


def _occurrences(steps: Iterable[int]) -> list[tuple[int, int]]:
    """``(step, k)`` for the k-th value at each step."""
    seen: defaultdict[int, int] = defaultdict(int)
    keys = []
    for step in steps:
        keys.append((step, seen[step]))
        seen[step] += 1
    return keys


def _span(steps: Sequence[int]) -> str:
    low, high = min(steps), max(steps)
    return f"step {low}" if low == high else f"steps {low}..{high}"


def deferred_check(
    store: HindsightStore,
    run_id: int,
    replay_id: str,
    segments: Sequence[Segment],
    entries: Mapping[int, CheckpointEntry],
    batch_hooks: Collection[str] = frozenset(),
) -> tuple[list[Mismatch], int]:
    """Compare every recorded value series with the replayed one, per (name, epoch), by step.

    Args:
        segments: the replay's plan (which requested epochs it memoized, which it re-executed).
        entries: the checkpoints by epoch (a memoized epoch's end is its checkpoint's step).
        batch_hooks: the hooks that run per training batch, whose values a memoized epoch does
            not reproduce (the last batch's end shares the epoch end's step).

    Returns the mismatches and how many recorded values were not re-run: those of memoized
    epochs that only an epoch's end re-runs, and those of series that time the run.
    """
    epochs = sorted(set().union(*(s.requested for s in segments)))
    memoized = {e for s in segments for e in s.memoized & s.requested}
    rows = store.query(
        "SELECT name, epoch, step, value, hook, source FROM metrics WHERE run_id = ? AND epoch IN"
        f" ({','.join('?' * len(epochs))}) AND (source = 'record' OR replay_id = ?)"
        " ORDER BY rowid",
        (run_id, *epochs, replay_id),
    )
    mismatches, not_rerun = [], 0
    for (name, epoch), group in rows.groupby(["name", "epoch"], sort=True):
        recorded = group[group.source == "record"]
        replayed = group[group.source == "replay"]
        if recorded.empty:
            continue  # only the replay logged it: a new probe's series
        if measures_the_machine(name):
            not_rerun += len(recorded)
            continue
        if epoch in memoized:
            recorded, skipped = _due_from_memoized(recorded, replayed, entries[epoch], batch_hooks)
            not_rerun += skipped
        if recorded.empty and replayed.empty:
            continue  # e.g. a training-step metric of a memoized epoch
        candidate = Mismatch(
            name, int(epoch), recorded.value.tolist(), replayed.value.tolist(),
            recorded.step.tolist(), replayed.step.tolist(),
        )  # fmt: skip
        if not candidate.reproduced:
            mismatches.append(candidate)
    return mismatches, not_rerun


def _due_from_memoized(
    recorded: pd.DataFrame,
    replayed: pd.DataFrame,
    checkpoint: CheckpointEntry,
    batch_hooks: Collection[str],
) -> tuple[pd.DataFrame, int]:
    """The recorded values a memoized epoch must reproduce, and how many others it did not
    re-run (per-batch hooks' values not counted: skipping those is what memoizing is)."""
    per_batch = recorded.hook.isin(list(batch_hooks))
    at_end = (recorded.step == checkpoint.step) & ~per_batch
    due = at_end | recorded.step.isin(replayed.step)
    return recorded[due], int((~due & ~per_batch).sum())


def batch_check(run: Run, segments: Sequence[Segment], work: pd.DataFrame) -> list[BatchMismatch]:
    """Every epoch a segment re-executed must have run the training batches the record ran.

    ``work`` is the replay's ``replay_work`` rows: per segment, the epoch of every batch it ran.
    Records made before batch counts were kept have nothing to compare with.
    """
    recorded = run.epoch_work().set_index("epoch").batches
    short: dict[int, BatchMismatch] = {}
    for segment, ran in zip(segments, work.batch_epochs, strict=True):
        counts = Counter(ran)
        for epoch in segment.executed:
            if epoch in recorded.index and counts[epoch] != recorded[epoch]:
                planned = float(recorded[epoch])
                mismatch = BatchMismatch(TRAINING_BATCHES, epoch, [planned], [float(counts[epoch])])
                short.setdefault(epoch, mismatch)
    return [short[epoch] for epoch in sorted(short)]


def hint(mismatches: Sequence[Mismatch], numerics: Mapping, init: str, cause: str | None) -> str:
    """What most likely made the replay differ, and what to do about it.

    Args:
        numerics: the record's numerics settings (empty: recorded before they were kept).
        init: the replay's ``init``.
        cause: the adapter's explanation of differing values where it can tell (e.g. a
            DataLoader whose persistent workers' random state no checkpoint holds), or None.
    """
    short = [m for m in mismatches if isinstance(m, BatchMismatch)]
    if short:
        first = short[0]
        return (
            f"Epoch {first.epoch} ran {int(first.replayed[0])} of its {int(first.recorded[0])} "
            "recorded training batches, so the replay stopped or limited it where the recorded "
            "fit did not: compare the replay Trainer's max_steps, limit_train_batches and the "
            "callbacks that stop a fit with the recorded run's."
        )
    if not numerics:
        return (
            "The record predates stored numerics settings (torch threads, deterministic flags), "
            "so the replay may compute differently; re-record to compare exactly."
        )
    if any(m.differing.size for m in mismatches):
        if cause is not None:
            return cause
        if init == "weak":
            return "State the checkpoints missed may differ; try init='strong'."
        return (
            "init='strong' did not rebuild it either: the replay's code, data or Trainer "
            "arguments may differ from the recorded fit's."
        )
    return (
        "Values were logged at other steps than recorded, or not at all: the replay's module, "
        "probes or Trainer arguments log differently from the recorded fit's."
    )
