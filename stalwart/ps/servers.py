"""The server side of a run: the PS (or the replica chain), its health, its kills and restarts.

The :class:`~stalwart.ps.failure.FailureInjector` decides when to kill and restart; this class
does it: SIGKILL the current server(s), and hand the role to a pre-started spare process after
the downtime. It also answers the questions the runner polls: is a server up and serving, has
every kill been followed by a recovery, has the server drained the queues.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

from stalwart.errors import StalwartError
from stalwart.ps import layout
from stalwart.ps.config import PSConfig
from stalwart.ps.failure import Kill
from stalwart.ps.processes import ProcessSupervisor, describe_exit, describe_log
from stalwart.ps.store import KeyValueStore

#: Seconds past a kill's downtime within which some server must have recovered and committed.
RECOVERY_LIMIT = 60.0


class ServerFleet:
    """The parameter server (index 0) or the chain replicas (by join index) of one run.

    Args:
        config: the run.
        store: the run's store.
        supervisor: starts and watches the processes.
        config_path: the run's ``config.json`` (every server process reads it).
        workers_finished: True once every worker process has exited.

    Example:
        >>> fleet = ServerFleet(config, store, supervisor, path, lambda: False)  # doctest: +SKIP
        >>> fleet.start(); fleet.kill(("ps",)); fleet.restart(("ps",))  # doctest: +SKIP
    """

    def __init__(
        self,
        config: PSConfig,
        store: KeyValueStore,
        supervisor: ProcessSupervisor,
        config_path: str,
        workers_finished: Callable[[], bool],
    ) -> None:
        self.config = config
        self.store = store
        self.supervisor = supervisor
        self.config_path = config_path
        self.workers_finished = workers_finished
        self.chain = config.mode.startswith("chain")
        #: Replica index (0 for a plain PS) -> pid.
        self.pids: dict[int, int] = {}
        #: The PS is up only once an incarnation at least this new serves (set by each kill).
        self.next_epoch = 1
        self.spares: list[tuple[str, int]] = []
        self.used_spares: list[tuple[str, int]] = []
        self._recovered: set[int] = set()

    def _start(self, role: str, *args: str) -> int:
        return self.supervisor.start(role, self.config_path, *args, name=f"{role}-{args[0]}")

    def start(self) -> None:
        """Start the PS, or every replica of the chain (the head waits until the others listen)."""
        if not self.chain:
            # The first start of every mode reads the initial weights from the store.
            self.pids[0] = self._start("ps", "store")
            return
        for index in range(1, self.config.replicas):
            self.pids[index] = self._start("replica", str(index), "follow")
        self.pids[0] = self._start("replica", "0", "head")

    def add_spare(self) -> None:
        """Pre-start a process that loads everything and waits to be given a server role."""
        name = str(len(self.spares) + len(self.used_spares))
        self.spares.append((name, self._start("spare", name)))

    def wait_until_ready(self) -> None:
        """Wait until the first server serves and every spare has loaded."""
        self.supervisor.wait_for(self.server_up, "the parameter server to start", self.pids[0])
        for name, pid in self.spares:
            self._wait_for_spare(name, pid)

    def _wait_for_spare(self, name: str, pid: int) -> None:
        ready = layout.spare_ready(name)
        self.supervisor.wait_for(
            lambda: self.store.get(ready) is not None, f"spare {name} to load", pid
        )

    # -- health --------------------------------------------------------------------------------
    def server_up(self) -> bool:
        """The newest PS incarnation has recovered and applied an update of its own (for the
        stateless PS that is the backlog), so a next kill hits a serving PS, not a recovery.
        A chain must also be whole again: ``replicas`` live members that hold the weights."""
        version = layout.parse_ref(json.loads(self.store.get(layout.HEAD))["key"])
        epoch = self.store.add(layout.EPOCH, 0)
        raw = self.store.get(layout.event(epoch)) if epoch >= 1 else None
        # Until the replacement has taken its epoch, the newest one is the killed incarnation's.
        if raw is None or version[0] != epoch or epoch < self.next_epoch:
            return False
        serving = (
            epoch == 1
            or version[1] > json.loads(raw)["version"]
            # Once the workers are done a recovered PS may have nothing left to apply: it is up.
            or (self.workers_finished() and self.drained())
        )
        return serving and (not self.chain or len(self._chain_copies()) >= self.config.replicas)

    def drained(self) -> bool:
        """Every gradient pushed has been taken by the current PS (applied or discarded)."""
        counts = self.store.get_many([layout.count(w) for w in range(self.config.workers)])
        cursors = json.loads(self.store.get(layout.HEAD))["cursors"]
        return [int(c) for c in counts] == cursors

    def head_pid(self) -> int:
        """The process serving as the PS now."""
        if not self.chain:
            return self.pids[0]
        return self.pids[int(self.store.get(layout.CHAIN_HEAD))]

    def _chain_copies(self) -> list[int]:
        """The live replicas from the head down the successor links that hold the weights."""
        head = self.store.get(layout.CHAIN_HEAD)
        if head is None:
            return []
        index = int(head)
        copies: list[int] = []
        while (
            index not in copies
            and self.supervisor.alive(self.pids[index])
            and self.store.get(layout.chain_held(index)) is not None
        ):
            copies.append(index)
            successor = self.store.get(layout.chain_successor(index))
            if successor is None:
                break
            index = int(successor)
        return copies

    def check_alive(self, killed: set[int]) -> None:
        """Fail with the server's log if one that was not killed has exited."""
        for pid in self.pids.values():
            proc = self.supervisor.procs[pid]
            if proc.exit_code is not None and pid not in killed:
                raise StalwartError(
                    f"a {proc.role} process exited unexpectedly "
                    f"({describe_exit(proc.exit_code)}); "
                    f"{describe_log(proc.log_path, self.supervisor.log_tail(pid))}"
                )

    def check_recovery(self, kills: list[Kill], now: float) -> None:
        """Every kill is followed by a recovery; fail with a clear error instead of hanging."""
        for number, kill in enumerate(kills):
            if kill.killed_at is None or number in self._recovered:
                continue
            raw = self.store.get(layout.event(self.store.add(layout.EPOCH, 0)))
            if raw is not None and json.loads(raw)["committed"] > kill.killed_at:
                self._recovered.add(number)
                continue
            if self.chain and not any(
                self.supervisor.alive(pid) and self.store.get(layout.chain_held(index)) is not None
                for index, pid in self.pids.items()
            ):
                raise StalwartError(
                    f"the kill of {kill.event.targets} at {kill.produced} gradients left no live "
                    "replica holding the weights: chain replication cannot recover. Use more "
                    "replicas or let the chain re-form before the next kill."
                )
            if now - kill.killed_at > kill.event.downtime + RECOVERY_LIMIT:
                pid = self.pids[max(self.pids)]  # the newest server
                raise StalwartError(
                    f"no parameter server recovered within {RECOVERY_LIMIT:.0f}s of the restart "
                    f"after the kill at {kill.produced} gradients:\n"
                    f"{self.supervisor.log_tail(pid)}"
                )

    # -- failure and restart -------------------------------------------------------------------
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
        """SIGKILL the servers ``targets`` names; their pids."""
        pids = [self.pids[i] for i in self._targets(targets)]
        self.next_epoch = self.store.add(layout.EPOCH, 0) + 1
        self.supervisor.sample_memory()  # the last chance to see the victims' peak memory
        # Downstream first: a secondary that outlived its head by a moment could take over.
        for pid in reversed(pids):
            os.kill(pid, signal.SIGKILL)
        return pids

    def restart(self, targets: tuple[str, ...]) -> None:
        """Replace the killed ``targets`` by spares: a PS recovers, a replica joins at the tail."""
        if not self.chain:
            source = "checkpoint" if self.config.mode.startswith("checkpoint") else "store"
            self.pids[0] = self._assign("ps", source)
            return
        for _ in targets:  # each killed replica comes back as a new tail
            index = self.store.add(layout.CHAIN_COUNT, 1) - 1
            self.pids[index] = self._assign("replica", str(index), "follow")

    def _assign(self, role: str, *args: str) -> int:
        """Hand ``role`` to a ready spare process (the restart)."""
        name, pid = self.spares.pop(0)
        self._wait_for_spare(name, pid)
        self.store.set(layout.spare_role(name), json.dumps([role, *args]).encode())
        self.supervisor.procs[pid].role = role
        self.used_spares.append((name, pid))
        return pid
