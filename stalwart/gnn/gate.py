"""The staleness gate: how far ahead of the slowest interval an interval may run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stalwart.errors import ConfigurationError

SYNC = "sync"


def parse_staleness(value: int | str | None) -> int | None:
    """``"sync"``/``None`` -> ``None`` (barrier per layer); ``S >= 0`` (or ``"s=S"``) -> ``S``."""
    if value is None or value == SYNC:
        return None
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("s=")
        if text.lstrip("-").isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(
            f"staleness={value!r}: pass 'sync' (synchronous pipeline) or a whole number S >= 0 "
            "(0: barrier per epoch; S: intervals may run S epochs ahead of the slowest)."
        )
    if value < 0:
        raise ConfigurationError(
            f"staleness={value} is negative: an interval cannot be behind the slowest interval; "
            "pass 'sync' or S >= 0."
        )
    return value


@dataclass
class StalenessGate:
    """Admits interval ``i`` into epoch ``e`` only if ``e <= min_epoch + S``.

    ``min_epoch`` is the number of epochs every interval has finished (the epoch the slowest
    interval is in). ``staleness=None`` (sync) admits like ``S = 0``; the per-layer barriers of
    the synchronous pipeline are the scheduler's business.

    Every start and finish appends ``(interval, epoch, event, min_epoch, lead)`` to ``log``,
    where ``lead`` is the highest epoch any interval has started minus ``min_epoch``.

    Args:
        num_intervals: number of intervals.
        staleness: ``None`` (sync) or ``S >= 0``.

    Example:
        >>> gate = StalenessGate(2, 1)
        >>> gate.start(0, 0); gate.finish(0, 0); gate.may_start(0, 1), gate.may_start(0, 2)
        (True, False)
    """

    num_intervals: int
    staleness: int | None
    completed: torch.Tensor = field(init=False)
    started: torch.Tensor = field(init=False)
    log: list[tuple[int, int, str, int, int]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.staleness = parse_staleness(self.staleness)
        self.completed = torch.zeros(self.num_intervals, dtype=torch.long)
        self.started = torch.full((self.num_intervals,), -1, dtype=torch.long)

    @property
    def bound(self) -> int:
        return 0 if self.staleness is None else self.staleness

    @property
    def min_epoch(self) -> int:
        return int(self.completed.min())

    def lead(self) -> int:
        return int(self.started.max()) - self.min_epoch

    def may_start(self, interval: int, epoch: int) -> bool:
        idle = int(self.started[interval]) < int(self.completed[interval])
        return (
            idle and epoch == int(self.completed[interval]) and epoch <= self.min_epoch + self.bound
        )

    def start(self, interval: int, epoch: int) -> None:
        if not self.may_start(interval, epoch):
            raise RuntimeError(
                f"gate violated: interval {interval} asked to start epoch {epoch} with "
                f"min_epoch {self.min_epoch} and S={self.bound}"
            )
        self.started[interval] = epoch
        self.log.append((interval, epoch, "start", self.min_epoch, self.lead()))

    def finish(self, interval: int, epoch: int) -> None:
        self.completed[interval] = epoch + 1
        self.log.append((interval, epoch, "finish", self.min_epoch, self.lead()))

    def state_dict(self) -> dict:
        return {"completed": self.completed.clone(), "started": self.started.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.completed = state["completed"].clone()
        self.started = state["started"].clone()
