"""The shrunken checkpoint file: versioned, checksummed, written atomically.

Layout::

    b"STWSHRK\\0" | u16 format version | u32 header length | zstd(JSON header) | sections...
    | trailer: u64 length of everything before it, u32 CRC-32 of it, b"\\0KRHSWTS"

The reader checks the trailer (length, CRC, end marker) before trusting a byte, so a torn or
altered file is an error naming the file, never a silently wrong tensor. Sections are addressed by
(offset, length) from the end of the header.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from stalwart import durable
from stalwart.errors import CorruptCheckpointError
from stalwart.shrink.entropy import zstd_compress, zstd_decompress

MAGIC = b"STWSHRK\0"
END_MAGIC = b"\0KRHSWTS"
#: The first 4 bytes of a torch.save file: a zip archive (torch >= 1.6), or a pickle (legacy) of
#: the default protocol 2 (PROTO 2, then the magic number as a LONG1).
TORCH_SAVE_MAGICS = (b"PK\x03\x04", b"\x80\x02\x8a\x0a")
# The newest format this stalwart reads. 2 added bfloat16-rounded small tensors, 3 the grouped rANS
# coder of index streams, 4 byte-plane lossless coding and the optimizer moments' forms (see
# codec.ENCODING_FORMATS), 5 factored second moments' sums in bfloat16; a file is written with
# the oldest version that can read it (see codec.format_version), so chains without them stay
# readable by stalwart versions that only know format 1.
FORMAT_VERSION = 5
_PREFIX = struct.Struct("<8sHI")
_TRAILER = struct.Struct("<QI8s")


def is_shrunk_file(path: str | os.PathLike) -> bool:
    """True when ``path`` starts with the shrunken-checkpoint magic (cheap: reads 8 bytes)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(MAGIC)) == MAGIC
    except (FileNotFoundError, IsADirectoryError):
        return False


def is_torch_save_file(path: str | os.PathLike) -> bool:
    """True when ``path`` starts as a ``torch.save`` file does (cheap: reads 4 bytes)."""
    try:
        with open(path, "rb") as handle:
            return _starts_as_torch_save(handle.read(4))
    except (FileNotFoundError, IsADirectoryError):
        return False


def _starts_as_torch_save(start: bytes) -> bool:
    """Whether ``start`` (a file's first bytes) is a zip archive or a pickle's PROTO opcode
    (``\\x80`` and a protocol 2-5): a legacy torch.save with ``pickle_protocol=4`` starts
    ``\\x80\\x04\\x95`` and was called truncated, with advice to restore an older file."""
    pickle = len(start) >= 2 and start[0] == 0x80 and 2 <= start[1] <= 5
    return pickle or start[:4] in TORCH_SAVE_MAGICS


class SectionWriter:
    """Collects binary sections and hands out their (offset, length) addresses."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    @property
    def size(self) -> int:
        return self._size

    def add(self, blob: bytes) -> list[int]:
        address = [self._size, len(blob)]
        self._parts.append(blob)
        self._size += len(blob)
        return address

    def write(
        self, path: str | os.PathLike, header: dict, version: int = FORMAT_VERSION
    ) -> tuple[int, int]:
        """Write header + sections atomically to ``path`` as format ``version``; return (file
        size, CRC-32)."""
        header_blob = zstd_compress(json.dumps(header, separators=(",", ":")).encode())
        body = [_PREFIX.pack(MAGIC, version, len(header_blob)), header_blob, *self._parts]
        crc = 0
        length = 0
        for part in body:
            crc = zlib.crc32(part, crc)
            length += len(part)

        def write_parts(handle: BinaryIO) -> None:
            for part in body:
                handle.write(part)
            handle.write(_TRAILER.pack(length, crc, END_MAGIC))

        # The trailer is this format's own seal: durable only makes the write atomic and durable.
        durable.write_atomic(path, write_parts)
        return length + _TRAILER.size, crc


@dataclass
class Container:
    """A verified file: its header and a view of its sections."""

    path: Path
    header: dict
    crc32: int
    size: int
    _body: memoryview

    def section(self, address: list[int]) -> bytes:
        offset, length = address
        return bytes(self._body[offset : offset + length])


def read_container(path: str | os.PathLike) -> Container:
    """Read and verify a shrunken checkpoint; :class:`CorruptCheckpointError` names the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"shrunken checkpoint {path} does not exist") from None

    def corrupt(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"shrunken checkpoint {path} is {why}; it was truncated or changed after it was "
            "written. Restore from an earlier checkpoint of the chain (`stalwart shrink inspect`)."
        )

    if _starts_as_torch_save(data[:4]):
        # Intact, just not ours (e.g. trainer.save_checkpoint by hand beside ShrinkCheckpoint,
        # which writes plain files): "truncated, restore an earlier one" sent users astray.
        raise CorruptCheckpointError(
            f"{path} is a plain torch.save file, not a shrunken checkpoint: read it with "
            "torch.load (a Trainer resumes from it with trainer.fit(ckpt_path=...) as usual)."
        )
    if len(data) < _PREFIX.size + _TRAILER.size or data[: len(MAGIC)] != MAGIC:
        raise corrupt("not a complete shrunken checkpoint (bad magic or too short)")
    length, crc, end = _TRAILER.unpack_from(data, len(data) - _TRAILER.size)
    if end != END_MAGIC or length != len(data) - _TRAILER.size:
        raise corrupt(f"torn: {len(data)} bytes on disk, trailer missing or inconsistent")
    if zlib.crc32(memoryview(data)[:length]) != crc:
        raise corrupt("corrupted: its CRC-32 does not match its contents")
    _, version, header_length = _PREFIX.unpack_from(data, 0)
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{path} uses shrunken-checkpoint format {version}; this stalwart reads up to "
            f"{FORMAT_VERSION}. Upgrade stalwart to read it."
        )
    start = _PREFIX.size
    header = json.loads(zstd_decompress(data[start : start + header_length]))
    body = memoryview(data)[start + header_length : length]
    return Container(path, header, crc, len(data), body)


def read_header(path: str | os.PathLike) -> dict | None:
    """The header alone, unverified (for bookkeeping such as who depends on whom); None if the
    file is not a readable shrunken checkpoint."""
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                return None
            magic, _, header_length = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                return None
            return json.loads(zstd_decompress(handle.read(header_length)))
    except (OSError, ValueError, CorruptCheckpointError):
        return None


def trailer_crc(path: str | os.PathLike) -> int | None:
    """The CRC-32 the file's trailer records, unverified (reads 20 bytes: for bookkeeping, such as
    telling the file a delta was written against from one later written at the same path); None
    if the file has no readable trailer."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() < _PREFIX.size + _TRAILER.size:
                return None
            handle.seek(-_TRAILER.size, os.SEEK_END)
            _, crc, end = _TRAILER.unpack(handle.read(_TRAILER.size))
    except OSError:
        return None
    return crc if end == END_MAGIC else None
