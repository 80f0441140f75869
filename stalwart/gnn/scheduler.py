"""Worker pools for graph tasks (Gather/Scatter) and tensor tasks (ApplyVertex/ApplyEdge).

Dorylus runs graph tasks on graph-server threads and tensor tasks on Lambdas; separating the
two pools lets an interval's tensor task overlap another interval's graph task. The inline
variant runs one ready task at a time in a seeded random order: the same interleavings
(and so the same staleness) on every run, for tests.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from stalwart.errors import ConfigurationError

GRAPH, TENSOR = "graph", "tensor"


@dataclass(frozen=True)
class Straggler:
    """One slow worker: every task it runs takes ``delay`` seconds longer.

    Args:
        pool: ``"tensor"`` (a slow Lambda) or ``"graph"``.
        worker: index of the slow thread in that pool.
        delay: extra seconds per task.

    Example:
        >>> Straggler(pool="tensor", worker=0, delay=0.004)
        Straggler(pool='tensor', worker=0, delay=0.004)
    """

    pool: str = TENSOR
    worker: int = 0
    delay: float = 0.005

    def __post_init__(self) -> None:
        if self.pool not in (GRAPH, TENSOR):
            raise ConfigurationError(f"straggler pool {self.pool!r}: use 'graph' or 'tensor'.")
        if self.delay < 0 or self.worker < 0:
            raise ConfigurationError("straggler delay and worker must be >= 0.")


class WorkerPools:
    """A thread pool per task kind; ``wait`` returns whatever finished first.

    Args:
        graph_workers: threads running graph tasks.
        tensor_workers: threads running tensor tasks.
        straggler: an optional slow worker.

    Example:
        >>> pools = WorkerPools(2, 2)
        >>> pools.submit("graph", 3, lambda: 42)
        >>> pools.wait()
        [(3, 42)]
    """

    def __init__(
        self, graph_workers: int = 2, tensor_workers: int = 2, straggler: Straggler | None = None
    ) -> None:
        if graph_workers < 1 or tensor_workers < 1:
            raise ConfigurationError("each pool needs at least one worker (or use inline=True).")
        sizes = {GRAPH: graph_workers, TENSOR: tensor_workers}
        if straggler is not None and straggler.worker >= sizes[straggler.pool]:
            raise ConfigurationError(
                f"straggler worker {straggler.worker} does not exist: the {straggler.pool} pool "
                f"has {sizes[straggler.pool]} workers."
            )
        self._executors = {
            kind: ThreadPoolExecutor(n, thread_name_prefix=f"stalwart-{kind}")
            for kind, n in sizes.items()
        }
        self._slow = None if straggler is None else f"stalwart-{straggler.pool}_{straggler.worker}"
        self._delay = 0.0 if straggler is None else straggler.delay
        self._pending: dict[Future, int] = {}

    def _run(self, fn: Callable[[], object]) -> object:
        if self._slow is not None and threading.current_thread().name == self._slow:
            time.sleep(self._delay)
        return fn()

    def submit(self, kind: str, key: int, fn: Callable[[], object]) -> None:
        self._pending[self._executors[kind].submit(self._run, fn)] = key

    def __len__(self) -> int:
        return len(self._pending)

    def wait(self) -> list[tuple[int, object]]:
        done, _ = wait(list(self._pending), return_when=FIRST_COMPLETED)
        finished = sorted(((self._pending.pop(f), f) for f in done), key=lambda kf: kf[0])
        return [(key, future.result()) for key, future in finished]

    def close(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()


class InlinePools:
    """Runs one submitted task per ``wait``, chosen by a seeded RNG, in the calling thread.

    Args:
        seed: seed of the task choice; the same seed gives the same interleaving.
    """

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._pending: list[tuple[int, Callable[[], object]]] = []

    def submit(self, kind: str, key: int, fn: Callable[[], object]) -> None:
        self._pending.append((key, fn))

    def __len__(self) -> int:
        return len(self._pending)

    def wait(self) -> list[tuple[int, object]]:
        key, fn = self._pending.pop(self._rng.randrange(len(self._pending)))
        return [(key, fn())]

    def close(self) -> None:
        self._pending.clear()
