"""The runner's child processes: start each role as a real OS process, reap it, stop it.

Separate processes (not threads) so the failure injector's SIGKILL is a real crash: memory gone,
sockets closed by the kernel, nothing flushed. Every child is reaped with ``os.wait4`` so its
CPU time is known even when it was killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import stalwart
from stalwart.errors import StalwartError, StoreUnavailableError
from stalwart.forking import describe_exit
from stalwart.ps.resources import peak_rss_kb

#: The parent's ``sys.path`` as JSON, so a child can unpickle a workload defined in a user's
#: module or script directory.
SYS_PATH_ENV = "STALWART_PS_SYS_PATH"
#: The runner's pid: a child whose parent is already someone else exits at once.
PARENT_ENV = "STALWART_PS_PARENT"
#: The directory that holds the ``stalwart`` package, so a child imports the same copy.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(stalwart.__file__)))
#: Seconds the embedded store may take to publish its port.
STORE_START_LIMIT = 60.0


def describe_log(log_path: str, tail: str) -> str:
    """The last lines of a child's log under its path, or that it is empty (a process killed by
    a signal often writes nothing)."""
    if not tail.strip():
        return f"its log {log_path} is empty"
    return f"last lines of {log_path}:\n{tail.rstrip()}"


def spawn(role: str, *args: str, log_path: str) -> subprocess.Popen:
    """Start ``python -m stalwart.ps.launch role *args`` whose output goes to ``log_path``."""
    python_path = [PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(
        os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(python_path),
        **{PARENT_ENV: str(os.getpid()), SYS_PATH_ENV: json.dumps(sys.path)},
    )  # fmt: skip
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its lifetime
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "stalwart.ps.launch", role, *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    finally:
        log.close()


@dataclass
class ChildProcess:
    """One child of the runner and what is known about it (filled in as it runs and ends)."""

    role: str
    popen: subprocess.Popen
    started: float
    log_path: str
    exit_code: int | None = None
    #: User + system CPU seconds (known once reaped).
    cpu: float = 0.0
    #: Peak resident set seen so far, KiB.
    peak_kb: int = 0
    ended: float | None = None


class ProcessSupervisor:
    """Start, reap, watch and stop the children of one run, each logging to ``run_dir``.

    Args:
        run_dir: where each child's ``<name>.log`` goes.

    Example:
        >>> supervisor = ProcessSupervisor("run")  # doctest: +SKIP
        >>> pid = supervisor.start("worker", "run/config.json", "0")  # doctest: +SKIP
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.procs: dict[int, ChildProcess] = {}

    def start(self, role: str, *args: str, name: str | None = None) -> int:
        """Start ``role`` (its log: ``<name>.log``, default the role); its pid."""
        log_path = os.path.join(self.run_dir, f"{name or role}.log")
        popen = spawn(role, *args, log_path=log_path)
        self.procs[popen.pid] = ChildProcess(role, popen, time.time(), log_path)
        return popen.pid

    def reap(self, block_pid: int | None = None) -> None:
        """Collect every child that has exited (waiting for ``block_pid``)."""
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

    def alive(self, pid: int) -> bool:
        self.reap()
        return self.procs[pid].exit_code is None

    def sample_memory(self) -> None:
        """Record each live child's peak resident set so far (VmHWM; Linux).

        ``ru_maxrss`` from ``wait4`` cannot be used: it keeps the high-water mark of the
        runner's own address space, which the child borrowed between fork and exec.
        """
        for pid, proc in self.procs.items():
            if proc.exit_code is None:
                proc.peak_kb = max(proc.peak_kb, peak_rss_kb(pid))

    def log_tail(self, pid: int, lines: int = 8) -> str:
        """The last ``lines`` lines of the child's log ("" if unreadable)."""
        try:
            with open(self.procs[pid].log_path) as handle:
                return "".join(handle.readlines()[-lines:])
        except OSError:
            return ""

    def wait_for(
        self, condition: Callable[[], bool], what: str, pid: int, limit: float = 120
    ) -> None:
        """Poll ``condition`` until it holds; fail if process ``pid`` dies or ``limit`` passes."""
        deadline = time.time() + limit
        while not condition():
            if not self.alive(pid):
                if condition():  # it ended just after the check: waiting for its exit, say
                    return
                proc = self.procs[pid]
                raise StalwartError(
                    f"process {pid} died while waiting for {what} "
                    f"({describe_exit(proc.exit_code)}); "
                    f"{describe_log(proc.log_path, self.log_tail(pid))}"
                )
            if time.time() > deadline:
                raise StalwartError(f"timed out waiting for {what}")
            self.sample_memory()
            time.sleep(0.01)

    def start_store(self) -> tuple[int, str]:
        """Start the embedded store (:mod:`stalwart.store_host`); its pid and address."""
        port_file = os.path.join(self.run_dir, "store.port")
        pid = self.start("store", port_file)
        deadline = time.time() + STORE_START_LIMIT
        while not os.path.exists(port_file):
            if not self.alive(pid) or time.time() > deadline:
                raise StoreUnavailableError(
                    f"the embedded store process did not start: {self.log_tail(pid)}"
                )
            time.sleep(0.02)
        with open(port_file) as handle:
            return pid, f"127.0.0.1:{handle.read().strip()}"

    def shutdown(self) -> None:
        """SIGKILL every live child but the store, reap them, then stop the store (SIGTERM)."""
        others = [pid for pid, p in self.procs.items() if p.role != "store"]
        for pid in others:
            if self.procs[pid].exit_code is None:
                _signal(pid, signal.SIGKILL)
        for pid in others:
            if self.procs[pid].exit_code is None:
                self.reap(block_pid=pid)
        for pid, proc in self.procs.items():
            if proc.role == "store" and proc.exit_code is None:
                _signal(pid, signal.SIGTERM)
                _signal(pid, signal.SIGCONT)  # a test may have stopped it
                self.reap(block_pid=pid)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
