"""Checkpoint files: atomic writes with a checksum, verified reads.

A checkpoint is a plain ``torch.save`` file (so ``torch.load`` and Lightning's ``ckpt_path=`` read
it as they read any checkpoint). Atomicity comes from writing to a hidden temp name and renaming;
integrity from the size and CRC-32 the writer computes while streaming, which the run's index keeps
and :func:`read_checkpoint` checks before unpickling anything.
"""

from __future__ import annotations

import io
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stalwart.errors import CorruptCheckpointError

TEMP_MARKER = ".tmp-"


@dataclass(frozen=True)
class WrittenFile:
    """What the writer knows once a checkpoint is durably in place."""

    path: str
    nbytes: int
    crc32: int
    seconds: float


class _ChecksummingWriter:
    """A write-only file wrapper that counts bytes and folds them into a CRC-32 as they pass."""

    def __init__(self, raw) -> None:
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


def temp_path_for(path: Path) -> Path:
    """The hidden name a checkpoint is written under before it is renamed into place."""
    return path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}")


def write_checkpoint(obj: Any, path: str | os.PathLike) -> WrittenFile:
    """Serialize ``obj`` to ``path`` atomically: temp file, fsync, rename, fsync the directory."""
    start = time.perf_counter()
    final = Path(path)
    temp = temp_path_for(final)
    with open(temp, "wb") as raw:
        writer = _ChecksummingWriter(raw)
        torch.save(obj, writer)
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(temp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return WrittenFile(str(final), writer.nbytes, writer.crc32, time.perf_counter() - start)


def verify_checkpoint(path: str | os.PathLike, nbytes: int, crc32: int) -> bytes:
    """Read ``path`` whole and check it against the recorded size and CRC-32; return its bytes."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"checkpoint {path} is listed in the run's index but missing on disk; "
            "replay from an earlier checkpoint or re-record the run."
        ) from None
    if len(data) != nbytes or zlib.crc32(data) != crc32:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupted: expected {nbytes} bytes with CRC-32 {crc32:#010x}, "
            f"found {len(data)} bytes with CRC-32 {zlib.crc32(data):#010x}. The file was changed "
            "or truncated after it was written; use an earlier checkpoint of the run."
        )
    return data


def read_checkpoint(
    path: str | os.PathLike, nbytes: int, crc32: int, map_location: Any = "cpu"
) -> dict:
    """Load a verified checkpoint. Raises :class:`CorruptCheckpointError` on any mismatch."""
    data = verify_checkpoint(path, nbytes, crc32)
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:  # a checksum match with an unreadable payload: written corrupt
        raise CorruptCheckpointError(f"checkpoint {path} cannot be deserialized: {exc}") from exc
