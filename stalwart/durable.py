"""Durable files: atomic writes with a CRC-32, and reads that detect a torn or changed file.

Every file stalwart writes goes through here. A write goes to a hidden temp name in the target's
directory, is fsynced, renamed into place and the directory fsynced, so a crash (SIGKILL, power
loss) at any moment leaves either the previous file or the new one, never half of one; the
temp file a killed writer leaves behind is never read as data.

A reader learns what the file should be in one of two ways:

- from an index the writer updated with the :class:`WrittenFile` it got back (hindsight keeps
  size and CRC-32 in its SQLite store), checked by :func:`verify_file` (for a ``torch.save``
  archive the CRC-32 vouches for the zip's own per-record CRC-32s); the file itself stays a
  plain ``torch.save`` archive that ``torch.load`` and Lightning's ``ckpt_path=`` read;
- from a *seal*, a 16-byte trailer (payload size, CRC-32, magic) appended by
  ``write_atomic(..., seal=True)`` and checked by :func:`read_sealed`, for files nothing else
  indexes (the parameter server's checkpoint, the pipeline's stage files).

Example::

    from stalwart import durable

    durable.save_torch({"w": weights}, "run/checkpoint.pt")   # sealed, atomic
    state = durable.load_torch("run/checkpoint.pt")            # CorruptCheckpointError if torn
"""

from __future__ import annotations

import errno
import inspect
import io
import json
import mmap
import os
import pickle
import struct
import threading
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from stalwart.errors import CorruptCheckpointError

try:  # zlib's CRC-32, ~14x as fast here (10.5 MB: 0.18 ms against 2.5 ms)
    from zlib_ng.zlib_ng import crc32 as fast_crc32
except ImportError:  # the same values, slower
    fast_crc32 = zlib.crc32

TEMP_MARKER = ".tmp-"
# payload size, CRC-32 of the payload, magic: what read_sealed checks before trusting a byte.
_SEAL = struct.Struct("<QI4s")
_SEAL_MAGIC = b"STWs"


@dataclass(frozen=True)
class WrittenFile:
    """What the writer knows once a file is durably in place.

    Attributes:
        path: the final path.
        nbytes: bytes of the payload (without the seal, if any).
        crc32: CRC-32 of the payload.
        seconds: wall time of the whole write, fsyncs included.
    """

    path: str
    nbytes: int
    crc32: int
    seconds: float


class _ChecksummingWriter:
    """A write-only file wrapper that counts bytes and folds them into a CRC-32 as they pass."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.nbytes = 0
        self.crc32 = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.nbytes += view.nbytes
        return self._raw.write(view)

    def flush(self) -> None:
        self._raw.flush()


# O_DIRECT needs the memory, the file offset and the length of every write aligned to the
# device's logical block (512 or 4096 bytes): a page covers both.
_DIRECT_ALIGN = mmap.PAGESIZE
_DIRECT_CHUNK = 8 << 20
# Bounce buffers of finished writes, for the next (fresh pages fault in at a cost every time;
# a writer or probe thread that lives for one write must not pay it).
_spare_chunks: list[mmap.mmap] = []
_spare_lock = threading.Lock()


class DirectFile:
    """A write-only file that bypasses the page cache (``O_DIRECT``) where the file system
    allows it; a file object for ``torch.save``.

    Why: a file written through the page cache costs the writer kernel time for every page it
    dirties (allocating it; on a virtual machine, the host backing it on first touch), and a
    checkpoint is written once and not read again soon: 1.0-1.25 s of system time per 500 MB
    file on the 2-core CI machine, against 0.06-0.2 s written direct
    (``benchmarks/record_overhead.py --write-path``). Where training uses every core, that time
    comes out of training. Bytes pass through a page-aligned bounce buffer, copied by numpy
    (which lets go of the interpreter lock for large copies) and written by ``os.write`` (which
    does too), except whole blocks of memory that is itself aligned (an :class:`ArchiveBuffer`),
    written from where they are; the last block is padded and the file truncated back to its
    length on :meth:`close`. Where the file system refuses ``O_DIRECT`` (tmpfs before Linux 6.6;
    macOS has no such flag) the same bytes are written through the page cache.

    Args:
        path: the file to create (truncated if it exists).
        crc32: fold the bytes into :attr:`crc32` as they pass (for a seal).
        fsync: make the data durable on :meth:`close` (a probe that only measures CPU skips it).

    Example::

        with DirectFile("run/.epoch=3.ckpt.tmp") as handle:
            torch.save(state, handle)
    """

    def __init__(self, path: str | os.PathLike, *, crc32: bool = False, fsync: bool = True) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        direct = getattr(os, "O_DIRECT", 0)
        try:
            self._fd = os.open(path, flags | direct, 0o666)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            direct = 0
            self._fd = os.open(path, flags, 0o666)
        self.direct = bool(direct)
        self.nbytes = 0
        self.crc32: int | None = 0 if crc32 else None
        self._fsync = fsync
        with _spare_lock:
            self._memory = _spare_chunks.pop() if _spare_chunks else mmap.mmap(-1, _DIRECT_CHUNK)
        self._chunk = np.frombuffer(self._memory, dtype=np.uint8)
        self._filled = 0

    def write(self, data) -> int:
        view = memoryview(data)
        size = view.nbytes
        if not size:
            return 0
        source = np.frombuffer(view, dtype=np.uint8)  # the raw bytes, whatever the format
        done = self._write_in_place(source)
        while done < size:
            take = min(size - done, _DIRECT_CHUNK - self._filled)
            self._chunk[self._filled : self._filled + take] = source[done : done + take]
            self._filled += take
            done += take
            if self._filled == _DIRECT_CHUNK:
                self._drain(_DIRECT_CHUNK)
        if self.crc32 is not None:
            self.crc32 = zlib.crc32(view, self.crc32)
        self.nbytes += size
        return size

    def _write_in_place(self, source: np.ndarray) -> int:
        """Write the whole blocks of ``source`` (bytes) straight from its memory where that
        memory is block-aligned and nothing is buffered (an :class:`ArchiveBuffer`'s mapping
        is): no copy through the bounce buffer. Returns the bytes written."""
        if not self.direct or self._filled or source.ctypes.data % _DIRECT_ALIGN:
            return 0
        whole = source.nbytes - source.nbytes % _DIRECT_ALIGN
        written = 0
        while written < whole:
            written += os.write(self._fd, source[written:whole])
        return whole

    def flush(self) -> None:
        """Nothing: a partial block can only go out padded, at :meth:`close`."""

    def close(self, *, complete: bool = True) -> None:
        """Write what is buffered (padded to a block, then truncated away) and close; with
        ``complete=False`` (a failed write) only close."""
        if self._fd < 0:
            return
        try:
            if complete:
                if self._filled:
                    padded = self._filled
                    if self.direct:
                        padded = -(-self._filled // _DIRECT_ALIGN) * _DIRECT_ALIGN
                        self._chunk[self._filled : padded] = 0
                    self._drain(padded)
                os.ftruncate(self._fd, self.nbytes)
                if self._fsync:
                    os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
            with _spare_lock:
                if len(_spare_chunks) < 2:
                    _spare_chunks.append(self._memory)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, kind: type | None, *_: object) -> None:
        self.close(complete=kind is None)

    def _drain(self, length: int) -> None:
        view = memoryview(self._memory)[:length]
        written = 0
        try:
            while written < length:
                try:
                    written += os.write(self._fd, view[written:])
                except OSError as exc:
                    # Some file systems take the flag at open and refuse the write.
                    if not self.direct or exc.errno != errno.EINVAL:
                        raise
                    import fcntl  # POSIX only, as O_DIRECT is

                    flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                    fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                    self.direct = False
        finally:
            view.release()
        self._filled = 0


def temp_path_for(path: str | os.PathLike) -> Path:
    """The hidden name a file is written under before it is renamed into place."""
    path = Path(path)
    return path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}")


def is_temp(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a temp file a (possibly killed) writer left, not data."""
    name = Path(path).name
    return name.startswith(".") and TEMP_MARKER in name


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: str | os.PathLike,
    content: bytes | Callable[[BinaryIO], Any],
    *,
    seal: bool = False,
) -> WrittenFile:
    """Write ``content`` to ``path`` atomically and durably.

    Args:
        path: the final path; its directory must exist.
        content: the bytes, or a function that writes them to the file object it is given,
            so large payloads stream (for ``torch.save`` use :func:`save_torch`, which lets
            torch write the file by name).
        seal: append a trailer with the payload's size and CRC-32 for :func:`read_sealed`.

    Returns:
        The :class:`WrittenFile`; keep ``nbytes`` and ``crc32`` to verify an unsealed file.
    """

    def write(temp: Path) -> tuple[int, int]:
        with open(temp, "wb") as raw:
            writer = _ChecksummingWriter(raw)
            if isinstance(content, (bytes, bytearray, memoryview)):
                writer.write(content)
            else:
                content(writer)
            if seal:
                raw.write(_SEAL.pack(writer.nbytes, writer.crc32, _SEAL_MAGIC))
            raw.flush()
            os.fsync(raw.fileno())
        return writer.nbytes, writer.crc32

    return _replace_atomically(path, write)


def _replace_atomically(
    path: str | os.PathLike, write: Callable[[Path], tuple[int, int]]
) -> WrittenFile:
    """Run ``write`` on ``path``'s temp name (it returns the payload's size and CRC-32 once the
    temp file is fsynced), rename the temp into place and fsync the directory; on any error
    remove the temp and leave what was at ``path``."""
    start = time.perf_counter()
    final = Path(path)
    temp = temp_path_for(final)
    try:
        nbytes, crc32 = write(temp)
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_directory(final.parent)
    return WrittenFile(str(final), nbytes, crc32, time.perf_counter() - start)


def _checksum(handle: BinaryIO, chunk: int = 4 << 20) -> tuple[int, int]:
    """Size and CRC-32 of an open file from its start, read in chunks (neither the read nor
    ``zlib.crc32`` of a large chunk holds the interpreter lock)."""
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    nbytes = crc32 = 0
    handle.seek(0)
    while count := handle.readinto(buffer):
        crc32 = zlib.crc32(view[:count], crc32)
        nbytes += count
    return nbytes, crc32


def write_text(path: str | os.PathLike, text: str, *, seal: bool = False) -> WrittenFile:
    """:func:`write_atomic` of UTF-8 text."""
    return write_atomic(path, text.encode(), seal=seal)


def write_json(path: str | os.PathLike, data: Any) -> WrittenFile:
    """:func:`write_atomic` of ``data`` as JSON (unsealed: any JSON reader can read it)."""
    return write_atomic(path, json.dumps(data).encode())


def _read_whole(path: Path) -> bytes:
    """The file's bytes; a missing file is a :class:`CorruptCheckpointError` that names it."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path} is missing; use an earlier file or start over."
        ) from None


def verify_file(path: str | os.PathLike, nbytes: int, crc32: int) -> bytes:
    """Read ``path`` whole and check it against the size and CRC-32 its writer recorded: for a
    zip archive (``torch.save``'s, as :func:`save_torch` indexes it), the CRC-32 of its central
    directory and tail, then each record against the CRC-32 the directory holds for it (one pass,
    as a CRC-32 of the whole file would be); for any other file, or an index row that kept the
    CRC-32 of the whole file (hindsight's before 2026-11-28), that CRC-32.

    Raises:
        CorruptCheckpointError: the file is missing, truncated or changed.
    """
    path = Path(path)
    data = _read_whole(path)
    if len(data) != nbytes:
        found = f"{len(data)} bytes"
    else:
        found = _zip_mismatch(data, crc32)
        if found is None or zlib.crc32(data) == crc32:
            return data
    raise CorruptCheckpointError(
        f"{path} is corrupted: expected {nbytes} bytes whose CRC-32 checks give {crc32:#010x}, "
        f"found {found}. It was changed or truncated after it was written; use an earlier file."
    )


def _zip_mismatch(data: bytes, crc32: int) -> str | None:
    """None if ``data`` is a zip whose directory and tail have CRC-32 ``crc32`` and whose records
    match their CRC-32s; else what does not match."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            if zlib.crc32(memoryview(data)[archive.start_dir :]) != crc32:
                return "a CRC-32 that does not match"
            bad = archive.testzip()  # every record against its CRC-32
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        return f"a broken zip archive ({exc})"
    return None if bad is None else f"record {bad} not matching its CRC-32"


def read_sealed(path: str | os.PathLike) -> bytes:
    """The payload of a file written with ``seal=True``, after checking its trailer.

    Raises:
        CorruptCheckpointError: the file is missing, has no seal (torn, or not written by
            :func:`write_atomic`), or its size or CRC-32 does not match the seal.
    """
    path = Path(path)
    data = _read_whole(path)
    if len(data) < _SEAL.size:
        raise CorruptCheckpointError(f"{path} is torn: {len(data)} bytes, shorter than its seal.")
    nbytes, crc, magic = _SEAL.unpack_from(data, len(data) - _SEAL.size)
    payload = memoryview(data)[: len(data) - _SEAL.size]
    if magic != _SEAL_MAGIC or nbytes != len(payload) or zlib.crc32(payload) != crc:
        raise CorruptCheckpointError(
            f"{path} is torn or corrupted: its seal does not match its {len(payload)} bytes. "
            "Delete it to fall back to an earlier file, or start over."
        )
    return payload.tobytes()


def has_seal(path: str | os.PathLike) -> bool:
    """Whether ``path`` exists and ends in a seal that matches its length.

    A cheap completeness check (the 16-byte trailer only, no CRC) for choosing among many
    files, e.g. the newest complete checkpoint; :func:`read_sealed` verifies every byte.
    """
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size < _SEAL.size:
                return False
            handle.seek(size - _SEAL.size)
            nbytes, _, magic = _SEAL.unpack(handle.read(_SEAL.size))
    except FileNotFoundError:
        return False
    return magic == _SEAL_MAGIC and nbytes == size - _SEAL.size


def save_torch(
    obj: Any, path: str | os.PathLike, *, seal: bool = True, direct: bool = False
) -> WrittenFile:
    """``torch.save`` ``obj`` to ``path`` atomically and durably, as :func:`write_atomic` writes
    (sealed by default).

    ``direct=True`` writes through :class:`DirectFile`, past the page cache, for a large file
    written in the background and not read again soon (hindsight's checkpoints); a seal's CRC-32
    is then folded in as the bytes pass rather than read back.

    torch writes the temp file by its name. Given a Python file object instead, torch's writer
    takes the interpreter lock for every record it writes, which a training loop on another
    thread waits for: a writer thread's Lightning checkpoint of 1-100 MB took 2-3x as long from
    such a loop that way (``benchmarks/record_overhead.py --write-path``).

    A seal needs the CRC-32 of the whole payload, read back from the page cache. Unsealed, the
    returned ``crc32`` is that of the zip's central directory and tail (:func:`zip_tail_checksum`),
    which hold torch's CRC-32 of every record, computed as it wrote them; :func:`verify_file`
    checks both. Reading the whole file back would be a second pass over the state: 0.25 s of the
    ~0.6 s of CPU a 500 MB checkpoint's write takes here.
    """

    def write(temp: Path) -> tuple[int, int]:
        if direct:
            return _save_direct(obj, temp, seal)
        torch.save(obj, os.fspath(temp))
        if not seal:
            return _fsync_archive(temp)
        with open(temp, "r+b") as handle:
            nbytes, crc32 = _checksum(handle)
            handle.write(_SEAL.pack(nbytes, crc32, _SEAL_MAGIC))
            handle.flush()
            os.fsync(handle.fileno())
        return nbytes, crc32

    return _replace_atomically(path, write)


class ArchiveBuffer:
    """A ``torch.save`` archive held in memory by :func:`serialize_torch`, for
    :func:`write_archive` to put on disk later, on any thread; a file object torch writes into.

    Backed by an anonymous mapping, its pages faulted in when it is made (or grown), meant to be
    reused from one archive to the next: a fresh 10 MB buffer faults its pages in as the
    archive is written into it (``torch.save`` into a new ``io.BytesIO`` took 11.9 ms against
    6.9 ms with the heap's pages kept, 2 threads), and the first archive's time is what a
    hindsight record prices the next ones at.

    Args:
        capacity: bytes to map at first (rounded up to whole pages); it grows as needed.
    """

    def __init__(self, capacity: int = 1 << 20) -> None:
        self._memory = _mapped(capacity)
        self.nbytes = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        end = self.nbytes + view.nbytes
        if end > len(self._memory):
            grown = _mapped(max(end, 2 * len(self._memory)))
            with memoryview(self._memory) as old:
                grown[: self.nbytes] = old[: self.nbytes]
            self._memory.close()
            self._memory = grown
        self._memory[self.nbytes : end] = view
        self.nbytes = end
        return view.nbytes

    def flush(self) -> None:
        """Nothing: the bytes stay in memory until :func:`write_archive`."""

    def view(self) -> memoryview:
        """The archive's bytes (writable: :func:`serialize_torch` fills in their CRC-32s)."""
        return memoryview(self._memory)[: self.nbytes]


def _mapped(nbytes: int) -> mmap.mmap:
    """Anonymous memory of at least ``nbytes``, whole pages, faulted in where the system can."""
    pages = max(-(-nbytes // mmap.PAGESIZE), 1) * mmap.PAGESIZE
    populate = getattr(mmap, "MAP_POPULATE", 0)  # Linux
    return mmap.mmap(-1, pages, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)


def serialize_torch(obj: Any, into: ArchiveBuffer | None = None) -> ArchiveBuffer:
    """``torch.save`` ``obj`` into memory: the bytes :func:`save_torch` would write, each
    record's CRC-32 included, for :func:`write_archive` to put on disk later, on any thread.

    Serialized as ``obj`` is when called; a change to it afterwards is not in the archive. torch
    computes each record's CRC-32 itself at ~2.4 GB/s, about half of a 10 MB state's
    serialization here (into memory: 5.4-6.1 ms with them, 1.1-1.6 ms without). So torch writes
    the archive with the CRC-32s left at 0 and they are filled in afterwards by zlib-ng's CRC-32
    (the same values, 0.18 ms for 10.5 MB). Where this torch's writer cannot be asked to leave
    them out (its private API is not the one this was written against, 2.7) or the archive is
    not a plain zip (zip64 records, for files past 4 GB), torch computes them, as ``torch.save``
    does.

    Args:
        obj: what to save.
        into: an earlier archive nothing uses any more, whose memory to reuse; None: a new one.
    """
    archive = into if into is not None else ArchiveBuffer()
    archive.nbytes = 0
    if _save_without_crc32(obj, archive):
        try:
            _fill_record_crc32s(archive)
            return archive
        except _NotPlainZip:
            archive.nbytes = 0
    torch.save(obj, archive)
    return archive


def write_archive(archive: ArchiveBuffer, path: str | os.PathLike) -> WrittenFile:
    """Put an archive :func:`serialize_torch` made at ``path``, atomically and durably, past the
    page cache (:class:`DirectFile`: a checkpoint is not read again soon), unsealed: the
    returned CRC-32 is :func:`zip_tail_checksum`'s, as :func:`save_torch` returns it, for
    :func:`verify_file`."""

    def write(temp: Path) -> tuple[int, int]:
        with archive.view() as data:
            with DirectFile(temp) as handle:
                handle.write(data)
            try:
                start, _ = _central_directory(data)
            except _NotPlainZip:  # torch.save's zip64 archive (see serialize_torch)
                return zip_tail_checksum(io.BytesIO(data))
            return data.nbytes, zlib.crc32(data[start:])

    return _replace_atomically(path, write)


# The zip records torch's writer makes (stored, not compressed): the end of the central directory,
# a central directory entry, a local header.
_END = struct.Struct("<IHHHHIIH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_END_MAGIC, _CENTRAL_MAGIC, _LOCAL_MAGIC = 0x06054B50, 0x02014B50, 0x04034B50
_DESCRIPTOR_MAGIC, _HAS_DESCRIPTOR = 0x08074B50, 0x08
_FULL16, _FULL32 = 0xFFFF, 0xFFFFFFFF  # a zip64 record holds the real value


class _NotPlainZip(Exception):
    """The archive is not the plain zip :func:`_fill_record_crc32s` can fill in."""


def _save_without_crc32(obj: Any, archive: ArchiveBuffer) -> bool:
    """``torch.save``'s own steps, with a writer that leaves the records' CRC-32s at 0; False
    (nothing written) where this torch's private API differs from 2.7's."""
    save = getattr(torch.serialization, "_save", None)
    alignment = getattr(torch.serialization, "_get_storage_alignment", None)
    if save is None or alignment is None:
        return False
    if tuple(inspect.signature(save).parameters) != _SAVE_PARAMETERS:
        return False
    try:
        writer = torch._C.PyTorchFileWriter(archive, False, alignment())
    except TypeError:  # a writer without the CRC-32 switch
        return False
    save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    return True


_SAVE_PARAMETERS = (
    "obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"
)  # fmt: skip


def _fill_record_crc32s(archive: ArchiveBuffer) -> None:
    """Write each record's CRC-32 where torch's writer puts it: into its central directory entry
    and into the data descriptor after its bytes (torch's local headers keep 0, the descriptor
    flag set), or into its local header where there is no descriptor."""
    with archive.view() as data:
        entry, count = _central_directory(data)
        for _ in range(count):
            fields = _CENTRAL.unpack_from(data, entry)
            magic, flags, method, size, names, extras, comments, local = (
                fields[0], fields[3], fields[4], fields[9], fields[10], fields[11], fields[12],
                fields[16],
            )  # fmt: skip
            if magic != _CENTRAL_MAGIC or method or _FULL32 in (size, local):
                raise _NotPlainZip
            header = _LOCAL.unpack_from(data, local)
            if header[0] != _LOCAL_MAGIC:
                raise _NotPlainZip
            begin = local + _LOCAL.size + header[9] + header[10]
            with data[begin : begin + size] as record:
                crc32 = fast_crc32(record)
            struct.pack_into("<I", data, entry + 16, crc32)
            if flags & _HAS_DESCRIPTOR:
                descriptor = begin + size
                if struct.unpack_from("<I", data, descriptor)[0] == _DESCRIPTOR_MAGIC:
                    descriptor += 4
                struct.pack_into("<I", data, descriptor, crc32)
            else:
                struct.pack_into("<I", data, local + 14, crc32)
            entry += _CENTRAL.size + names + extras + comments


def _central_directory(data: memoryview) -> tuple[int, int]:
    """Where a plain zip's central directory starts and how many entries it has (its end
    record read, no comment)."""
    end = data.nbytes - _END.size
    if end < 0:
        raise _NotPlainZip
    magic, _, _, _, count, _, start, comment = _END.unpack_from(data, end)
    if magic != _END_MAGIC or comment or count == _FULL16 or start == _FULL32:
        raise _NotPlainZip
    return start, count


def _fsync_archive(temp: Path) -> tuple[int, int]:
    """fsync a ``torch.save`` archive written unsealed; its size and :func:`zip_tail_checksum`."""
    with open(temp, "rb") as handle:
        nbytes, crc32 = zip_tail_checksum(handle)
        os.fsync(handle.fileno())
    return nbytes, crc32


def _save_direct(obj: Any, temp: Path, seal: bool) -> tuple[int, int]:
    """:func:`save_torch`'s write through a :class:`DirectFile`; the payload's size and CRC-32."""
    with DirectFile(temp, crc32=seal) as handle:
        torch.save(obj, handle)
        if seal:
            nbytes, crc32 = handle.nbytes, handle.crc32
            handle.crc32 = None  # the seal is not part of the payload it vouches for
            handle.write(_SEAL.pack(nbytes, crc32, _SEAL_MAGIC))
    if seal:
        return nbytes, crc32
    with open(temp, "rb") as handle:
        return zip_tail_checksum(handle)


def zip_tail_checksum(handle: BinaryIO) -> tuple[int, int]:
    """Size of the zip archive open in ``handle`` and the CRC-32 of its central directory and
    everything after it."""
    try:
        with zipfile.ZipFile(handle) as archive:  # reads the end records and the directory
            start = archive.start_dir
    except zipfile.BadZipFile as exc:
        raise CorruptCheckpointError(f"not a complete zip archive: {exc}") from None
    nbytes = handle.seek(0, os.SEEK_END)
    handle.seek(start)
    return nbytes, zlib.crc32(handle.read())


def load_torch(
    path: str | os.PathLike, map_location: Any = "cpu", *, weights_only: bool = True
) -> Any:
    """Load a file written by :func:`save_torch` with ``seal=True``; verified before unpickling.

    Raises:
        CorruptCheckpointError: torn, changed or undeserializable.
    """
    payload = read_sealed(path)
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # the seal matched, so the writer wrote something unreadable
        raise CorruptCheckpointError(f"{path} cannot be deserialized: {exc}") from exc
