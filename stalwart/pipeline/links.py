"""A worker's process groups of one generation: point-to-point messages and per-stage all-reduce.

Every generation (a membership agreed after a failure) gets fresh groups under a fresh
``PrefixStore`` prefix. Any error of a send, receive or all-reduce becomes :class:`PeerFailure`:
the worker then drops the groups (:meth:`PeerLinks.drop`) — closing their sockets wakes every
rank blocked on this one — and joins the next generation's rendezvous.

Message tags encode (kind, stage, micro-batch), so one pair of ranks can have several messages
in flight (gloo matches by tag).
"""

from __future__ import annotations

import concurrent.futures
import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store

from stalwart.pipeline import keys

ACT, GRAD, REPLICA = 0, 1, 2


class PeerFailure(Exception):
    """A peer stopped answering (its process died, or it abandoned the group).

    Internal control flow of the worker: it is always caught there and turned into a
    rendezvous, never raised to a caller of the pipeline.
    """


def tag(kind: int, stage: int, mb: int) -> int:
    """The message tag of an activation, gradient or replica gradient of ``(stage, mb)``."""
    return (kind * 256 + stage) * 65536 + mb


class PeerLinks:
    """The groups of the current generation, and the sends not yet known to be delivered.

    Args:
        store: the run's store (the groups rendezvous under a per-generation prefix of it).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL).
        timeout: seconds an operation waits for a silent peer.
        ranks: how many ranks the run has. On CUDA with fewer GPUs than ranks, NCCL cannot
            be used (it refuses two ranks on one GPU), so messages go through gloo staged in
            host memory: slower, but a single-GPU machine can run (and debug) the pipeline.
    """

    def __init__(self, store: Store, device: torch.device, timeout: float, ranks: int = 1) -> None:
        self.store = store
        self.device = device
        self.host_staged = device.type == "cuda" and torch.cuda.device_count() < ranks
        self.timeout = datetime.timedelta(seconds=timeout)
        self.members: list[int] = []
        self.gen = 0
        self.pg: Any = None
        self.pending: list[tuple[Any, int]] = []
        self._groups: dict[tuple[int, int], Any] = {}
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recv-wait")

    @property
    def connected(self) -> bool:
        return self.pg is not None

    def connect(self, gen: int, members: list[int], rank: int) -> None:
        """Form generation ``gen``'s point-to-point group of ``members``."""
        self.gen, self.members = gen, list(members)
        try:
            self.pg = self._new_group(keys.group(gen), members.index(rank), len(members))
        except RuntimeError as exc:
            raise PeerFailure(f"forming generation {gen}: {exc}") from None

    def drop(self) -> None:
        """Drop every reference to the groups: their destructors close the sockets, which
        wakes any peer still blocked on this rank ("Connection closed by peer")."""
        self.pending = []
        self.pg = None
        self._groups = {}

    def _new_group(self, prefix: str, rank: int, size: int) -> Any:
        """Gloo on CPU; NCCL on GPUs. NCCL matches point-to-point messages per pair in posting
        order, not by tag, and a dead peer does not fail pending NCCL operations promptly:
        detection then rests on the agent's ``dead/<rank>`` report and ``failure_timeout``."""
        store = PrefixStore(prefix, self.store)
        if self.device.type == "cuda" and not self.host_staged:
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return ProcessGroupNCCL(store, rank, size, options)
        return ProcessGroupGloo(store, rank, size, self.timeout)

    def recv(
        self, t: torch.Tensor, src: int, tg: int, fill: Callable[[], bool] | None = None
    ) -> None:
        """Blocking receive into ``t``. With ``fill`` (one slice of idle work; False once there
        is none), that work runs while the message is outstanding (the bubble): a gloo
        receive only reports completion through ``wait()``, so a helper thread waits (without
        the GIL) and this thread polls it between slices."""
        error = None
        into = torch.empty(t.shape, dtype=t.dtype) if self.host_staged else t
        try:
            work = self.pg.recv([into], self.members.index(src), tg)
            if fill is None:
                work.wait()
            else:
                arrived = self._waiter.submit(work.wait)
                while not arrived.done() and fill():
                    pass
                error = arrived.exception()
        except RuntimeError as exc:
            error = exc
        if error is None:
            if self.host_staged:
                t.copy_(into)
            return
        # A message only: the exception's traceback would keep this frame, and with it the
        # group's sockets, alive — and closing them is what wakes blocked peers.
        message = str(error)
        del error
        raise PeerFailure(f"recv from rank {src}: {message}")

    def isend(self, t: torch.Tensor, dst: int, tg: int) -> None:
        """Post a send; :meth:`wait_sends` waits for it."""
        try:
            out = _host_copy(t) if self.host_staged else t.contiguous()
            self.pending.append((self.pg.send([out], self.members.index(dst), tg), dst))
        except RuntimeError as exc:
            raise PeerFailure(f"send to rank {dst}: {exc}") from None

    def wait_sends(self) -> None:
        for work, dst in self.pending:
            try:
                work.wait()
            except RuntimeError as exc:
                raise PeerFailure(f"send to rank {dst}: {exc}") from None
        self.pending = []

    def allreduce(self, tensor: torch.Tensor, stage: int, peers: Sequence[int], rank: int) -> None:
        """Sum ``tensor`` in place over ``peers`` (the owners of ``stage`` in every pipeline)."""
        try:
            staged = _host_copy(tensor) if self.host_staged else tensor
            self._group(stage, peers, rank).allreduce([staged]).wait()
            if self.host_staged:
                tensor.copy_(staged)
        except RuntimeError as exc:
            raise PeerFailure(f"all-reduce of stage {stage}: {exc}") from None

    def _group(self, stage: int, peers: Sequence[int], rank: int) -> Any:
        key = (self.gen, stage)
        if key not in self._groups:
            self._groups = {k: g for k, g in self._groups.items() if k[0] == self.gen}
            try:
                self._groups[key] = self._new_group(
                    keys.group(self.gen, stage), list(peers).index(rank), len(peers)
                )
            except RuntimeError as exc:
                raise PeerFailure(f"forming the all-reduce group of stage {stage}: {exc}") from None
        return self._groups[key]


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` in host memory (always a copy, also of a CPU tensor)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())
