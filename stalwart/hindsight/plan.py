"""Replay planning (Flor §2.2, §3.3): which epochs to re-execute, which to skip, in what workers.

An epoch is *memoized* when its checkpoint exists and the probe does not need its training
batches: the replay restores the state its batches produced and runs only the epoch-level work.
An outer-loop probe (epoch-level hooks only) memoizes every epoch it can; an inner-loop probe
re-executes the epochs it asks for, each segment resuming from the nearest checkpoint before it.

A memoized epoch restores only its *end*: its start is the previous epoch's end (what
``on_train_epoch_start`` sees, and the state earlier epochs' epoch-level work carried into it,
such as a callback's or the probe's own). So every epoch from a segment's checkpoint to its last
runs, trained where it has no checkpoint, also when its values were not asked for.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from stalwart.errors import ConfigurationError, ReplayError

OUTER = "outer"
INNER = "inner"


@dataclass(frozen=True)
class Segment:
    """A contiguous stretch of epochs that one worker replays from one checkpoint.

    Attributes:
        resume_from: the checkpoint epoch the segment starts from (-1: the initial state).
        last_epoch: the last epoch it runs.
        memoized: epochs whose training batches are skipped (state restored from their checkpoint).
        requested: epochs whose probe values are wanted.
    """

    resume_from: int
    last_epoch: int
    memoized: frozenset[int]
    requested: frozenset[int]

    @property
    def epochs(self) -> range:
        return range(self.resume_from + 1, self.last_epoch + 1)

    @property
    def executed(self) -> list[int]:
        """Epochs whose training batches run."""
        return [epoch for epoch in self.epochs if epoch not in self.memoized]


def _split(epochs: list[int], parts: int, boundary_ok: Collection[int]) -> list[list[int]]:
    """Split sorted ``epochs`` into at most ``parts`` contiguous chunks of near-equal size,
    starting chunks only at epochs in ``boundary_ok`` (where a checkpoint precedes them)."""
    starts = [0]
    for part in range(1, parts):
        ideal = round(part * len(epochs) / parts)
        candidates = [i for i in range(starts[-1] + 1, len(epochs)) if epochs[i] in boundary_ok]
        if not candidates:
            break
        best = min(candidates, key=lambda i: (abs(i - ideal), i))
        if best not in starts:
            starts.append(best)
    starts = sorted(set(starts))
    return [epochs[a:b] for a, b in zip(starts, [*starts[1:], len(epochs)], strict=True)]


def plan_replay(
    requested: Iterable[int],
    checkpoints: Collection[int],
    level: str,
    workers: int = 1,
    init: str = "weak",
) -> list[Segment]:
    """Plan a replay of ``requested`` epochs given the epochs that have a checkpoint.

    Args:
        requested: epochs whose probe values are wanted.
        checkpoints: epochs with a complete checkpoint (``-1`` is the state before epoch 0).
        level: ``"outer"`` (epoch-level probe) or ``"inner"`` (batch-level probe).
        workers: how many parallel segments to aim for.
        init: ``"weak"`` resumes each segment from its nearest checkpoint; ``"strong"`` starts
            every segment from the earliest one (Flor's pseudoresume) and memoizes its way forward,
            so that state a checkpoint did not capture is rebuilt by the epoch-level work.
    """
    if level not in (OUTER, INNER):
        raise ConfigurationError(f"level={level!r}: use 'outer' or 'inner'.")
    if init not in ("weak", "strong"):
        raise ConfigurationError(f"init={init!r}: use 'weak' or 'strong'.")
    if workers < 1:
        raise ConfigurationError(f"workers={workers}: pass at least 1.")
    epochs = sorted(set(requested))
    if not epochs:
        raise ConfigurationError("no epochs to replay: pass at least one recorded epoch.")
    checkpoints = set(checkpoints)
    if not any(c < epochs[0] for c in checkpoints):
        raise ReplayError(
            f"no checkpoint before epoch {epochs[0]} to start from (the record has "
            f"{sorted(checkpoints) or 'none'}); replay later epochs or re-record the run."
        )
    boundary_ok = {e for e in epochs if e - 1 in checkpoints} if init == "weak" else set(epochs)
    segments = []
    for chunk in _split(epochs, workers, boundary_ok):
        first, last = chunk[0], chunk[-1]
        if init == "strong":
            resume_from = min(checkpoints)
        else:
            resume_from = max(c for c in checkpoints if c < first)
        wanted = frozenset(chunk)
        memoized = frozenset(
            epoch
            for epoch in range(resume_from + 1, last + 1)
            if epoch in checkpoints and (level == OUTER or epoch not in wanted)
        )
        segments.append(Segment(resume_from, last, memoized, wanted))
    return segments
