"""Run one parameter-server training job with real processes and real SIGKILLs, and measure it.

The runner starts the store (unless an external one is given), the PS or the replica chain, and
N workers, each as its own OS process. While they train it samples the committed weights'
test accuracy against wall-clock time, lets the :class:`FailureInjector` kill and restart the
server, and reaps every process with ``os.wait4`` so CPU time and peak memory are known even
for the processes it killed. At the end it walks the audit lineage to count gradients
produced / applied / lost / applied twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stalwart.errors import (
    ConfigurationError,
    RunDirectoryError,
    StalwartError,
    StoreUnavailableError,
)
from stalwart.ps import layout
from stalwart.ps.config import PSConfig
from stalwart.ps.failure import FailureInjector, Kill
from stalwart.ps.launch import client_factory, spawn
from stalwart.ps.lineage import Record, head_lineage, head_state, replay
from stalwart.ps.model import unflatten_into
from stalwart.ps.store import RetryingStore
from stalwart.ps.wire import pack, unpack
from stalwart.ps.worker import WORKLOAD_FILE
from stalwart.ps.workload import DigitsWorkload, Workload

#: Seconds between accuracy samples of the committed weights.
EVAL_EVERY = 0.25
#: Seconds past a kill's downtime within which some server must have recovered and committed.
RECOVERY_LIMIT = 60.0


@dataclass
class Proc:
    role: str
    popen: Any
    started: float
    exit_code: int | None = None
    cpu: float = 0.0
    peak_kb: int = 0
    ended: float | None = None


@dataclass
class RunResult:
    """What one run measured. Times are seconds since the workers started."""

    config: PSConfig
    wall: float
    #: When the workers started (epoch seconds); worker push times in ``reports`` are absolute.
    started_at: float = 0.0
    timeline: list[dict] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    recoveries: list[dict] = field(default_factory=list)
    produced: int = 0
    applied: int = 0
    lost: int = 0
    duplicates: int = 0
    #: Optimizer updates on the committed lineage (an update may consume many gradients).
    updates: int = 0
    #: Updates that merged a backlog: ``{"ref", "gradients", "workers", "scale"}`` each.
    backlogs: list[dict] = field(default_factory=list)
    produced_during_downtime: int = 0
    worker_idle: list[float] = field(default_factory=list)
    worker_cpu_utilisation: float = 0.0
    server_cpu: float = 0.0
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    store_retries: int = 0
    final_accuracy: float = 0.0
    #: The committed weights at the end of the run (flat, as the workload's model orders them).
    weights: torch.Tensor | None = None
    weights_verified: bool | None = None
    reports: list[dict] = field(default_factory=list)
    lineage: list[Record] = field(default_factory=list)

    def time_to_accuracy(self, target: float, window: int = 3) -> float | None:
        """First time the mean test accuracy of the last ``window`` committed weights sampled
        reached ``target`` (None if never). The mean keeps one lucky sample of a noisy curve
        from deciding when a run "got there"."""
        accuracies = [p["accuracy"] for p in self.timeline]
        for i in range(window - 1, len(accuracies)):
            if sum(accuracies[i - window + 1 : i + 1]) / window >= target:
                return self.timeline[i]["t"]
        return None

    def summary(self) -> dict:
        return {
            "mode": self.config.mode, "kills": len(self.kills), "wall_s": round(self.wall, 2),
            "produced": self.produced, "applied": self.applied, "lost": self.lost,
            "applied_twice": self.duplicates, "during_downtime": self.produced_during_downtime,
            "updates": self.updates,
            "backlog_updates": [
                {"gradients": b["gradients"], "workers": b["workers"]} for b in self.backlogs
            ],
            "deferred_kills": sum(bool(k.get("deferred")) for k in self.kills),
            "worker_idle_s": round(sum(self.worker_idle), 2),
            "worker_cpu_util": round(self.worker_cpu_utilisation, 3),
            "server_cpu_s": round(self.server_cpu, 2),
            "peak_rss_mb": {k: round(v, 1) for k, v in self.peak_rss_mb.items()},
            "final_accuracy": round(self.final_accuracy, 4),
        }  # fmt: skip


class Run:
    """One run's processes. Use :func:`run_training`; this class is its machinery.

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
        hook: Callable[[Run], None] | None = None,
        progress: Callable[[str], None] | None = None,
        inspect: Callable[[Run, RunResult], None] | None = None,
        workload: Workload | None = None,
    ) -> None:
        config.validate()
        self.workload = workload
        self.inspect = inspect
        self.config = config
        self.hook = hook
        self.progress = progress or (lambda line: None)
        self.procs: dict[int, Proc] = {}
        self.server_pids: dict[int, int] = {}  # replica index (0 for a plain PS) -> pid
        self.store_pid: int | None = None
        self.produced = 0
        self.worker_pids: list[int] = []
        #: The PS is up only once an incarnation at least this new serves (set by each kill).
        self.next_epoch = 1
        self.t0 = time.time()
        self.chain = config.mode.startswith("chain")
        run_dir = os.path.abspath(config.run_dir)
        if os.path.isdir(run_dir) and os.listdir(run_dir):
            raise RunDirectoryError(
                f"run directory {run_dir} is not empty; pick a new one (a run never overwrites "
                "another's checkpoint)."
            )
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = config.run_dir = run_dir
        self.config_path = os.path.join(run_dir, "config.json")

    # -- processes -----------------------------------------------------------------------------
    def _spawn(self, role: str, *args: str) -> int:
        name = role if not args else f"{role}-{args[0]}"
        popen = spawn(
            role, self.config_path, *args, log_path=os.path.join(self.run_dir, f"{name}.log")
        )
        self.procs[popen.pid] = Proc(role, popen, time.time())
        return popen.pid

    def _reap(self, block_pid: int | None = None) -> None:
        for pid, proc in self.procs.items():
            if proc.exit_code is not None:
                continue
            flags = 0 if pid == block_pid else os.WNOHANG
            try:
                got, status, usage = os.wait4(pid, flags)
            except ChildProcessError:
                continue
            if got == pid:
                proc.exit_code = os.waitstatus_to_exitcode(status)
                proc.popen.returncode = proc.exit_code
                proc.cpu = usage.ru_utime + usage.ru_stime
                proc.ended = time.time()

    def _sample_memory(self) -> None:
        """Record each live child's peak resident set so far (VmHWM; Linux).

        ``ru_maxrss`` from ``wait4`` cannot be used: it keeps the high-water mark of the
        runner's own address space, which the child borrowed between fork and exec.
        """
        for pid, proc in self.procs.items():
            if proc.exit_code is None:
                proc.peak_kb = max(proc.peak_kb, _peak_rss_kb(pid))

    def _alive(self, pid: int) -> bool:
        self._reap()
        return self.procs[pid].exit_code is None

    def _log_tail(self, pid: int) -> str:
        proc = self.procs[pid]
        args = proc.popen.args
        name = proc.role if len(args) <= 5 else f"{proc.role}-{args[5]}"
        path = os.path.join(self.run_dir, f"{name}.log")
        try:
            with open(path) as handle:
                return "".join(handle.readlines()[-8:])
        except OSError:
            return ""

    def _start_store(self) -> str:
        port_file = os.path.join(self.run_dir, "store.port")
        popen = spawn("store", port_file, log_path=os.path.join(self.run_dir, "store.log"))
        self.procs[popen.pid] = Proc("store", popen, time.time())
        self.store_pid = popen.pid
        deadline = time.time() + 60
        while not os.path.exists(port_file):
            if not self._alive(popen.pid) or time.time() > deadline:
                raise StoreUnavailableError(
                    f"the embedded store process did not start: {self._log_tail(popen.pid)}"
                )
            time.sleep(0.02)
        with open(port_file) as handle:
            return f"127.0.0.1:{handle.read().strip()}"

    def _connect(self) -> RetryingStore:
        address = self.config.store_address
        assert address is not None
        try:
            return RetryingStore(
                client_factory(address), patience=self.config.store_patience, name="runner",
                address=address,
            )  # fmt: skip
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
        if self.chain:
            self.store.add(layout.CHAIN_COUNT, config.replicas)
        self.store.set(
            layout.HEAD, json.dumps({"key": layout.INITIAL, "cursors": cursors}).encode()
        )

    def _start_servers(self) -> None:
        if not self.chain:
            source = "store"  # the first start of every mode reads the initial weights there
            self.server_pids[0] = self._spawn("ps", source)
            return
        # All start loading at once; the head waits until the others listen (chain order).
        for index in range(1, self.config.replicas):
            self.server_pids[index] = self._spawn("replica", str(index), "follow")
        self.server_pids[0] = self._spawn("replica", "0", "head")

    def _wait_for(
        self, condition: Callable[[], bool], what: str, pid: int, limit: float = 120
    ) -> None:
        deadline = time.time() + limit
        while not condition():
            if not self._alive(pid):
                raise StalwartError(
                    f"process {pid} died while waiting for {what}:\n{self._log_tail(pid)}"
                )
            if time.time() > deadline:
                raise StalwartError(f"timed out waiting for {what}")
            self._sample_memory()
            time.sleep(0.01)

    def server_up(self) -> bool:
        """The newest PS incarnation has recovered and applied an update of its own (for the
        stateless PS that is the backlog), so a next kill hits a serving PS, not a recovery.
        A chain must also be whole again: ``replicas`` live members that hold the weights."""
        version = [int(part) for part in json.loads(self.store.get(layout.HEAD))["key"].split("/")]
        epoch = self.store.add(layout.EPOCH, 0)
        raw = self.store.get(layout.event(epoch)) if epoch >= 1 else None
        # Until the replacement has taken its epoch, the newest one is the killed incarnation's.
        if raw is None or version[0] != epoch or epoch < self.next_epoch:
            return False
        serving = (
            epoch == 1
            or version[1] > json.loads(raw)["version"]
            # Once the workers are done a recovered PS may have nothing left to apply: it is up.
            or (self._workers_finished() and self._drained())
        )
        return serving and (not self.chain or len(self._chain_copies()) >= self.config.replicas)

    def _workers_finished(self) -> bool:
        return bool(self.worker_pids) and all(not self._alive(p) for p in self.worker_pids)

    def _chain_copies(self) -> list[int]:
        """The live replicas from the head down the successor links that hold the weights."""
        head = self.store.get(layout.CHAIN_HEAD)
        if head is None:
            return []
        index = int(head)
        copies: list[int] = []
        while (
            index not in copies
            and self._alive(self.server_pids[index])
            and self.store.get(layout.chain_held(index)) is not None
        ):
            copies.append(index)
            successor = self.store.get(layout.chain_successor(index))
            if successor is None:
                break
            index = int(successor)
        return copies

    # -- failure injection ---------------------------------------------------------------------
    def _targets(self, targets: tuple[str, ...]) -> list[int]:
        if not self.chain:
            return [0]
        head = int(self.store.get(layout.CHAIN_HEAD))
        indices = [head]
        if "secondary" in targets:
            successor = self.store.get(layout.chain_successor(head))
            if successor is None:
                raise StalwartError("the head has no secondary to kill")
            indices.append(int(successor))
        return indices

    def kill(self, targets: tuple[str, ...]) -> list[int]:
        pids = [self.server_pids[i] for i in self._targets(targets)]
        self.next_epoch = self.store.add(layout.EPOCH, 0) + 1
        self._sample_memory()  # the last chance to see the victims' peak memory
        # Downstream first: a secondary that outlived its head by a moment could take over.
        for pid in reversed(pids):
            os.kill(pid, signal.SIGKILL)
        self.progress(f"  SIGKILL {targets} pid(s) {pids} at {self.produced} gradients")
        return pids

    def _spawn_spare(self) -> None:
        name = str(len(self.spares) + len(self.used_spares))
        self.spares.append((name, self._spawn("spare", name)))

    def _assign(self, role: str, *args: str) -> int:
        """Hand ``role`` to a ready spare process (the restart)."""
        name, pid = self.spares.pop(0)
        self._wait_for(lambda: self.store.get(layout.spare_ready(name)) is not None,
                       f"spare {name} to load", pid)  # fmt: skip
        self.store.set(layout.spare_role(name), json.dumps([role, *args]).encode())
        self.procs[pid].role = role
        self.used_spares.append((name, pid))
        return pid

    def restart(self, targets: tuple[str, ...]) -> None:
        if not self.chain:
            source = "checkpoint" if self.config.mode.startswith("checkpoint") else "store"
            self.server_pids[0] = self._assign("ps", source)
        else:
            for _ in targets:  # each killed replica comes back as a new tail
                index = self.store.add(layout.CHAIN_COUNT, 1) - 1
                self.server_pids[index] = self._assign("replica", str(index), "follow")
        self.progress(f"  restarted {targets}")

    # -- the run -------------------------------------------------------------------------------
    def evaluate(self) -> None:
        key = json.loads(self.store.get(layout.HEAD))["key"]
        if key == self._last_key:
            return
        blob = self.store.get(layout.state(key))
        if blob is None:
            return  # collected: the PS committed newer weights since we read the head
        header, weights = unpack(blob)
        self._last_key = key
        self._last_weights = weights
        unflatten_into(self.model, weights)
        acc = self.workload.evaluate(self.model)
        if acc is None:
            return
        self.timeline.append({
            "t": time.time() - self.t0, "accuracy": acc, "version": header["version"],
            "epoch": header["epoch"], "produced": self.produced,
        })  # fmt: skip

    def execute(self) -> RunResult:
        config = self.config
        if self.workload is None:
            self.workload = DigitsWorkload(config.hidden, config.batch_size)
        self._save_workload()
        if config.store_address is None:
            config.store_address = self._start_store()
        with open(self.config_path, "w") as handle:
            handle.write(config.to_json())
        try:
            self.store = self._connect()
            self._initialise_store()
            return self._train()
        finally:
            self._shutdown()

    def _save_workload(self) -> None:
        import cloudpickle

        path = os.path.join(self.run_dir, WORKLOAD_FILE)
        with open(path + ".tmp", "wb") as handle:
            cloudpickle.dump(self.workload, handle)
        os.replace(path + ".tmp", path)

    def _train(self) -> RunResult:
        config = self.config
        self.model = self.workload.model()
        self.timeline: list[dict] = []
        self._last_key = ""
        self._last_weights = torch.empty(0)
        # Every process loads (imports torch) at the same time; training starts when all are ready.
        self._start_servers()
        injector = FailureInjector(config.kills, self.kill, self.restart, self.server_up)
        self._recovered: set[int] = set()
        workers = self.worker_pids = [self._spawn("worker", str(w)) for w in range(config.workers)]
        self.spares: list[tuple[str, int]] = []
        self.used_spares: list[tuple[str, int]] = []
        # One ready spare per process the schedule will kill: no restart waits for an import.
        for _ in range(sum(len(k.targets) for k in config.kills)):
            self._spawn_spare()
        self._wait_for(self.server_up, "the parameter server to start", self.server_pids[0])
        for name, pid in self.spares:
            self._wait_for(lambda name=name: self.store.get(layout.spare_ready(name)) is not None,
                           f"spare {name} to load", pid)  # fmt: skip
        for w, pid in enumerate(workers):
            self._wait_for(lambda w=w: self.store.get(layout.ready(w)) is not None,
                           f"worker {w} to load", pid)  # fmt: skip
        self.store.set(layout.GO, b"1")
        self.t0 = injector.started = time.time()
        last_eval = last_progress = 0.0
        try:
            while True:
                self._reap()
                now = time.time()
                self.produced = sum(
                    int(v)
                    for v in self.store.get_many([layout.count(w) for w in range(config.workers)])
                )
                injector.poll(self.produced, now)
                if config.duration and now - self.t0 >= config.duration and not injector.pending:
                    self.store.set(layout.HALT, b"1")  # workers finish their current gradient
                if self.hook is not None:
                    self.hook(self)
                if now - last_eval >= EVAL_EVERY:
                    self._sample_memory()
                    self.evaluate()
                    last_eval = now
                if now - last_progress >= 5:
                    last_progress = now
                    acc = self.timeline[-1]["accuracy"] if self.timeline else float("nan")
                    self.progress(
                        f"  {config.mode}: {self.produced}/{config.total_gradients} "
                        f"gradients, accuracy {acc:.3f}, {now - self.t0:.0f}s"
                    )
                self._check_servers(injector)
                self._check_recovery(injector, now)
                # A kill whose trigger passed while the PS was down fires once it is up again,
                # even if the workers have finished by then (a stateless run can produce all
                # its gradients during an outage).
                if (
                    all(self.procs[p].exit_code is not None for p in workers)
                    and not injector.pending
                    and not injector.waiting
                ):
                    break
                time.sleep(0.01)
        except StoreUnavailableError as exc:
            self._store_lost(workers, exc)
        failed = [p for p in workers if self.procs[p].exit_code != 0]
        if failed:
            if any(self.procs[p].exit_code == 3 for p in failed):
                self._store_lost(workers, None)
            raise StalwartError(f"worker process(es) failed:\n{self._log_tail(failed[0])}")
        if injector.unfired():
            raise ConfigurationError(
                f"kill(s) {injector.unfired()} never fired: the run ended at {self.produced} "
                f"gradients, {time.time() - self.t0:.1f}s (gradients a stateful PS discards still "
                "count); schedule them earlier."
            )
        self.store.set(layout.STOP, b"1")
        head_pid = self._head_pid() if self.chain else self.server_pids[0]
        self._wait_for(self._drained, "the server to apply the last gradients", head_pid)
        wall = time.time() - self.t0
        # The head exits once drained; followers that nobody feeds any more are stopped later.
        self._wait_for(lambda: not self._alive(head_pid), "the server to exit", head_pid)
        self.evaluate()
        result = self._result(workers, injector.kills, wall)
        if self.inspect is not None:
            self.inspect(self, result)  # the store is still up: audits can read it
        return result

    def _drained(self) -> bool:
        """Every gradient pushed has been taken by the current PS (applied or discarded)."""
        counts = self.store.get_many([layout.count(w) for w in range(self.config.workers)])
        cursors = json.loads(self.store.get(layout.HEAD))["cursors"]
        return [int(c) for c in counts] == cursors

    def _head_pid(self) -> int:
        return self.server_pids[int(self.store.get(layout.CHAIN_HEAD))]

    @staticmethod
    def _killed(injector: FailureInjector) -> set[int]:
        return {pid for kill in injector.kills for pid in kill.pids}

    def _check_servers(self, injector: FailureInjector) -> None:
        killed = self._killed(injector)
        for pid in self.server_pids.values():
            proc = self.procs[pid]
            if proc.exit_code is not None and pid not in killed:
                raise StalwartError(f"a {proc.role} process exited unexpectedly "
                                    f"({proc.exit_code}):\n{self._log_tail(pid)}")  # fmt: skip

    def _check_recovery(self, injector: FailureInjector, now: float) -> None:
        """Every kill is followed by a recovery; fail with a clear error instead of hanging."""
        for number, kill in enumerate(injector.kills):
            if kill.killed_at is None or number in self._recovered:
                continue
            epoch = self.store.add(layout.EPOCH, 0)
            raw = self.store.get(layout.event(epoch))
            if raw is not None and json.loads(raw)["committed"] > kill.killed_at:
                self._recovered.add(number)
                continue
            if self.chain and not any(
                self._alive(pid) and self.store.get(layout.chain_held(index)) is not None
                for index, pid in self.server_pids.items()
            ):
                raise StalwartError(
                    f"the kill of {kill.event.targets} at {kill.produced} gradients left no live "
                    "replica holding the weights: chain replication cannot recover. Use more "
                    "replicas or let the chain re-form before the next kill."
                )
            if now - kill.killed_at > kill.event.downtime + RECOVERY_LIMIT:
                pid = self.server_pids[max(self.server_pids)]  # the newest server
                raise StalwartError(
                    f"no parameter server recovered within {RECOVERY_LIMIT:.0f}s of the restart "
                    f"after the kill at {kill.produced} gradients:\n{self._log_tail(pid)}"
                )

    def _store_lost(self, workers: list[int], cause: StoreUnavailableError | None) -> None:
        """The store vanished: let the workers finish retrying, keep the last committed weights."""
        deadline = time.time() + self.config.store_patience + 30
        while any(self.procs[p].exit_code is None for p in workers) and time.time() < deadline:
            self._reap()
            time.sleep(0.05)
        reports = self._reports(workers)
        retries = sum(r.get("retries", 0) for r in reports)
        saved = os.path.join(self.run_dir, "last-committed.pt")
        tmp = saved + ".tmp"
        torch.save({"head": self._last_key, "weights": self._last_weights}, tmp)
        os.replace(tmp, saved)
        errors = sorted({(r.get("error") or "").split(":")[0] for r in reports if r.get("error")})
        raise StoreUnavailableError(
            f"the store at {self.config.store_address} vanished mid-run "
            f"({cause or 'workers gave up'}); workers retried {retries} time(s) with backoff "
            f"and reported {errors}. The last committed weights ({self._last_key}) are saved in "
            f"{saved}; restart the store and the run."
        )

    def _reports(self, workers: list[int]) -> list[dict]:
        reports = []
        for w in range(len(workers)):
            path = os.path.join(self.run_dir, f"worker-{w}.json")
            if os.path.exists(path):
                with open(path) as handle:
                    reports.append(json.load(handle))
        return reports

    def _result(self, workers: list[int], kills: list[Kill], wall: float) -> RunResult:
        config = self.config
        reports = self._reports(workers)
        lineage = head_lineage(self.store)
        applied_ids = [i for record in lineage for i in record.ids]
        produced_ids = {(r["worker"], k) for r in reports for k, _, _ in r["pushed"]}
        result = RunResult(
            config, wall, self.t0, timeline=self.timeline, reports=reports, lineage=lineage
        )
        result.produced = len(produced_ids)
        result.applied = len(set(applied_ids))
        result.duplicates = len(applied_ids) - len(set(applied_ids))
        result.lost = len(produced_ids - set(applied_ids))
        result.updates = len(lineage)
        result.backlogs = [
            {"ref": r.ref, "gradients": len(r.ids), "workers": r.merged, "scale": r.scale}
            for r in lineage
            if r.merged
        ]
        epochs = self.store.add(layout.EPOCH, 0)
        for epoch in range(1, epochs + 1):
            raw = self.store.get(layout.event(epoch))
            if raw is not None:
                result.recoveries.append(json.loads(raw))
        for kill in kills:
            assert kill.killed_at is not None and kill.restarted_at is not None
            # Down until a PS has recovered and committed again (a chain takeover: at once).
            recovered = min(
                (e["committed"] for e in result.recoveries if e["committed"] > kill.killed_at),
                default=kill.restarted_at,
            )
            result.kills.append({
                "at_gradient": kill.event.at_gradient, "at_seconds": kill.event.at_seconds,
                "targets": list(kill.event.targets),
                "produced_at_kill": kill.produced, "killed": kill.killed_at - self.t0,
                "restarted": kill.restarted_at - self.t0, "recovered": recovered - self.t0,
                "pids": kill.pids, "deferred": kill.deferred,
                "due": None if kill.due_at is None else kill.due_at - self.t0,
            })  # fmt: skip
            result.produced_during_downtime += sum(
                kill.killed_at <= t <= recovered for r in reports for _, t, _ in r["pushed"]
            )
        result.worker_idle = [r["idle"] for r in reports]
        worker_procs = [self.procs[p] for p in workers]
        busy = sum(p.cpu for p in worker_procs)
        alive = sum((p.ended or time.time()) - p.started for p in worker_procs)
        result.worker_cpu_utilisation = busy / alive if alive else 0.0
        server_roles = ("ps", "replica")
        result.server_cpu = sum(p.cpu for p in self.procs.values() if p.role in server_roles)
        for role in ("ps", "replica", "worker", "store"):
            sizes = [p.peak_kb for p in self.procs.values() if p.role == role and p.peak_kb]
            if sizes:
                result.peak_rss_mb[role] = max(sizes) / 1024
        result.store_retries = sum(r["retries"] for r in reports)
        result.final_accuracy = self.timeline[-1]["accuracy"] if self.timeline else 0.0
        _, _, result.weights = head_state(self.store)
        if config.keep_gradients:
            result.weights_verified = torch.equal(replay(self.store, lineage), result.weights)
        return result

    def _shutdown(self) -> None:
        for pid, proc in self.procs.items():
            if proc.exit_code is None and proc.role != "store":
                _signal(pid, signal.SIGKILL)
        for pid, proc in self.procs.items():
            if proc.exit_code is None and proc.role != "store":
                self._reap(block_pid=pid)
        if self.store_pid is not None and self.procs[self.store_pid].exit_code is None:
            _signal(self.store_pid, signal.SIGTERM)
            _signal(self.store_pid, signal.SIGCONT)  # a test may have stopped it
            self._reap(block_pid=self.store_pid)


def _peak_rss_kb(pid: int) -> int:
    """The peak resident set of process ``pid`` in KiB (0 if unknown or already gone)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def run_training(
    config: PSConfig,
    hook: Callable[[Run], None] | None = None,
    progress: Callable[[str], None] | None = None,
    inspect: Callable[[Run, RunResult], None] | None = None,
    workload: Workload | None = None,
) -> RunResult:
    """Train with a parameter server as ``config`` says, with real processes; the measurements.

    Args:
        config: the run.
        hook: called on every monitor tick with the :class:`Run` (e.g. to make the store vanish).
        progress: receives status lines (pass ``print`` to see them).
        inspect: called with the :class:`Run` and the result before the store shuts down.
        workload: the model and data (default: the paper's CNN on digits, sized by ``config``).

    Example:
        >>> config = PSConfig(mode="stateless", steps=100, kills=[KillEvent(60, 2.0)])
        >>> result = run_training(config)  # doctest: +SKIP
        >>> result.lost, result.duplicates  # doctest: +SKIP
        (0, 0)
    """
    return Run(config, hook=hook, progress=progress, inspect=inspect, workload=workload).execute()


if __name__ == "__main__":  # pragma: no cover - a quick manual run
    print(run_training(PSConfig(run_dir=sys.argv[1]), progress=print).summary())
