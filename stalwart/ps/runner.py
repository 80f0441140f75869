"""Run one parameter-server training job with real processes and real SIGKILLs, and measure it.

The runner starts the store (unless an external one is given), the PS or the replica chain, and
N workers, each as its own OS process (:mod:`stalwart.ps.processes`). While they train it samples
the committed weights' test accuracy against wall-clock time (:mod:`stalwart.ps.timeline`), lets
the :class:`~stalwart.ps.failure.FailureInjector` kill and restart the server
(:mod:`stalwart.ps.servers`), and at the end audits the lineage (:mod:`stalwart.ps.audit`) to
count gradients produced / applied / lost / applied twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import BinaryIO

from stalwart import durable
from stalwart.errors import (
    ConfigurationError,
    RunDirectoryError,
    StalwartError,
    StoreUnavailableError,
)
from stalwart.ps import layout
from stalwart.ps.audit import audit, read_reports
from stalwart.ps.config import KillEvent, PSConfig
from stalwart.ps.failure import FailureInjector
from stalwart.ps.processes import ChildProcess, ProcessSupervisor, describe_exit, describe_log
from stalwart.ps.resources import usage
from stalwart.ps.result import PSRunResult
from stalwart.ps.servers import ServerFleet
from stalwart.ps.store import RetryingStore, connect
from stalwart.ps.timeline import AccuracyTimeline
from stalwart.ps.wire import pack
from stalwart.ps.worker import STORE_GAVE_UP, WORKLOAD_FILE
from stalwart.ps.workload import DigitsWorkload, PSWorkload

#: Seconds between accuracy samples of the committed weights.
EVAL_EVERY = 0.25
#: Seconds between progress lines.
PROGRESS_EVERY = 5.0


class PSRun:
    """One run's processes. Use :func:`run_training`; this class is its machinery.

    The caller's ``config`` is never changed: the run works on a copy with the absolute run
    directory and the store's address filled in (``self.config``, also the result's).

    Args:
        config: the run (validated here).
        hook: called every monitor tick with this object (tests use it to make the store vanish).
        progress: called with a one-line status now and then.
        inspect: called with this object and the result before the store shuts down.
        workload: what to train (default: the paper's CNN on digits, sized by ``config``).
    """

    def __init__(
        self,
        config: PSConfig,
        hook: Callable[[PSRun], None] | None = None,
        progress: Callable[[str], None] | None = None,
        inspect: Callable[[PSRun, PSRunResult], None] | None = None,
        workload: PSWorkload | None = None,
    ) -> None:
        config.validate()
        run_dir = os.path.abspath(config.run_dir)
        if os.path.isdir(run_dir) and os.listdir(run_dir):
            raise RunDirectoryError(
                f"run directory {run_dir} is not empty; pick a new one (a run never overwrites "
                "another's checkpoint)."
            )
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as exc:  # a file where the directory (or one above it) should be
            raise RunDirectoryError(
                f"run directory {run_dir} cannot be created ({exc.strerror}); pick a path that "
                "is a new or empty directory."
            ) from None
        self.config = dataclasses.replace(config, run_dir=run_dir)
        self.run_dir = run_dir
        self.config_path = os.path.join(run_dir, "config.json")
        self.workload = workload or DigitsWorkload(config.hidden, config.batch_size)
        self.hook = hook
        self.inspect = inspect
        self.progress = progress or (lambda line: None)
        self.supervisor = ProcessSupervisor(run_dir)
        self.store_pid: int | None = None
        self.worker_pids: list[int] = []
        #: Gradients the workers have pushed so far (updated every monitor tick).
        self.produced = 0
        self.t0 = time.time()

    @property
    def procs(self) -> dict[int, ChildProcess]:
        """Every child process of the run by pid (the store's is ``procs[store_pid]``)."""
        return self.supervisor.procs

    def server_up(self) -> bool:
        """A PS serves (see :meth:`stalwart.ps.servers.ServerFleet.server_up`)."""
        return self.servers.server_up()

    def execute(self) -> PSRunResult:
        """Start everything, train, audit; every process is stopped when this returns."""
        durable.write_atomic(os.path.join(self.run_dir, WORKLOAD_FILE), self._pickle_workload)
        if self.config.store_address is None:
            self.store_pid, address = self.supervisor.start_store()
            self.config = dataclasses.replace(self.config, store_address=address)
        durable.write_text(self.config_path, self.config.to_json())
        try:
            self.store = self._connect()
            self._initialise_store()
            return self._train()
        finally:
            self.supervisor.shutdown()

    def _pickle_workload(self, handle: BinaryIO) -> None:
        import cloudpickle

        cloudpickle.dump(self.workload, handle)

    def _connect(self) -> RetryingStore:
        address = self.config.store_address
        assert address is not None
        try:
            return connect(address, self.config.store_patience, "runner")
        except StoreUnavailableError as exc:
            raise StoreUnavailableError(
                f"cannot reach the store at {address} at start: {exc}. Start the store first "
                "(or leave store_address unset to use the embedded one)."
            ) from None

    def _initialise_store(self) -> None:
        config = self.config
        if self.store.get(layout.HEAD) is not None:
            raise ConfigurationError(
                f"the store at {config.store_address} already holds a run; use a fresh store."
            )
        weights = self.workload.initial_weights(config.seed)
        cursors = [0] * config.workers
        self.store.set(
            layout.state(layout.INITIAL),
            pack({"version": 0, "log": layout.INIT, "cursors": cursors, "epoch": 0}, weights),
        )
        for w in range(config.workers):
            self.store.set(layout.count(w), b"0")
        self.store.add(layout.EPOCH, 0)
        if config.mode.startswith("chain"):
            self.store.add(layout.CHAIN_COUNT, config.replicas)
        self.store.set(
            layout.HEAD, json.dumps({"key": layout.INITIAL, "cursors": cursors}).encode()
        )

    def _workers_finished(self) -> bool:
        return bool(self.worker_pids) and all(
            not self.supervisor.alive(p) for p in self.worker_pids
        )

    def _start_processes(self) -> None:
        """Start the servers, the workers and one spare per process the schedule kills (so no
        restart waits for an import), all loading at once; wait until all are ready."""
        self.servers = ServerFleet(
            self.config, self.store, self.supervisor, self.config_path, self._workers_finished
        )
        self.servers.start()
        self.worker_pids = [
            self.supervisor.start("worker", self.config_path, str(w), name=f"worker-{w}")
            for w in range(self.config.workers)
        ]
        for _ in range(sum(len(k.targets) for k in self.config.kills)):
            self.servers.add_spare()
        self.servers.wait_until_ready()
        for w, pid in enumerate(self.worker_pids):
            ready = layout.ready(w)
            self.supervisor.wait_for(
                lambda ready=ready: self.store.get(ready) is not None, f"worker {w} to load", pid
            )

    def _kill(self, targets: tuple[str, ...]) -> list[int]:
        pids = self.servers.kill(targets)
        self.progress(f"  SIGKILL {targets} pid(s) {pids} at {self.produced} gradients")
        return pids

    def _restart(self, targets: tuple[str, ...]) -> None:
        self.servers.restart(targets)
        self.progress(f"  restarted {targets}")

    def _train(self) -> PSRunResult:
        self.timeline = AccuracyTimeline(self.store, self.workload)
        self._start_processes()
        injector = FailureInjector(
            self.config.kills, self._kill, self._restart, self.servers.server_up
        )
        self.store.set(layout.GO, b"1")
        self.t0 = injector.started = time.time()
        try:
            self._monitor(injector)
        except StoreUnavailableError as exc:
            self._store_lost(exc)
        self._check_workers()
        self.store.set(layout.STOP, b"1")
        head_pid = self.servers.head_pid()
        self.supervisor.wait_for(
            self.servers.drained, "the server to apply the last gradients", head_pid
        )
        wall = time.time() - self.t0
        # The head exits once drained; followers that nobody feeds any more are stopped later.
        self.supervisor.wait_for(
            lambda: not self.supervisor.alive(head_pid), "the server to exit", head_pid
        )
        self.timeline.sample(time.time() - self.t0, self.produced)
        result = audit(
            self.store, self.config, started_at=self.t0, wall=wall,
            kills=[kill for kill in injector.kills if kill.killed_at is not None],
            timeline=self.timeline.points,
            resources=usage(self.procs.values(), [self.procs[p] for p in self.worker_pids]),
        )  # fmt: skip
        report_unfired(injector.unfired(), result, self.produced, self.progress)
        if self.inspect is not None:
            self.inspect(self, result)  # the store is still up: audits can read it
        return result

    def _monitor(self, injector: FailureInjector) -> None:
        """Tick until the workers have finished and every kill has fired and recovered."""
        counts = [layout.count(w) for w in range(self.config.workers)]
        last_eval = last_progress = 0.0
        while True:
            self.supervisor.reap()
            if self._failed_workers():
                # A sync round waits for a gradient from every worker: one that crashed would
                # hold the others and the PS forever. _check_workers says which and why.
                return
            now = time.time()
            self.produced = sum(int(v) for v in self.store.get_many(counts))
            injector.poll(self.produced, now)
            duration = self.config.duration
            if duration and now - self.t0 >= duration and not injector.pending:
                self.store.set(layout.HALT, b"1")  # workers finish their current gradient
            if self.hook is not None:
                self.hook(self)
            if now - last_eval >= EVAL_EVERY:
                self.supervisor.sample_memory()
                self.timeline.sample(now - self.t0, self.produced)
                last_eval = now
            if now - last_progress >= PROGRESS_EVERY:
                last_progress = now
                self._report_progress(now)
            self.servers.check_alive({pid for kill in injector.kills for pid in kill.pids})
            self.servers.check_recovery(injector.kills, now)
            # A kill whose trigger passed while the PS was down fires once it is up again,
            # even if the workers have finished by then (a stateless run can produce all
            # its gradients during an outage).
            finished = all(self.procs[p].exit_code is not None for p in self.worker_pids)
            if finished and not injector.pending and not injector.waiting:
                return
            time.sleep(0.01)

    def _report_progress(self, now: float) -> None:
        points = self.timeline.points
        accuracy = points[-1]["accuracy"] if points else float("nan")
        self.progress(
            f"  {self.config.mode}: {self.produced}/{self.config.total_gradients} "
            f"gradients, accuracy {accuracy:.3f}, {now - self.t0:.0f}s"
        )

    def _failed_workers(self) -> list[int]:
        """The pids of the workers that exited with an error (so far)."""
        return [p for p in self.worker_pids if self.procs[p].exit_code not in (None, 0)]

    def _check_workers(self) -> None:
        failed = self._failed_workers()
        if not failed:
            return
        if any(self.procs[p].exit_code == STORE_GAVE_UP for p in failed):
            self._store_lost(None)
        # The others may still be training (or waiting for the dead one): stop them; the
        # supervisor kills whatever is left on the way out.
        self.store.set(layout.HALT, b"1")
        reports = [
            (
                f"worker {self.worker_pids.index(p)}",
                self.procs[p].exit_code,
                self.procs[p].log_path,
                self.supervisor.log_tail(p),
            )
            for p in failed
        ]
        raise StalwartError(worker_failure_message(reports))

    def _store_lost(self, cause: StoreUnavailableError | None) -> None:
        """The store vanished: let the workers finish retrying, keep the last committed weights."""
        deadline = time.time() + self.config.store_patience + 30
        while (
            any(self.procs[p].exit_code is None for p in self.worker_pids)
            and time.time() < deadline
        ):
            self.supervisor.reap()
            time.sleep(0.05)
        reports = read_reports(self.run_dir, self.config.workers)
        retries = sum(r.get("retries", 0) for r in reports)
        saved = os.path.join(self.run_dir, "last-committed.pt")
        last_key = self.timeline.last_key
        # Unsealed: a plain torch.save archive that torch.load reads.
        durable.save_torch(
            {"head": last_key, "weights": self.timeline.last_weights}, saved, seal=False
        )
        errors = sorted({(r.get("error") or "").split(":")[0] for r in reports if r.get("error")})
        raise StoreUnavailableError(
            f"the store at {self.config.store_address} vanished mid-run "
            f"({cause or 'workers gave up'}); workers retried {retries} time(s) with backoff "
            f"and reported {errors}. The last committed weights ({last_key}) are saved in "
            f"{saved}; restart the store and the run."
        )


def worker_failure_message(failed: list[tuple[str, int, str, str]]) -> str:
    """The error for workers that failed, each given as (name, exit code, log path, log tail):
    every one named with how it ended, then each one's log (or that it is empty)."""
    names = ", ".join(f"{name} ({describe_exit(code)})" for name, code, _, _ in failed)
    logs = "\n".join(f"{name}: {describe_log(path, tail)}" for name, _, path, tail in failed)
    return f"worker process(es) failed: {names}.\n{logs}"


def report_unfired(
    unfired: list[KillEvent], result: PSRunResult, produced: int, progress: Callable[[str], None]
) -> None:
    """List the kills the run ended before in ``result``, and warn: the run itself is complete.

    A schedule that can never fire is refused up front (:meth:`PSConfig.validate`); whether a
    timed kill in a run bounded by steps, or a gradient-count kill in one bounded by duration,
    fires depends on the machine's speed, so the trained weights are kept.
    """
    if not unfired:
        return
    result.unfired_kills = [
        {"at_gradient": e.at_gradient, "at_seconds": e.at_seconds, "targets": list(e.targets)}
        for e in unfired
    ]
    message = (
        f"kill(s) {unfired} never fired: the run ended at {produced} gradients, "
        f"{result.wall:.1f}s (gradients a stateful PS discards still count). The result covers "
        "the run without them (result.unfired_kills); schedule them earlier to measure them."
    )
    progress(f"  WARNING: {message}")
    warnings.warn(message, stacklevel=5)  # the caller of run_training


def run_training(
    config: PSConfig,
    hook: Callable[[PSRun], None] | None = None,
    progress: Callable[[str], None] | None = None,
    inspect: Callable[[PSRun, PSRunResult], None] | None = None,
    workload: PSWorkload | None = None,
) -> PSRunResult:
    """Train with a parameter server as ``config`` says, with real processes; the measurements.

    Args:
        config: the run (not changed: the result's ``config`` is the completed copy).
        hook: called on every monitor tick with the :class:`PSRun` (e.g. to make the store
            vanish).
        progress: receives status lines (pass ``print`` to see them).
        inspect: called with the :class:`PSRun` and the result before the store shuts down.
        workload: the model and data (default: the paper's CNN on digits, sized by ``config``).

    Example:
        >>> config = PSConfig(mode="stateless", steps=100, kills=[KillEvent(60, 2.0)])
        >>> result = run_training(config)  # doctest: +SKIP
        >>> result.lost, result.duplicates  # doctest: +SKIP
        (0, 0)
    """
    return PSRun(config, hook=hook, progress=progress, inspect=inspect, workload=workload).execute()


if __name__ == "__main__":  # pragma: no cover - a quick manual run
    print(run_training(PSConfig(run_dir=sys.argv[1]), progress=print).summary())
