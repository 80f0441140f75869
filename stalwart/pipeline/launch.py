"""The agent: hosts the rendezvous store, starts one worker process per node, watches them.

The c10d ``TCPStore`` lives in this process, which is not a trainer, so it survives the loss of
any worker. It is hosted here rather than by :mod:`stalwart.store_host` so that the workers can
be forked from this process in milliseconds, before the store's server thread starts; a launch
across machines uses ``python -m stalwart.store_host`` (see :mod:`stalwart.pipeline.node`).

The agent reports every worker that exits before finishing as ``dead/<rank>`` — the fast path
of failure detection (the workers' own send/recv errors and ``failure_timeout`` are the slow
path, and what a multi-machine launch without this agent relies on).

Example:
    >>> result = launch(PipelineJob(num_stages=4, steps=3), faults=[Fault(2, 1, "backward")])
    >>> len(result.losses), result.events[0]["kind"]
    (3, 'failover')
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed import PrefixStore, Store, TCPStore

from stalwart import durable
from stalwart.errors import ConfigurationError, PipelineRunError
from stalwart.pipeline import keys
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import PipelineJob

log = logging.getLogger(__name__)


@dataclass
class PipelineRunResult:
    """What a finished run recorded in the store.

    Attributes:
        losses: per-step training loss (as computed by the owner of the last stage).
        step_seconds: per-step wall time on the last stage.
        digests: ``{(step, stage): {"owner": sha256, "replica": sha256}}`` (with D pipelines
            also ``"owner@i"``/``"replica@i"`` for pipeline ``i > 0``: all must be equal).
        programs_run: per rank, how many times it ran a step's program (a re-run counts).
        events: recoveries in order (kind, lost ranks, step, resume step, seconds, ...).
        exit_codes: per launch rank (negative = killed by that signal).
        frc_reused: per rank, how many forwards a shadow took from its eager-FRC cache.
        profile: with ``job.profile``, ``{(step, rank): {op: [cpu_s, wall_s, count,
            run_queue_s]}}`` (run queue: seconds the thread was runnable but not running).
        seconds: wall time of the run.
    """

    losses: list[float]
    step_seconds: list[float]
    digests: dict[tuple[int, int], dict[str, str]] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    exit_codes: dict[int, int] = field(default_factory=dict)
    frc_reused: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    profile: dict[tuple[int, int], dict[str, list]] = field(default_factory=dict)
    programs_run: dict[int, int] = field(default_factory=dict)


class PipelineAgent:
    """Hosts the store, starts one worker per node, watches them and reports the dead.

    Use as a context manager: the workers are killed (by pid) and reaped on exit.

    Args:
        job: the run (validated here: bad input raises before any process starts).
        faults: kills/preemptions to inject.
        start_method: ``"fork"`` (workers start in milliseconds from this process's imports)
            or ``"spawn"`` (a fresh interpreter per worker, seconds each).

    Example:
        >>> with PipelineAgent(PipelineJob(num_stages=4, steps=3)) as agent:  # doctest: +SKIP
        ...     agent.wait_until(lambda: agent.store.check(["loss/2"]), timeout=60)
    """

    def __init__(
        self, job: PipelineJob, faults: Sequence[Fault] = (), start_method: str = "fork"
    ) -> None:
        if job.workload.startswith("in-memory:") and start_method != "fork":
            raise ConfigurationError("an in-memory workload needs start_method='fork'.")
        if start_method not in ("fork", "spawn"):
            raise ConfigurationError(f"start_method={start_method!r}: use 'fork' or 'spawn'.")
        if job.device == "cuda" and start_method == "fork" and torch.cuda.is_initialized():
            raise ConfigurationError(
                "CUDA is already initialized in this process, and a forked worker cannot use "
                "it: pass start_method='spawn', or launch before this process touches the GPU."
            )
        self.job = job.validate()
        for fault in faults:
            if fault.rank >= self.job.num_nodes:
                raise ConfigurationError(
                    f"fault {fault}: there are only {self.job.num_nodes} ranks."
                )
        self.faults = list(faults)
        self.start_method = start_method
        self.exit_codes: dict[int, int] = {}
        self.procs: dict[int, Any] = {}
        self.started = time.monotonic()
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> PipelineAgent:
        job = self.job
        self._tmp = tempfile.TemporaryDirectory(prefix="stalwart-pipeline-")
        tmp = Path(self._tmp.name)
        if job.checkpoint_dir is None:
            job.checkpoint_dir = str(tmp / "checkpoints")
        job_file = tmp / "job.json"
        durable.write_text(job_file, job.to_json())
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        faults_json = json.dumps([f.to_dict() for f in self.faults])
        try:
            if self.start_method == "fork":
                # Fork before this process starts the store's server thread: a child forked
                # while that thread holds a lock inherits the lock held and hangs in its own
                # TCPStore (seen here: ~1 launch in 10 hung in the worker's TCPStore).
                self.procs, ports = _fork(job, faults_json)
            self.master = TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=30),
            )  # fmt: skip
            self.store = PrefixStore(keys.RUN_PREFIX, self.master)
            if self.start_method == "fork":
                for conn in ports:
                    conn.send(self.master.port)
                    conn.close()
            else:
                self.procs = _spawn(job, job_file, self.master.port, faults_json, env)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.job.checkpoint_dir)

    def poll(self) -> bool:
        """Record exits; report a worker that exited without finishing as ``dead/<rank>`` (the
        fast path of failure detection). True when every worker has exited."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if rank in self.exit_codes or code is None:
                continue
            self.exit_codes[rank] = code
            if not self.store.check([keys.finished(rank)]):
                self.store.set(keys.dead(rank), f"exit code {code}")
        return len(self.exit_codes) == len(self.procs)

    def pid(self, rank: int) -> int:
        proc = self.procs[rank]
        return proc.process.pid if isinstance(proc, _Forked) else proc.pid

    def wait_until(
        self, condition: Callable[[], bool], timeout: float, what: str = "the run"
    ) -> None:
        """Poll the workers until ``condition()``; raise :class:`PipelineRunError` if every
        worker has exited first, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.poll() and not condition():
                raise PipelineRunError(
                    f"every worker exited before {what} (exit codes {self.exit_codes}); "
                    f"events {collect_events(self.store)}. A suspended job resumes from its "
                    "last checkpoint when enough nodes are back."
                )
            if time.monotonic() > deadline:
                raise PipelineRunError(
                    f"{what} did not finish within {timeout:.0f}s; workers killed. "
                    "Raise the timeout or look for a hung peer."
                )
            time.sleep(0.005)


def launch(
    job: PipelineJob,
    faults: Sequence[Fault] = (),
    timeout: float = 120.0,
    progress: bool = False,
    start_method: str = "fork",
) -> PipelineRunResult:
    """Validate ``job``, run it on ``job.num_nodes`` local worker processes, collect results.

    Args:
        job: the run; bad input raises :class:`ConfigurationError` before any process starts.
        faults: kills/preemptions to inject.
        timeout: seconds before the run is declared hung; the workers are then killed.
        progress: log each completed step's loss (INFO, logger ``stalwart.pipeline.launch``).
        start_method: ``"fork"`` or ``"spawn"`` (see :class:`PipelineAgent`).
    """
    with PipelineAgent(job, faults, start_method) as agent:
        reported = 0

        def all_exited() -> bool:
            nonlocal reported
            while progress and agent.store.check([keys.loss(reported)]):
                loss = float(agent.store.get(keys.loss(reported)))
                log.info("step %d: loss %.5f", reported, loss)
                reported += 1
            return len(agent.exit_codes) == len(agent.procs)

        agent.wait_until(all_exited, timeout)
        job = agent.job
        seconds = time.monotonic() - agent.started
        result = collect_result(agent.store, job, agent.exit_codes, seconds)
    if len(result.losses) < job.steps:
        raise PipelineRunError(
            f"training stopped before step {job.steps} ({len(result.losses)} steps done); exit "
            f"codes {result.exit_codes}; events {result.events}. A suspended job resumes from "
            "its last checkpoint when enough nodes are back."
        )
    return result


def collect_events(store: Store) -> list[dict]:
    """The recoveries recorded so far, in order."""
    count = store.add(keys.EVENTS, 0)
    return [json.loads(store.get(keys.event(n))) for n in range(1, count + 1)]


class _Forked:
    """A forked worker with the ``Popen`` calls the agent uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> None:
        self.process.join()


def _forked_worker(conn: Any, job_json: str, rank: int, faults_json: str) -> None:
    from stalwart.pipeline.runtime import run_worker

    port = conn.recv()
    conn.close()
    run_worker(job_json, rank, port, faults_json)


def _fork(job: PipelineJob, faults_json: str) -> tuple[dict, list]:
    ctx = multiprocessing.get_context("fork")
    procs, ports = {}, []
    for rank in range(job.num_nodes):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_forked_worker, args=(child, job.to_json(), rank, faults_json), daemon=True
        )
        proc.start()
        child.close()
        procs[rank] = _Forked(proc)
        ports.append(parent)
    return procs, ports


def _spawn(job: PipelineJob, job_file: Path, port: int, faults_json: str, env: dict) -> dict:
    return {
        rank: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stalwart.pipeline.runtime",
                "--job",
                str(job_file),
                "--rank",
                str(rank),
                "--port",
                str(port),
                "--faults",
                faults_json,
            ],
            env=env,
        )  # fmt: skip
        for rank in range(job.num_nodes)
    }


def collect_result(
    store: Store, job: PipelineJob, codes: dict[int, int], secs: float
) -> PipelineRunResult:
    """What the run of ``job`` recorded in ``store`` (``job.steps`` steps at most), with the
    workers' exit codes and the run's wall time."""
    losses, times = [], []
    for step in range(job.steps):
        if not store.check([keys.loss(step)]):
            break
        losses.append(float(store.get(keys.loss(step))))
        times.append(float(store.get(keys.step_time(step))))
    digests = _collect_digests(store, job) if job.verify_replicas else {}
    events = collect_events(store)
    nodes = range(job.num_nodes)
    reused = {r: store.add(keys.frc_reused(r), 0) for r in nodes}
    profile = {}
    if job.profile:
        for step in range(job.steps):
            for rank in nodes:
                if store.check([keys.profile(step, rank)]):
                    profile[(step, rank)] = json.loads(store.get(keys.profile(step, rank)))
    programs = {r: store.add(keys.programs(r), 0) for r in nodes}
    return PipelineRunResult(losses, times, digests, events, codes, reused, secs, profile, programs)


def _collect_digests(store: Store, job: PipelineJob) -> dict[tuple[int, int], dict[str, str]]:
    roles = [keys.role(r, i) for i in range(job.num_pipelines) for r in keys.ROLES]
    digests: dict[tuple[int, int], dict[str, str]] = {}
    for step in range(job.steps):
        for stage in range(job.num_stages):
            for role in roles:
                key = keys.digest(step, stage, role)
                if store.check([key]):
                    digests.setdefault((step, stage), {})[role] = store.get(key).decode()
    return digests
