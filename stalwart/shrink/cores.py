"""How many torch threads a save's forwards run on: the cores training leaves idle, when idle.

Training waits while a checkpoint is shrunk in the fit, so the search's scoring forwards and the
optimizer's continuation check may use the cores training's torch threads leave free (the char
transformer trained on one thread of 2 cores: 14.4 s -> 8.6 s of compression for 10 checkpoints).
But a core another process is busy on is not free, and torch's threads wait for the slowest of
them at every operation: the char transformer's screening forwards took 125-137 ms on two threads
against 221-299 ms on one on a quiet machine, and 457-529 ms on two against 249-262 ms on one with
a single busy process beside them (docs/measurements/shrink.md). The affinity mask cannot tell
the two machines apart; the clock can. So :class:`ThreadChoice` times the calls and runs them on
whichever count was faster.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from stalwart.shrink import background

F = TypeVar("F", bound=Callable[..., Any])

#: A choice of training's thread count is re-measured on every core after this long: whatever
#: kept the other cores busy may have ended.
REPROBE_SECONDS = 30.0


def spare_cores() -> int | None:
    """Every core this process may run on, when a save may spread over them; None otherwise:
    from another thread (e.g. Lightning's AsyncCheckpointIO) or a background save's child,
    training goes on meanwhile and torch's thread count is the whole process's."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (
        not cores
        or cores <= torch.get_num_threads()
        or threading.current_thread() is not threading.main_thread()
        or background.in_child()
    ):
        return None
    return cores


class ThreadChoice:
    """Runs a save's forwards on training's thread count or on every core, whichever is faster.

    One role (the function a save calls most: the screen, else the scorer) is timed on both
    counts: first on every core, then once on training's count, then on the faster. While on every
    core, a slowdown shows in its own timings (they rise above the one-thread figure), so it never
    pays to re-measure the other; while on training's count, every core is tried again once
    :data:`REPROBE_SECONDS` have passed since it was last timed. The other roles (the scorer, the
    continuation check) follow the timed role's verdict: they run too seldom to be timed apart.
    Timings are compared within a role only (the same function on the same batches at every save
    of one adapter), so a choice is kept across saves on the adapter's :class:`ConfigSearch`.

    Args:
        clock: seconds, monotonic (injectable for tests).
        reprobe_seconds: how long a choice of training's count stands before every core is
            timed again.

    Example::

        choice = ThreadChoice()
        screen = choice.wrap(screen, timed=True)
        evaluate = choice.wrap(evaluate, timed=False)
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, reprobe_seconds: float = REPROBE_SECONDS
    ) -> None:
        self.clock = clock
        self.reprobe_seconds = reprobe_seconds
        #: threads -> (seconds of the timed role's last call on that count, when it ended)
        self.timings: dict[int, tuple[float, float]] = {}

    def _spread(self, own: int, cores: int) -> bool | None:
        """Whether every core was the faster at the latest timings; None until both are timed."""
        if own in self.timings and cores in self.timings:
            return self.timings[cores][0] < self.timings[own][0]
        return None

    def threads_for(self, own: int, cores: int, timed: bool) -> int:
        """The thread count for the next call (``own``: training's; ``cores``: every core)."""
        spread = self._spread(own, cores)
        if not timed:
            return own if spread is False else cores
        if spread is None:  # time every core first, then training's count once
            return own if cores in self.timings else cores
        if not spread and self.clock() - self.timings[cores][1] > self.reprobe_seconds:
            return cores
        return cores if spread else own

    def wrap(self, function: F, timed: bool) -> F:
        """``function`` run on the chosen thread count (the count before restored after)."""

        @functools.wraps(function)
        def chosen(*args: Any, **kwargs: Any) -> Any:
            cores = spare_cores()
            if cores is None:
                return function(*args, **kwargs)
            own = torch.get_num_threads()
            threads = self.threads_for(own, cores, timed)
            torch.set_num_threads(threads)
            try:
                start = self.clock()
                result = function(*args, **kwargs)
                if timed:
                    end = self.clock()
                    self.timings[threads] = (end - start, end)
            finally:
                torch.set_num_threads(own)
            return result

        return chosen  # type: ignore[return-value]
