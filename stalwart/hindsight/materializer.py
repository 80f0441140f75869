"""Materializers: a consistent snapshot of training state onto disk at least main-thread cost.

:class:`ForkMaterializer` is Flor's background materialization (thesis ch. 4): the training process
forks; fork's copy-on-write *is* the snapshot on CPU, so the parent pays only for ``fork()``
and goes back to training while the child serializes, writes to a temp name, renames, and exits.
CUDA tensors are first copied to pinned host memory (the child never touches CUDA). A fork is not
free, though: its copy-on-write faults land on the next optimizer step, and afterwards every page
of the process faults once more. So the same materializer can instead copy the state and hand the
copy to a writer thread: the default for CPU state (measured cheaper at every size); in a process
using CUDA, both are measured before the run's first checkpoint and the cheaper one is taken.
Where training leaves the writer thread no core, CPU state is instead serialized on the training
thread and only made durable (fsynced, renamed) by the writer thread: there the thread's
serialization would take the cores from training anyway, and cost it twice over.

:class:`InlineMaterializer` writes on the calling thread, for platforms without ``fork``.
"""

from __future__ import annotations

import copy
import math
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from stalwart import durable
from stalwart.durable import WrittenFile
from stalwart.errors import ConfigurationError
from stalwart.forking import fork_child
from stalwart.hindsight.checkpoint_file import DIRECT_WRITE_BYTES, tensor_bytes, write_checkpoint


@dataclass
class WriteJob:
    """One object to persist at ``path``; ``on_written`` runs in the writing process afterwards.

    ``staged``: ``obj`` is the checkpoint already serialized, a
    :class:`stalwart.durable.ArchiveBuffer` (:func:`stalwart.durable.serialize_torch`); the
    writer only puts it on disk.
    """

    obj: Any
    path: Path
    on_written: Callable[[WrittenFile], None] | None = None
    staged: bool = False


def host_snapshot(obj: Any) -> Any:
    """Copy CUDA tensors to pinned host memory so a forked child can serialize them.

    CPU tensors are returned as they are: after ``fork`` the child sees them frozen by
    copy-on-write, which is exactly the snapshot needed, at no copying cost.
    """
    if not torch.cuda.is_initialized():  # no CUDA tensor can exist (and this check is cheap)
        return obj
    copied = False

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal copied
        if not tensor.is_cuda:
            return tensor
        copied = True
        return _pinned_copy(tensor)

    snapshot = pytree.tree_map_only(torch.Tensor, to_host, obj)
    if copied:
        torch.cuda.synchronize()
    return snapshot


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor's copy into fresh pinned host memory, queued (synchronize before use)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def host_copy(obj: Any) -> Any:
    """A copy of ``obj`` that later in-place changes to the original cannot reach: CUDA tensors
    copied once into pinned host memory, CPU tensors cloned, everything else deep-copied.

    Tensors that share storage (tied weights, views) share it in the copy too, as with
    ``copy.deepcopy``, so the written file is the size the original would write.
    """
    return _copy_to_host(obj)[0]


def _copy_to_host(obj: Any) -> tuple[Any, bool]:
    """:func:`host_copy`'s copy, and whether any of it came from CUDA tensors."""
    copier = _HostCopier()
    try:
        copied = copier.copy(obj)
    except RecursionError:  # a container that holds itself: deepcopy's memo handles cycles
        return copy.deepcopy(host_snapshot(obj)), False
    if copier.from_cuda:
        torch.cuda.synchronize()
    return copied, copier.from_cuda


#: Leaves a copy may share with the original: nothing can change them in place.
_IMMUTABLE = frozenset(
    {int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device}
)


class _HostCopier:
    """``copy.deepcopy`` made fast for what checkpoints hold: plain dicts, lists and tuples of
    numbers, strings and dense tensors.

    ``Tensor.__deepcopy__`` is Python code that costs ~30 us a tensor, and it and deepcopy's
    per-object dispatch were most of a small checkpoint's main-thread cost (1.1 ms for the
    159 leaves of a 0.1 MB Lightning checkpoint; 0.2 ms this way). Anything this does not know
    (tensor subclasses, tensors that need grad, sparse or quantized tensors, other objects)
    goes through ``copy.deepcopy`` with the same memo.
    """

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}  # original storage's address: copy
        self.from_cuda = False

    def copy(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _IMMUTABLE:
            return obj
        known = self.memo.get(id(obj))
        if known is not None:
            return known
        if kind is dict:
            new: Any = {key: self.copy(value) for key, value in obj.items()}
        elif kind is list:
            new = [self.copy(value) for value in obj]
        elif kind is tuple:
            new = tuple([self.copy(value) for value in obj])
        elif kind is OrderedDict:  # a state_dict, whose _metadata attribute load_state_dict reads
            new = OrderedDict((key, self.copy(value)) for key, value in obj.items())
            new.__dict__.update(self.copy(vars(obj)))
        elif kind is torch.Tensor and _plain_tensor(obj):
            new = self._tensor(obj)
        else:
            return copy.deepcopy(obj, self.memo)
        self.memo[id(obj)] = new
        return new

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_cuda:
            self.from_cuda = True
            return _pinned_copy(tensor)
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        copied = self.storages.get(address) if storage.nbytes() else None
        if copied is None:
            if tensor.is_contiguous() and tensor.nbytes == storage.nbytes():
                new = tensor.clone()
                self.storages[address] = new.untyped_storage()
                return new
            copied = self.storages[address] = storage.clone()
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(copied, tensor.storage_offset(), tensor.shape, tensor.stride())


class _Mismatch(Exception):
    """``obj`` does not have the structure of the copy being refilled."""


def refill_copy(into: Any, obj: Any) -> Any | None:
    """What :func:`host_copy` returns for ``obj``, written into the tensors of ``into``, an
    earlier copy nothing uses any more; None where ``obj``'s structure differs from it (other
    containers or keys, tensors of other shapes, dtypes or storage sharing, objects only
    ``copy.deepcopy`` copies): then take a fresh copy.

    The writer thread's copies of CUDA state go into the last one's pinned buffers: pinning
    fresh host memory was most of a GPU checkpoint's cost (138 ms for 250 MB on an H100, the
    copy itself 4.6 ms; docs/gpu.md). A CPU state's copies stay fresh: copies into the last
    one's buffers took the training thread 2-3x less time at 10-100 MB, but made whole fits
    no faster at 1 MB and slower at 100 MB (docs/measurements/hindsight.md).
    """
    refiller = _Refiller()
    try:
        refilled = refiller.fill(into, obj)
    except (_Mismatch, RecursionError):  # (a container that holds itself: host_copy copes)
        refilled = None
    if refiller.from_cuda:  # (copies already queued into buffers about to be dropped, too)
        torch.cuda.synchronize()
    return refilled


class _Refiller:
    """A walk of an earlier copy and a new state side by side: containers rebuilt, immutable
    leaves taken, plain tensors copied into the earlier copy's tensors. Where the two differ, a
    part that holds only plain data (numbers, strings: a list of recent costs that grew, a key
    the earlier copy lacked) is copied afresh; anything else is a mismatch, left to a fresh copy
    of the whole."""

    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}
        self.storages: dict[int, int] = {}  # the state's storage address: the copy's
        self.claimed: set[int] = set()  # the copy's storages already paired
        self.from_cuda = False
        self.fresh = _HostCopier()

    def fill(self, into: Any, obj: Any) -> Any:
        if type(obj) in _IMMUTABLE:
            return obj
        new = self.memo.get(id(obj))  # (an object met twice is one object in the copy too)
        if new is None:
            try:
                new = self._fill(into, obj, type(obj))
            except _Mismatch:
                new = self._fresh(obj)
            self.memo[id(obj)] = new
        return new

    def _fill(self, into: Any, obj: Any, kind: type) -> Any:
        if kind is not type(into):
            raise _Mismatch
        if kind is dict or kind is OrderedDict:
            new: Any = kind(
                (key, self.fill(into[key], value) if key in into else self._fresh(value))
                for key, value in obj.items()
            )
            if kind is OrderedDict:  # a state_dict's _metadata, as _HostCopier keeps it
                new.__dict__.update(self.fill(vars(into), vars(obj)))
            return new
        if kind is list or kind is tuple:
            if len(obj) != len(into):
                raise _Mismatch
            return kind([self.fill(old, value) for old, value in zip(into, obj, strict=True)])
        if kind is torch.Tensor and _plain_tensor(obj):
            return self._tensor(into, obj)
        raise _Mismatch

    def _fresh(self, obj: Any) -> Any:
        """A part the earlier copy has no counterpart of: copied afresh if it is plain data."""
        if not _plain_data(obj):
            raise _Mismatch
        return self.fresh.copy(obj)

    def _tensor(self, into: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        storage, target = tensor.untyped_storage(), into.untyped_storage()
        if (
            into.is_cuda
            or into.shape != tensor.shape
            or into.dtype != tensor.dtype
            or into.stride() != tensor.stride()
            or into.storage_offset() != tensor.storage_offset()
            or target.nbytes() != storage.nbytes()
            or (tensor.is_cuda and not into.is_pinned())
        ):
            raise _Mismatch
        # Storage sharing must pair one to one: a copy whose tensors share storage where the
        # state's do not would have one tensor's values overwrite another's.
        paired = self.storages.get(storage.data_ptr())
        if paired is None:
            if target.data_ptr() in self.claimed:
                raise _Mismatch
            self.storages[storage.data_ptr()] = target.data_ptr()
            self.claimed.add(target.data_ptr())
            if tensor.is_cuda:  # (as checked above, it fills its storage, as the copy does)
                self.from_cuda = True
                into.copy_(tensor, non_blocking=True)
            else:  # the whole storage, as host_copy clones it (bytes no view shows included)
                target.copy_(storage)
        elif paired != target.data_ptr():
            raise _Mismatch
        return into


def _plain_data(obj: Any) -> bool:
    """Immutable leaves in dicts, lists and tuples only: no tensor, nothing that could hold one."""
    kind = type(obj)
    if kind in _IMMUTABLE:
        return True
    if kind is dict or kind is OrderedDict:
        return all(_plain_data(key) and _plain_data(value) for key, value in obj.items())
    if kind is list or kind is tuple:
        return all(_plain_data(value) for value in obj)
    return False


def _plain_tensor(tensor: torch.Tensor) -> bool:
    """A dense CPU or CUDA tensor with no autograd history or lazy conjugate/negative bit."""
    return (
        tensor.layout is torch.strided
        and tensor.device.type in ("cpu", "cuda")
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _probe_buffer(nbytes: int, cap: int) -> torch.Tensor:
    """Touched memory standing in for a state of ``nbytes`` (at most ``cap``) in a probe; filled
    by Python, not by a torch kernel, so the writer thread can make one too (see CostProbe)."""
    return torch.frombuffer(bytearray(b"\x01") * max(1, min(nbytes, cap)), dtype=torch.uint8)


def _warm_copy_per_byte(copied: Any, state: Any) -> float | None:
    """Seconds per tensor byte of copying ``state`` once more into ``copied``, the fresh host
    copy just made of it (:func:`refill_copy`); None if it holds no tensor or does not pair.

    The memory was just written, as the allocator hands a later checkpoint's copy memory it has
    used before: this is the price of a warm copy, taken from the state itself, not from a probe
    buffer made for it (a 10 MB probe's buffer and its cold and warm copy took the training
    thread ~14 ms at the first epoch's end; this ~1 ms, before training starts). The values
    written are the ones already there: ``state`` cannot change between the two copies.
    """
    start = time.perf_counter()
    refilled = refill_copy(copied, state)
    seconds = time.perf_counter() - start
    nbytes = tensor_bytes(state)
    return seconds / nbytes if refilled is not None and nbytes else None


def _write_cpu_per_byte(nbytes: int, path: Path) -> float:
    """CPU seconds per byte of one probe write of a state of ``nbytes``, by the path its
    checkpoints take (past the page cache from :data:`DIRECT_WRITE_BYTES`)."""
    probe = _probe_buffer(nbytes, 16 << 20)
    started = time.thread_time()
    _probe_write(probe, path, nbytes >= DIRECT_WRITE_BYTES)
    return (time.thread_time() - started) / probe.numel()


def python_slowdown(work: Callable[[], Any]) -> tuple[float, float]:
    """Run ``work`` on another thread while this thread runs Python, as a training loop does;
    returns (seconds this thread lost to it, CPU seconds ``work`` used).

    What a background write takes from training is the interpreter lock it holds plus the cores
    it takes from a loop that has none to spare. A GPU loop's thread mostly runs Python and
    launches kernels, with the host's other cores idle: only the first part lands, and the share
    of the write's CPU time that does is measured here rather than assumed.
    """
    done = threading.Event()

    def spin() -> tuple[int, float]:
        count, start = 0, time.perf_counter()
        while not done.is_set():
            count += 1
        return count, time.perf_counter() - start

    # The same loop's rate alone (a sleeping timer thread holds no lock and no core): the best
    # of three short windows, since anything that interrupts one (another thread, another
    # process) only lowers it, and a low rate reads as no loss at all (a Python-bound job was
    # once measured at 0.4 ms lost of its 60 ms).
    rate = 0.0
    for _ in range(3):
        timer = threading.Timer(0.005, done.set)
        timer.start()
        count, alone = spin()
        timer.join()
        rate = max(rate, count / alone)
        done.clear()
    used = [0.0]

    def run() -> None:
        started = time.thread_time()
        try:
            work()
        finally:
            used[0] = time.thread_time() - started
            done.set()

    worker = threading.Thread(target=run, name="stalwart-contention-probe")
    worker.start()
    count, elapsed = spin()
    worker.join()
    return max(elapsed - count / rate, 0.0), used[0]


def _probe_write(obj: Any, path: Path, direct: bool = False) -> None:
    """A checkpoint write's CPU work (torch's serialization, through the page cache by name or
    past it, as :func:`write_checkpoint` writes a state of the size priced; the zip's tail read
    back) without its fsync: a probe measures CPU time, and the disk's flush, which takes none,
    only made the training thread wait longer for the probe (on the CPU machine, 60-200 ms of a
    probe's 150-300 ms)."""
    temp = durable.temp_path_for(path)  # a name torch accepts (".name" is not one)
    try:
        if direct:
            with durable.DirectFile(temp, fsync=False) as handle:
                torch.save(obj, handle)
        else:
            torch.save(obj, os.fspath(temp))
        with open(temp, "rb") as handle:
            durable.zip_tail_checksum(handle)
    finally:
        temp.unlink(missing_ok=True)


def _run_job(job: WriteJob) -> None:
    if job.staged:
        written = durable.write_archive(job.obj, job.path)
    else:
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

    def prime(self, directory: Path) -> None:  # noqa: B027 - nothing to prepare by default
        """Start measuring in the background what :meth:`probe_cost` will be asked, for a state
        of about the size last submitted (called after a run's first write)."""

    @property
    def busy(self) -> bool:
        """Whether background writes may be competing with training right now."""
        return False

    def poll(self) -> None:  # noqa: B027 - nothing runs in the background by default
        """Collect finished background work without blocking."""

    def take_background_cost(self) -> float:
        """CPU seconds a writer thread used since the last call: what its writes cost training
        at most where training uses every core. The recorder charges it only until epochs
        without a write in flight let it measure the real slowdown
        (:mod:`stalwart.hindsight.interference`), as it does for forked children."""
        return 0.0

    def close(self) -> None:  # noqa: B027
        """Write everything still pending and wait for it."""


class InlineMaterializer(Materializer):
    """Serializes and writes on the calling thread (the no-fork fallback)."""

    name = "inline"

    def probe_cost(self, nbytes: int, directory: Path) -> float:
        probe_bytes = max(1, min(nbytes, 8 << 20))
        probe = directory / f".stalwart-probe-{os.getpid()}"
        written = write_checkpoint(
            torch.empty(probe_bytes, dtype=torch.uint8), probe,
            direct=nbytes >= DIRECT_WRITE_BYTES,
        )  # fmt: skip
        probe.unlink()
        return written.seconds * nbytes / probe_bytes

    def submit(self, job: WriteJob) -> float:
        start = time.perf_counter()
        _run_job(host_snapshot_job(job))
        return time.perf_counter() - start


def host_snapshot_job(job: WriteJob) -> WriteJob:
    return WriteJob(host_snapshot(job.obj), job.path, job.on_written)


class CostProbe:
    """What a checkpoint write of about ``nbytes`` costs training: the writer thread's CPU time
    per byte for a probe write, as :meth:`ForkMaterializer.probe_cost` measures it on the
    calling thread.

    Queued behind a run's first write (its ``init.ckpt``), it runs beside the first epoch, so
    the write's price the first decision needs is ready at that epoch's end without the training
    thread writing a probe there: that took ~14 ms of a 10 MB state's 2-second fit of 0.1 s
    epochs, of the ~20 ms the price took the training thread (the copy, the training thread's
    own cost, is priced there: see :func:`_warm_copy_per_byte`). The probe runs no torch kernel
    on the writer thread (its buffer is filled by Python, the write is torch's serialization, as
    every checkpoint's): a kernel there gets an OpenMP team of its own, and with two torch
    threads on two cores that slowed fits of 0.1 s epochs by 20-70% (one 4-second fit took
    114 s).
    """

    def __init__(self, nbytes: int, directory: Path) -> None:
        self.nbytes = nbytes
        self.path = directory / f".stalwart-probe-{os.getpid()}"
        self.write_per_byte: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.write_per_byte = _write_cpu_per_byte(self.nbytes, self.path)
        except Exception:  # the calling thread's probe then runs, and reports what fails
            pass
        finally:
            self.done.set()

    @property
    def ready(self) -> bool:
        return self.done.is_set() and self.write_per_byte is not None


class WriterThread:
    """Writes jobs in submission order on one daemon thread, and keeps the CPU time it used.

    The thread's CPU time is the most it can take from training where training uses every
    core (its serialization holds the interpreter lock; its checksum, writes and fsyncs release
    it and use another core, or wait for the disk): the recorder charges it until clean epochs
    let it measure the slowdown instead. It runs no torch kernel (copies are made on the calling
    thread): one would start an OpenMP team of its own beside training's (see CostProbe).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[WriteJob, int, bool] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self.cpu_seconds = 0.0
        self.writes = 0
        #: CPU seconds and tensor bytes of the writes after the first, which alone paid the
        #: process's one-time costs (see ``ForkMaterializer._write_cpu``).
        self.warm_cpu_seconds = 0.0
        self.warm_bytes = 0
        self._cpu_taken = 0.0
        self.failures: list[str] = []
        self._thread: threading.Thread | None = None
        self._spare: Any = None  # the last kept job written, whose buffers the next copy reuses

    @property
    def pending(self) -> int:
        return self._pending

    def put(self, job: WriteJob | CostProbe, nbytes: int, keep: bool = False) -> None:
        """Queue ``job`` (``nbytes`` of tensors), or a :class:`CostProbe` to run between
        writes; ``keep``: once written, its object is kept for :meth:`take_spare` instead of
        being dropped."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="stalwart-checkpoint-writer", daemon=True
            )
            self._thread.start()
        with self._idle:
            self._pending += 1
        self._jobs.put((job, nbytes, keep))

    def take_spare(self) -> Any:
        """The object of the last job written with ``keep`` (None if taken, or none since):
        nothing refers to it any more, so its tensors can take the next copy
        (:func:`refill_copy`)."""
        with self._idle:
            spare, self._spare = self._spare, None
        return spare

    def take_cpu(self) -> float:
        """CPU seconds of writes finished since the last call."""
        with self._idle:
            taken, self._cpu_taken = self.cpu_seconds - self._cpu_taken, self.cpu_seconds
        return taken

    def drain(self, below: int = 1) -> None:
        """Wait until fewer than ``below`` jobs are pending (by default: all written)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending < below)

    def close(self) -> None:
        self.drain()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        self._spare = None

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, nbytes, keep = item
            started = time.thread_time()
            written = False
            try:
                if isinstance(job, CostProbe):
                    job.run()
                else:
                    _run_job(job)
                    written = True
            except BaseException as exc:  # reported at close, like a failed child
                self.failures.append(f"background writer failed ({exc!r}); not written: {job.path}")
            with self._idle:
                used = time.thread_time() - started
                # A probe's CPU is charged as a write's is; it is no write of the run.
                self.cpu_seconds += used
                if not isinstance(job, CostProbe):
                    if written and keep:
                        self._spare = job.obj
                    if self.writes:
                        self.warm_cpu_seconds += used
                        self.warm_bytes += nbytes
                    self.writes += 1
                self._pending -= 1
                self._idle.notify_all()


def writer_has_a_core() -> bool:
    """Whether training leaves a core to a writer thread: fewer torch intra-op threads than the
    cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


class ForkMaterializer(Materializer):
    """Writes checkpoints in the background while training goes on: from a forked child, as a
    copy handed to a writer thread, or serialized on the calling thread with the waits for the
    disk left to the writer thread, whichever costs training less on this machine.

    Args:
        max_children: live children (or copies waiting for the writer thread) at most; a submit
            beyond it waits for the oldest (and that wait counts as main-thread cost). Flor never
            saw more than two.
        small_bytes: checkpoints with fewer tensor bytes than this are copied and written by the
            writer thread, larger ones by a forked child. ``None`` (default): the copy for CPU
            state; in a process using CUDA, decided by measurement when the recorder first
            probes what a checkpoint of the run's size costs (a copy plus the thread's CPU time,
            against a fork and the child's competition for the cores); ``0`` always forks.
        stage: for CPU state, serialize each checkpoint into memory on the calling thread
            (:func:`stalwart.durable.serialize_torch`) and leave only its write, fsyncs and
            rename to the writer thread (:func:`stalwart.durable.write_archive`), instead of
            handing that thread a copy to serialize. ``None`` (default): where training leaves
            the writer thread no core (torch's intra-op threads at least the cores this process
            may use, read at each checkpoint) and the state holds under ``DIRECT_WRITE_BYTES``
            of tensors (larger ones are copied, and written by the writer thread past the page
            cache, whose cost on the training thread is not measured).
            There the thread's serialization displaces one thread of training's team, which the
            others then wait for: the meter charged a 10 MB checkpoint's write a median 12-13 ms
            of a two-thread fit on two cores for 6-7 ms of CPU, the copy 1.7 ms more; staged, it
            takes the training thread ~3.6 ms (into memory, without torch's own CRC-32s: see
            ``serialize_torch``) and the writer ~1.3 ms of CPU. With a core free, the writer
            thread serializes on it (by name: a Python file object would hold the interpreter
            lock for every record), and the training thread pays for the copy (1.7 ms).

    Example::

        materializer = ForkMaterializer()
        cost = materializer.submit(WriteJob(model.state_dict(), Path("runs/epoch=0.ckpt")))
        ...  # keep training; the child or the writer thread writes in the background
        materializer.close()
    """

    name = "fork"

    def __init__(
        self, max_children: int = 2, small_bytes: int | None = None, stage: bool | None = None
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
        self.stage = stage
        self._chosen_size = small_bytes is not None  # a path the caller chose by size: no staging
        self._children: dict[int, str] = {}  # pid: the path it writes
        self._writer = WriterThread()
        self.forks = 0
        self.copies = 0
        self.refills = 0  # copies of CUDA state written into the last copy's pinned buffers
        self.stages = 0  # checkpoints serialized on the calling thread (see ``stage``)
        #: Seconds and tensor bytes of those serializations: the price of the next one.
        self.stage_seconds = 0.0
        self.stage_bytes = 0
        # The share of a background write's CPU time the cost probe prices as slowing training:
        # all of it unless measured (prepare, where training runs on a GPU).
        self.contention = 1.0
        self._contention_measured = False
        self._submitted_bytes = 0
        self._cost_probe: CostProbe | None = None
        #: A CPU state's warm copy, seconds per byte, timed on the first copy submitted.
        self.copy_per_byte: float | None = None
        # A child must not be the first to import what torch.save needs: another thread of the
        # parent may have held the import lock at fork time.
        torch.save({"warm": torch.zeros(1)}, _NullWriter())

    def prepare(self, directory: Path) -> None:
        """In a process using CUDA, measure :attr:`contention` once, before the first write or
        probe: the share of a probe write's CPU time (on a thread, so lock and cores both) that a
        Python-bound thread loses. Only the cost probe, the price of the run's first checkpoint,
        uses it: the writer's CPU time still stands in whole until the interference meter has
        measured the real slowdown, since a share measured on anything but training itself can
        under-charge (on CPU, a share measured on the first epoch's batches made a record that
        checkpoints every epoch +20% slower than plain training with a figure of 3.4%). On CPU
        it is not measured: there the write competes with training's own cores, which a probe
        cannot stand in for."""
        if self._contention_measured or not torch.cuda.is_initialized():
            return
        self._contention_measured = True
        probe = _probe_buffer(8 << 20, 8 << 20)
        path = directory / f".stalwart-probe-{os.getpid()}"
        shares = []
        for _ in range(3):
            lost, used = python_slowdown(lambda: _probe_write(probe, path))
            shares.append(min(lost / used, 1.0) if used > 0 else 1.0)
        self.contention = sorted(shares)[1]

    def prime(self, directory: Path) -> None:
        """Queue a :class:`CostProbe` behind the writes in hand, for a state of the size last
        submitted; only where the state is on CPU (a CUDA state's probe also measures the fork
        and the write's contention, on the calling thread)."""
        staged = self.stages_for(self._submitted_bytes)
        if self._cost_probe is None and not torch.cuda.is_initialized() and not staged:
            self._cost_probe = CostProbe(self._submitted_bytes, directory)
            self._writer.put(self._cost_probe, 0)

    def probe_cost(self, nbytes: int, directory: Path) -> float:
        """What one checkpoint of ``nbytes`` costs training by either path, measured here, now
        (or by the probe :meth:`prime` queued, once it has finished); without an explicit
        ``small_bytes``, the cheaper path becomes this materializer's."""
        self.prepare(directory)
        if self.stages_for(nbytes):
            return self._stage_cost(nbytes, directory)
        if self.small_bytes is not None:
            if nbytes < self.small_bytes:
                return self._copy_cost(nbytes, directory)
            return self._fork_cost(nbytes, directory)
        by_copy = self._copy_cost(nbytes, directory)
        # On CPU the fork does not win, and probing it costs what it costs: its copy-on-write
        # faults copy every page the next optimizer step writes (what the copy copies) plus a
        # fault each, and once the child has gone, every page of the process the training touches
        # faults once more (measured: +108 ms to rewrite 400 MB after a fork whose child exited at
        # once; probes: 1 MB 3 vs 19 ms, 10 MB 17 vs 40 ms, 100 MB 165 vs 255 ms). A CUDA state's
        # snapshot is fresh pinned memory that no step rewrites: there the fork is measured.
        by_fork = self._fork_cost(nbytes, directory) if torch.cuda.is_initialized() else math.inf
        # The checkpoint holds a little more than the probed tensors (RNG and loop state): the
        # choice is for states of about this size, so leave it room.
        self.small_bytes = 2 * nbytes + (1 << 20) if by_copy <= by_fork else 0
        return min(by_copy, by_fork)

    def stages_for(self, nbytes: int) -> bool:
        """Whether a CPU checkpoint of ``nbytes`` is serialized on the calling thread (see
        ``stage``)."""
        if self._chosen_size or torch.cuda.is_initialized():
            return False
        if self.stage is not None:
            return self.stage
        return nbytes < DIRECT_WRITE_BYTES and not writer_has_a_core()

    def _stage_cost(self, nbytes: int, directory: Path) -> float:
        """The serialization on the calling thread, at the rate of those staged so far (the
        run's init.ckpt first; else a probe serialized here), plus the writer thread's CPU time
        per write so far.

        Per write, not per byte: written straight from the archive's memory, a staged file costs
        the writer its fsyncs, rename and index row, ~1.1-1.6 ms whether it holds 0.6 or 10 MB.
        Scaled by bytes from init.ckpt (which has no optimizer moments yet: half the bytes of a
        1 MB state's checkpoints), it priced the first checkpoint at 3.7-5 ms where checkpoints
        measured ~3 ms, and the first came an epoch past the bound their cost gives."""
        if not self.stage_bytes:
            probe = _probe_buffer(nbytes, 16 << 20)
            start = time.perf_counter()
            durable.serialize_torch(probe)
            return (time.perf_counter() - start) * nbytes / probe.numel()
        writes = self._writer.writes
        committing = self._writer.cpu_seconds / writes if writes else 0.0
        return self.stage_seconds / self.stage_bytes * nbytes + committing * self.contention

    def _copy_cost(self, nbytes: int, directory: Path) -> float:
        """The copy on the calling thread (at the rate of the first copy's warm repeat, else on a
        probe buffer), plus the writer thread's CPU time for the write (as measured on the
        writes it made, else on a probe write)."""
        writing = self._write_cpu(nbytes, directory) * self.contention
        if self.copy_per_byte is not None and not torch.cuda.is_initialized():
            return self.copy_per_byte * nbytes + writing
        probe = _probe_buffer(nbytes, 16 << 20)
        if torch.cuda.is_initialized():  # a CUDA state's copy: device to fresh pinned memory
            probe = probe.cuda()
            torch.cuda.synchronize()
        host_copy(probe)  # priced warm, as every copy after the first (see _write_cpu)
        start = time.perf_counter()
        host_copy(probe)
        copied = time.perf_counter() - start
        return copied * nbytes / probe.numel() + writing

    def _write_cpu(self, nbytes: int, directory: Path) -> float:
        """CPU seconds writing ``nbytes`` takes, at the rate of the writer thread's writes after
        its first (else of a probe write)."""
        # A process's first write pays once for what later ones reuse (fresh pages, the
        # serializer's and checksum's first calls). Priced at the first write's rate (the run's
        # init.ckpt, which holds no optimizer state yet), a 10 MB state's first checkpoint was
        # priced at 29 ms against ~9 ms measured once taken, and that price set the coverage
        # period before it: the first checkpoint came 1-3 epochs past the bound its measured
        # cost gives (benchmarks/record_overhead.py --matrix, 0.1 s epochs).
        if self._writer.warm_bytes:
            return self._writer.warm_cpu_seconds / self._writer.warm_bytes * nbytes
        direct = nbytes >= DIRECT_WRITE_BYTES
        primed = self._cost_probe
        if primed is not None and primed.ready and (primed.nbytes >= DIRECT_WRITE_BYTES) == direct:
            return primed.write_per_byte * nbytes  # the same path, written beside training
        path = directory / f".stalwart-probe-{os.getpid()}"
        if not self._writer.writes:  # this writer has written nothing yet: warm up first
            _write_cpu_per_byte(nbytes, path)
        return _write_cpu_per_byte(nbytes, path) * nbytes

    def _fork_cost(self, nbytes: int, directory: Path) -> float:
        """A fork (which grows with the process's mapped memory), the copy-on-write faults it
        causes and the child's competition for the machine."""
        # Copy-on-write faults are the larger part: every page the next optimizer step writes is
        # copied while a child holds it. Measure them on a probe buffer, scale to the state.
        probe = _probe_buffer(nbytes, 4 << 20)
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
        copy_on_write = max(shared_write - private_write, 0.0) * nbytes / probe.numel()
        # The child's serialize + checksum + write competes with training for cores and memory
        # bandwidth as the writer thread's would: the same CPU time.
        writing = self._write_cpu(nbytes, directory) * self.contention
        return fork_cost + copy_on_write + writing

    @property
    def busy(self) -> bool:
        """A forked child is alive or the writer thread has a write in hand."""
        return bool(self._children) or self._writer.pending > 0

    @property
    def live_children(self) -> int:
        return len(self._children)

    def submit(self, job: WriteJob) -> float:
        start = time.perf_counter()
        self.prepare(job.path.parent)
        self.poll()
        nbytes = self._submitted_bytes = tensor_bytes(job.obj)
        if self.stages_for(nbytes):
            # One copy of the state's bytes on this thread either way: into an archive in memory
            # now, rather than into a copy the writer thread serializes beside training. The
            # last archive written lends its memory to the next.
            self._writer.drain(below=self.max_children)
            spare = self._writer.take_spare()
            if not isinstance(spare, durable.ArchiveBuffer):
                # Room for the optimizer moments a state gains at its first step (init.ckpt has
                # none; SGD's momentum doubles it), so the next archives fit without growing.
                spare = durable.ArchiveBuffer(capacity=2 * nbytes + (1 << 20))
            staging = time.perf_counter()
            archive = durable.serialize_torch(job.obj, into=spare)
            self.stage_seconds += time.perf_counter() - staging
            self.stage_bytes += nbytes
            staged = WriteJob(archive, job.path, job.on_written, staged=True)
            self._writer.put(staged, nbytes, keep=True)
            self.stages += 1
            return time.perf_counter() - start
        if self.small_bytes is None or nbytes < self.small_bytes:
            # Copies waiting for the thread hold memory: at most max_children of them, as for
            # children (a submit beyond that waits, and the wait is charged); a CUDA state's
            # last one written is kept for the next copy to reuse its pinned memory.
            self._writer.drain(below=self.max_children)
            spare = self._writer.take_spare()
            copied = refill_copy(spare, job.obj) if spare is not None else None
            if copied is None:
                copied, from_cuda = _copy_to_host(job.obj)
                if self.copy_per_byte is None and not from_cuda:
                    self.copy_per_byte = _warm_copy_per_byte(copied, job.obj)
            else:
                from_cuda = True
                self.refills += 1
            self._writer.put(WriteJob(copied, job.path, job.on_written), nbytes, keep=from_cuda)
            self.copies += 1
            # The write runs beside training; what it takes from training, the thread's CPU
            # time, is charged once measured (take_background_cost).
            return time.perf_counter() - start
        # A child must not inherit a lock the writer thread holds mid-write.
        self._writer.drain()
        self._fork(host_snapshot_job(job))
        return time.perf_counter() - start

    def take_background_cost(self) -> float:
        return self._writer.take_cpu()

    def poll(self) -> None:
        for pid in list(self._children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self._reaped(pid, status)

    def close(self) -> None:
        self._writer.close()
        self.failures.extend(self._writer.failures)
        self._writer.failures.clear()
        for pid in list(self._children):
            _, status = os.waitpid(pid, 0)
            self._reaped(pid, status)

    def _reaped(self, pid: int, status: int) -> None:
        path = self._children.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            self.failures.append(f"background writer {pid} exited with {code}; not written: {path}")

    def _fork(self, job: WriteJob) -> None:
        while len(self._children) >= self.max_children:
            oldest = next(iter(self._children))
            _, status = os.waitpid(oldest, 0)
            self._reaped(oldest, status)
        pid = fork_child(lambda: _run_job(job))
        self.forks += 1
        self._children[pid] = str(job.path)


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
