"""What a replay will cost, from the record's own timings, before anything runs (FlorDB-style).

For each planned segment: the checkpoint it starts from, the training batches it re-executes
and an estimate of its seconds. The estimate uses what the record measured: an executed epoch
costs its recorded compute time ``C``; a memoized epoch costs a checkpoint restore plus its
recorded epoch-level time (validation, epoch-end hooks); a restore costs the policy's
restore/materialize ratio ``c`` times the seconds the checkpoint took to write. Segments run in
parallel, so the replay's estimate is its slowest segment. Starting the trainer(s) is not
included: it depends on the user's code and machine, not on the record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stalwart.hindsight.plan import Segment
from stalwart.hindsight.policy import DEFAULT_RESTORE_RATIO
from stalwart.hindsight.store import CheckpointEntry, Run


@dataclass(frozen=True)
class SegmentEstimate:
    """One segment's plan and estimated cost."""

    segment: Segment
    checkpoint: CheckpointEntry
    batches: int
    seconds: float


@dataclass(frozen=True)
class ReplayEstimate:
    """A replay's plan with its estimated cost; printed, a small table.

    Attributes:
        run: the recorded run.
        level: ``"outer"`` or ``"inner"``.
        segments: one :class:`SegmentEstimate` per worker.
        batches_known: False for records made before batch counts were kept (then
            ``batches`` counts only what could be inferred, and says so when printed).
        logger_problems: the record's loggers a real replay could not write to, and why.
    """

    run: Run
    level: str
    segments: list[SegmentEstimate]
    batches_known: bool = True
    #: The record's loggers a real replay could not write to, and why.
    logger_problems: list[str] = field(default_factory=list)

    @property
    def batches(self) -> int:
        """Training batches the replay will execute (``ReplayResult.batches_executed``)."""
        return sum(s.batches for s in self.segments)

    @property
    def seconds(self) -> float:
        """Estimated seconds: the slowest segment (segments run in parallel)."""
        return max(s.seconds for s in self.segments)

    def __str__(self) -> str:
        own = self.run.store.run_dir(self.run.run_id)
        # A resumed run's first epochs start from a file outside its own folder: say whose.
        names = [
            s.checkpoint.path.name
            if s.checkpoint.path.parent == own
            else f"{s.checkpoint.path.parent.name}/{s.checkpoint.path.name}"
            for s in self.segments
        ]
        width = max(22, *(len(name) + 2 for name in names))
        lines = [
            f"replay plan for {self.run.name}: {self.level}-loop, {len(self.segments)} "
            f"segment(s), {self.batches}{'' if self.batches_known else '?'} training batches, "
            f"estimated {self.seconds:.1f}s (excluding trainer start-up)",
            f"  {'segment':<8}{'from checkpoint':<{width}}{'epochs':<10}{'memoized':>9}"
            f"{'batches':>9}{'est. s':>8}",
        ]
        for index, (s, name) in enumerate(zip(self.segments, names, strict=True)):
            epochs = s.segment.epochs
            span = f"{epochs.start}..{epochs.stop - 1}" if len(epochs) else "-"
            lines.append(
                f"  {index:<8}{name:<{width}}{span:<10}"
                f"{len(s.segment.memoized):>9}{s.batches:>9}{s.seconds:>8.1f}"
            )
        lines += [f"  cannot write to a logger of the record: {p}" for p in self.logger_problems]
        return "\n".join(lines)


def estimate_replay(
    run: Run,
    level: str,
    segments: Sequence[Segment],
    entries: Mapping[int, CheckpointEntry],
) -> ReplayEstimate:
    """Estimate ``segments`` of a replay of ``run`` from the record's timings (runs nothing)."""
    restore_ratio = float(run.config.get("restore_ratio", DEFAULT_RESTORE_RATIO))
    compute = run.decisions().set_index("epoch").compute_time
    work = run.epoch_work().set_index("epoch")
    write_seconds = (
        run.store.query(
            "SELECT epoch, write_seconds FROM checkpoints WHERE run_id = ?", (run.run_id,)
        )
        .set_index("epoch")
        .write_seconds
    )

    # A resumed run's first start is a file this run did not write: priced as its own writes.
    typical = float(write_seconds.median()) if len(write_seconds) else 0.0

    def restore(epoch: int) -> float:
        return restore_ratio * float(write_seconds.get(epoch, typical))

    estimates = []
    for segment in segments:
        executed = segment.executed
        seconds = restore(segment.resume_from)
        seconds += sum(float(compute.get(epoch, 0.0)) for epoch in executed)
        seconds += sum(
            restore(epoch) + float(work.epoch_level_seconds.get(epoch, 0.0))
            for epoch in segment.memoized
        )
        batches = int(sum(int(work.batches.get(epoch, 0)) for epoch in executed))
        estimates.append(SegmentEstimate(segment, entries[segment.resume_from], batches, seconds))
    known = all(epoch in work.index for s in segments for epoch in s.executed)
    return ReplayEstimate(run, level, estimates, known)
