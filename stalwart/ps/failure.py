"""The failure injector: SIGKILL the PS (or chain replicas) at a gradient count or a time, restart
after the downtime.

It only decides *when* and *whom*; the runner owns the processes and does the killing and the
restarting through the two callbacks, so the injector is easy to test and to reuse.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stalwart.ps.config import KillEvent


@dataclass
class Kill:
    """What happened for one :class:`KillEvent`."""

    event: KillEvent
    produced: int = 0
    killed_at: float | None = None
    restarted_at: float | None = None
    pids: list[int] = field(default_factory=list)
    #: When the trigger was first reached (epoch seconds).
    due_at: float | None = None
    #: The trigger was reached while the server was down or still recovering from the previous
    #: kill, so the kill waited until it was up again (two kills never land on one outage).
    deferred: bool = False


class FailureInjector:
    """Fire a schedule of kill events, one at a time.

    Args:
        events: the schedule (validated by :meth:`PSConfig.validate`).
        kill: ``kill(targets) -> pids`` SIGKILLs the targets and returns their pids.
        restart: ``restart(targets)`` starts replacements.
        server_up: True when the current PS has recovered (the next kill waits for it, so two
            kills never land on one outage).
        started: when the run's clock started (epoch seconds), for ``at_seconds`` events; the
            runner sets it once the workers start.

    Example:
        >>> injector = FailureInjector([KillEvent(100, 2.0)], kill, restart, up)  # doctest: +SKIP
        >>> injector.poll(produced=120)  # doctest: +SKIP
    """

    def __init__(
        self,
        events: list[KillEvent],
        kill: Callable[[tuple[str, ...]], list[int]],
        restart: Callable[[tuple[str, ...]], None],
        server_up: Callable[[], bool],
        started: float | None = None,
    ) -> None:
        self.kills = [Kill(event) for event in events]
        self.started = time.time() if started is None else started
        self._kill = kill
        self._restart = restart
        self._server_up = server_up

    @property
    def pending(self) -> bool:
        """A restart is still due."""
        return any(k.killed_at is not None and k.restarted_at is None for k in self.kills)

    def poll(self, produced: int, now: float | None = None) -> None:
        """Kill or restart whatever is due at ``produced`` gradients and time ``now``."""
        now = time.time() if now is None else now
        for kill in self.kills:
            if kill.killed_at is not None and kill.restarted_at is None:
                if now - kill.killed_at < kill.event.downtime:
                    return
                self._restart(kill.event.targets)
                kill.restarted_at = time.time()
                continue  # the next kill may be due already: it waits for the recovery
            if kill.killed_at is None:
                if self._due(kill.event, produced, now):
                    if kill.due_at is None:
                        kill.due_at = now
                    if self._server_up():
                        kill.pids = self._kill(kill.event.targets)
                        kill.killed_at = time.time()
                        kill.produced = produced
                    else:
                        kill.deferred = True
                return

    def _due(self, event: KillEvent, produced: int, now: float) -> bool:
        if event.at_seconds is not None:
            return now - self.started >= event.at_seconds
        return event.at_gradient is not None and produced >= event.at_gradient

    @property
    def waiting(self) -> bool:
        """A kill is due but deferred until the server is up again: the run must not end yet."""
        return any(k.due_at is not None and k.killed_at is None for k in self.kills)

    def unfired(self) -> list[KillEvent]:
        """Events that never fired (the run ended first)."""
        return [k.event for k in self.kills if k.killed_at is None]
