"""Hindsight's checkpoint files: plain ``torch.save`` archives, checked against the run's index.

A checkpoint stays a plain, unsealed ``torch.save`` file, so ``torch.load`` and Lightning's
``ckpt_path=`` read it as they read any checkpoint. It is written through
:mod:`stalwart.durable` (temp name, fsync, rename, fsync of the directory); the size and CRC-32
the write returns go into the run's SQLite index, and :func:`read_checkpoint` checks the file
against them before unpickling anything.
"""

from __future__ import annotations

import io
import os
import pickle
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from stalwart import durable
from stalwart.errors import CorruptCheckpointError, UnsafeCheckpointError

#: From this many bytes of tensors a checkpoint is written past the page cache
#: (:class:`stalwart.durable.DirectFile`). The page cache costs kernel time per page written
#: (the writer's CPU for a 10 MB checkpoint: 10 ms either way; 41 MB: 100 against 22 ms;
#: 100 MB: 239 against 48; 500 MB: 1,271 against 234, on the 2-core CI machine), and where
#: training uses every core that time comes out of training; torch writing into a file object
#: costs the training thread a round trip of the interpreter lock per write call (a Python loop
#: lost 3-7 ms a checkpoint against 1-2), which below ~20 MB is the larger cost
#: (``benchmarks/record_overhead.py --write-path``; fits in docs/measurements/hindsight.md).
DIRECT_WRITE_BYTES = 32 << 20


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors inside a nested container (dicts, lists, tuples)."""
    return sum(
        leaf.numel() * leaf.element_size()
        for leaf in pytree.tree_leaves(obj)
        if isinstance(leaf, torch.Tensor)
    )


def write_checkpoint(
    obj: Any, path: str | os.PathLike, *, direct: bool | None = None
) -> durable.WrittenFile:
    """``torch.save`` ``obj`` to ``path`` atomically and durably; keep the result in the index.

    Args:
        obj: the checkpoint.
        path: where it goes.
        direct: write past the page cache; by default where ``obj`` holds at least
            :data:`DIRECT_WRITE_BYTES` of tensors. A record keeps every checkpoint and reads
            none back until a replay, so caching a large one only costs.
    """
    if direct is None:
        direct = tensor_bytes(obj) >= DIRECT_WRITE_BYTES
    return durable.save_torch(obj, path, seal=False, direct=direct)


def checksum_file(path: str | os.PathLike) -> tuple[int, int]:
    """Size and CRC-32 of an existing file, as :func:`verify_checkpoint` checks them later.

    For a ``torch.save`` archive (Lightning's checkpoints) the CRC-32 of its zip directory and
    tail, which hold torch's CRC-32 of every record: reading the tail is enough. For any other
    file the CRC-32 of all of it.
    """
    with open(path, "rb") as handle:
        try:
            return durable.zip_tail_checksum(handle)
        except CorruptCheckpointError:
            handle.seek(0)
            nbytes = crc32 = 0
            while chunk := handle.read(4 << 20):
                nbytes, crc32 = nbytes + len(chunk), zlib.crc32(chunk, crc32)
            return nbytes, crc32


def verify_checkpoint(path: str | os.PathLike, nbytes: int, crc32: int) -> bytes:
    """Read ``path`` whole and check it against its index row; return its bytes.

    Raises:
        CorruptCheckpointError: the file is missing, truncated or changed.
    """
    path = Path(path)
    if not path.exists():
        raise CorruptCheckpointError(
            f"checkpoint {path} is listed in the run's index but missing on disk; "
            "replay from an earlier checkpoint or re-record the run."
        )
    try:
        return durable.verify_file(path, nbytes, crc32)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(
            f"checkpoint {exc} To replay or resume, use an earlier checkpoint of the run."
        ) from None


def read_checkpoint(
    path: str | os.PathLike,
    nbytes: int,
    crc32: int,
    map_location: Any = "cpu",
    *,
    weights_only: bool = True,
) -> dict:
    """Load a verified checkpoint.

    ``weights_only`` as in ``torch.load``: True (the default) loads only tensors and plain
    containers, so a record from someone else cannot run code; False loads anything, for records
    you trust (a ``StochasticWeightAveraging`` callback's state holds its scheduler's function).

    Raises:
        CorruptCheckpointError: the file is missing, truncated, changed or unreadable.
        UnsafeCheckpointError: the file is intact but holds objects ``weights_only`` refuses.
    """
    data = verify_checkpoint(path, nbytes, crc32)
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        # The bytes are the ones the record wrote (size and CRC-32 matched): a refusal of the
        # weights-only unpickler is about what the file holds, not damage to it.
        if weights_only:
            raise UnsafeCheckpointError(unsafe_message(path, exc)) from None
        raise CorruptCheckpointError(f"checkpoint {path} cannot be deserialized: {exc}") from exc
    except Exception as exc:  # a checksum match with an unreadable payload: written corrupt
        raise CorruptCheckpointError(f"checkpoint {path} cannot be deserialized: {exc}") from exc


def unsafe_message(path: str | os.PathLike, exc: Exception) -> str:
    """What a weights-only load of an intact checkpoint refused, and what to do about it."""
    refused = [line.strip() for line in str(exc).splitlines() if "global" in line.lower()]
    return (
        f"checkpoint {path} is intact (its size and CRC-32 match the run's index) but holds "
        f"objects that loading with weights_only=True refuses ({refused[0] if refused else exc}); "
        "nothing was run. Callbacks such as StochasticWeightAveraging keep such objects in their "
        "state. If you trust this record (e.g. you recorded it), load it with "
        "checkpoint.load(weights_only=False), or allow the types with "
        "torch.serialization.add_safe_globals([...])."
    )
