"""Materializers: a consistent snapshot of training state onto disk at least main-thread cost.

:class:`ForkMaterializer` is Flor's background materialization (thesis ch. 4): the training process
forks; fork's copy-on-write *is* the snapshot on CPU, so the parent pays only for ``fork()``
and goes back to training while the child serializes, writes to a temp name, renames, and exits.
CUDA tensors are first copied to pinned host memory (the child never touches CUDA). Small
checkpoints are copied into a buffer and written many per fork, as Flor batches small objects.

:class:`InlineMaterializer` writes on the calling thread, for platforms without ``fork``.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from stalwart.durable import WrittenFile
from stalwart.errors import ConfigurationError
from stalwart.hindsight.checkpoint_file import write_checkpoint

#: Training time lost to a background writer, as a fraction of the writer's own inline write time.
CONTENTION_FACTOR = 0.7


@dataclass
class WriteJob:
    """One object to persist at ``path``; ``on_written`` runs in the writing process afterwards."""

    obj: Any
    path: Path
    on_written: Callable[[WrittenFile], None] | None = None
    submitted_at: float = field(default_factory=time.monotonic)


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors inside a nested container (dicts, lists, tuples)."""
    return sum(
        leaf.numel() * leaf.element_size()
        for leaf in pytree.tree_leaves(obj)
        if isinstance(leaf, torch.Tensor)
    )


def host_snapshot(obj: Any) -> Any:
    """Copy CUDA tensors to pinned host memory so a forked child can serialize them.

    CPU tensors are returned as they are: after ``fork`` the child sees them frozen by
    copy-on-write, which is exactly the snapshot needed, at no copying cost.
    """
    if not torch.cuda.is_available():
        return obj

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_cuda:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    snapshot = pytree.tree_map_only(torch.Tensor, to_host, obj)
    torch.cuda.synchronize()
    return snapshot


def _run_jobs(jobs: list[WriteJob]) -> None:
    for job in jobs:
        written = write_checkpoint(job.obj, job.path)
        if job.on_written is not None:
            job.on_written(written)


class Materializer(ABC):
    """Persists :class:`WriteJob`\\ s; ``submit`` returns the seconds it cost the calling thread."""

    name: str

    def __init__(self) -> None:
        self.failures: list[str] = []

    @abstractmethod
    def submit(self, job: WriteJob) -> float: ...

    @abstractmethod
    def probe_cost(self, nbytes: int, directory: Path) -> float:
        """Measure, without writing a checkpoint, what submitting ``nbytes`` of state would cost."""

    @property
    def busy(self) -> bool:
        """Whether background writes may be competing with training right now."""
        return False

    def poll(self) -> None:  # noqa: B027 - nothing runs in the background by default
        """Collect finished background work without blocking."""

    def close(self) -> None:  # noqa: B027
        """Write everything still pending and wait for it."""


class InlineMaterializer(Materializer):
    """Serializes and writes on the calling thread (the no-fork fallback)."""

    name = "inline"

    def probe_cost(self, nbytes: int, directory: Path) -> float:
        probe_bytes = max(1, min(nbytes, 8 << 20))
        probe = directory / f".stalwart-probe-{os.getpid()}"
        written = write_checkpoint(torch.empty(probe_bytes, dtype=torch.uint8), probe)
        probe.unlink()
        return written.seconds * nbytes / probe_bytes

    def submit(self, job: WriteJob) -> float:
        start = time.perf_counter()
        _run_jobs([host_snapshot_job(job)])
        return time.perf_counter() - start


def host_snapshot_job(job: WriteJob) -> WriteJob:
    return WriteJob(host_snapshot(job.obj), job.path, job.on_written, job.submitted_at)


class ForkMaterializer(Materializer):
    """Writes checkpoints from forked children while the parent keeps training.

    Args:
        max_children: live children at most; a submit beyond it waits for the oldest (and that
            wait counts as main-thread cost). Flor never saw more than two.
        small_bytes: checkpoints with fewer tensor bytes than this are copied into a buffer
            instead of forking at once; the buffer is written by a single child. Below ~16 MB a
            copy (~1 ms/MB) is cheaper than a fork (~20 ms in a torch process) plus the
            copy-on-write faults it causes (~0.7 ms/MB).
        max_buffered: flush the buffer once it holds this many objects (Flor used 5000).
        max_buffer_bytes: flush the buffer once its copies hold this many tensor bytes.
        max_delay: flush the buffer once its oldest object waited this many seconds, which bounds
            what a crash of the training process can lose.

    Example::

        materializer = ForkMaterializer()
        cost = materializer.submit(WriteJob(model.state_dict(), Path("runs/epoch=0.ckpt")))
        ...  # keep training; the child writes in the background
        materializer.close()
    """

    name = "fork"

    def __init__(
        self,
        max_children: int = 2,
        small_bytes: int = 16 << 20,
        max_buffered: int = 5000,
        max_buffer_bytes: int = 64 << 20,
        max_delay: float = 10.0,
    ) -> None:
        super().__init__()
        if not hasattr(os, "fork"):
            raise ConfigurationError(
                "this platform has no fork(); use materializer='inline' instead."
            )
        if max_children < 1:
            raise ConfigurationError(f"max_children={max_children} must be at least 1.")
        self.max_children = max_children
        self.small_bytes = small_bytes
        self.max_buffered = max_buffered
        self.max_buffer_bytes = max_buffer_bytes
        self._buffer_bytes = 0
        self.max_delay = max_delay
        self._children: dict[int, list[str]] = {}
        self._buffer: list[WriteJob] = []
        self.forks = 0
        #: Seconds per byte of writing a small checkpoint (fsyncs included), measured.
        self._write_rate: float | None = None
        #: The buffered checkpoints' writes already charged to their submits (see ``submit``).
        self.prepaid = 0.0
        # A child must not be the first to import what torch.save needs: another thread of the
        # parent may have held the import lock at fork time.
        torch.save({"warm": torch.zeros(1)}, _NullWriter())

    def probe_cost(self, nbytes: int, directory: Path) -> float:
        """A small state costs a copy into the buffer; a large one a fork (which grows with the
        process's mapped memory), the copy-on-write faults it causes and the child's competition
        for the machine. Measured here, now."""
        if nbytes < self.small_bytes:
            state = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            start = time.perf_counter()
            copy.deepcopy(state)
            return time.perf_counter() - start + self._write_share(nbytes, directory)
        # Copy-on-write faults are the larger part: every page the next optimizer step writes is
        # copied while a child holds it. Measure them on a probe buffer, scale to the state.
        probe_bytes = max(1, min(nbytes, 16 << 20))
        probe = torch.ones(probe_bytes, dtype=torch.uint8)
        read_end, write_end = os.pipe()
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.read(read_end, 1)
            os._exit(0)
        fork_cost = time.perf_counter() - start
        start = time.perf_counter()
        probe.add_(1)
        shared_write = time.perf_counter() - start
        start = time.perf_counter()
        probe.add_(1)
        private_write = time.perf_counter() - start
        os.write(write_end, b"x")
        os.waitpid(pid, 0)
        os.close(read_end)
        os.close(write_end)
        copy_on_write = max(shared_write - private_write, 0.0) * nbytes / probe_bytes
        # The child's serialize + checksum + fsync competes with training for cores and memory
        # bandwidth; measured side by side (benchmarks/record_overhead.py, 271 MB) that costs
        # training about 0.7x the time of writing the same state inline.
        contention = CONTENTION_FACTOR * InlineMaterializer().probe_cost(nbytes, directory)
        return fork_cost + copy_on_write + contention

    @property
    def busy(self) -> bool:
        return bool(self._children)

    @property
    def live_children(self) -> int:
        return len(self._children)

    def submit(self, job: WriteJob) -> float:
        start = time.perf_counter()
        self.poll()
        nbytes = tensor_bytes(job.obj)
        if nbytes < self.small_bytes:
            self._buffer.append(
                WriteJob(copy.deepcopy(host_snapshot(job.obj)), job.path, job.on_written)
            )
            self._buffer_bytes += nbytes
            # A buffered checkpoint is not written yet, but it will be: by a child, or at close
            # while the caller waits. Its write is charged now, so the policy sees what it costs
            # (close charges only what the writes took beyond this).
            share = self._write_share(nbytes, job.path.parent)
            self.prepaid += share
            if (
                len(self._buffer) >= self.max_buffered
                or self._buffer_bytes >= self.max_buffer_bytes
                or time.monotonic() - self._buffer[0].submitted_at >= self.max_delay
            ):
                self._fork(self._take_buffer())
            return time.perf_counter() - start + share
        self._fork([*self._take_buffer(), host_snapshot_job(job)])
        return time.perf_counter() - start

    def _write_share(self, nbytes: int, directory: Path) -> float:
        """Estimated seconds to write ``nbytes`` as a checkpoint, from one measured write."""
        if self._write_rate is None:
            probe_bytes = max(1, min(nbytes, 8 << 20))
            self._write_rate = InlineMaterializer().probe_cost(probe_bytes, directory) / probe_bytes
        return self._write_rate * nbytes

    def poll(self) -> None:
        for pid in list(self._children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self._reaped(pid, status)

    def close(self) -> None:
        if self._buffer:
            # The caller waits for this write anyway: writing it here, while the children
            # finish theirs, saves the fork and the child's start; in threads, because most of
            # a small checkpoint's write is its fsyncs, which overlap.
            jobs = self._take_buffer()
            with ThreadPoolExecutor(max_workers=min(8, len(jobs))) as pool:
                written = list(pool.map(lambda job: write_checkpoint(job.obj, job.path), jobs))
            for job, file in zip(jobs, written, strict=True):  # the index: one writer at a time
                if job.on_written is not None:
                    job.on_written(file)
        for pid in list(self._children):
            _, status = os.waitpid(pid, 0)
            self._reaped(pid, status)

    def _take_buffer(self) -> list[WriteJob]:
        jobs, self._buffer = self._buffer, []
        self._buffer_bytes = 0
        self.prepaid = 0.0
        return jobs

    def _reaped(self, pid: int, status: int) -> None:
        paths = self._children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            self.failures.append(
                f"background writer {pid} exited with {code}; not written: {', '.join(paths)}"
            )

    def _fork(self, jobs: list[WriteJob]) -> None:
        while len(self._children) >= self.max_children:
            oldest = next(iter(self._children))
            _, status = os.waitpid(oldest, 0)
            self._reaped(oldest, status)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: write, then leave without running any of the parent's exit code
            code = 1
            try:
                # Ctrl-C, or a scheduler's SIGTERM to the whole process group, must not tear the
                # checkpoint in flight: the write finishes (SIGKILL still ends it; the temp name
                # keeps that harmless).
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                os.nice(10)  # yield the cores to training when they are contended
                torch.set_num_threads(1)
                _run_jobs(jobs)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        self.forks += 1
        self._children[pid] = [str(job.path) for job in jobs]


class _NullWriter:
    def write(self, data) -> int:
        return len(memoryview(data))

    def flush(self) -> None:
        pass


def make_materializer(kind: str | Materializer) -> Materializer:
    """``"fork"`` (default where available), ``"inline"``, or a ready instance."""
    if isinstance(kind, Materializer):
        return kind
    if kind == "fork":
        return ForkMaterializer()
    if kind == "inline":
        return InlineMaterializer()
    raise ConfigurationError(
        f"materializer={kind!r} is not known: pass 'fork' (background, default) or 'inline'."
    )
