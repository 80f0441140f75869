"""The byte format of everything stored: a JSON header followed by a flat float32 vector.

Raw bytes rather than pickle, so a Redis or etcd client in another language could read them.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import torch

_LENGTH = struct.Struct("<I")


def pack(header: dict, vector: torch.Tensor | None = None) -> bytes:
    """``header`` (JSON-able) and an optional flat float32 vector as bytes."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    body = (
        b"" if vector is None else vector.detach().to(torch.float32).contiguous().numpy().tobytes()
    )
    return _LENGTH.pack(len(encoded)) + encoded + body


def unpack(blob: bytes) -> tuple[dict, torch.Tensor]:
    """The header and vector written by :func:`pack` (the vector is a fresh, writable tensor)."""
    (length,) = _LENGTH.unpack_from(blob)
    header = json.loads(blob[_LENGTH.size : _LENGTH.size + length])
    vector = np.frombuffer(blob, dtype=np.float32, offset=_LENGTH.size + length).copy()
    return header, torch.from_numpy(vector)


def vector_view(blob: bytes) -> np.ndarray:
    """The vector of a :func:`pack` blob as a read-only view (no copy): for summing gradients."""
    (length,) = _LENGTH.unpack_from(blob)
    return np.frombuffer(blob, dtype=np.float32, offset=_LENGTH.size + length)


def unpack_header(blob: bytes) -> dict:
    """Only the header of a :func:`pack` blob."""
    (length,) = _LENGTH.unpack_from(blob)
    return json.loads(blob[_LENGTH.size : _LENGTH.size + length])
