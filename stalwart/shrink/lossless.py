"""The lossless floor: any tensor, bit for bit, in fewer bytes (ZipNN-style byte grouping).

Floats hide their redundancy in the exponent: trained weights use a few dozen of the 256 exponent
values, while the mantissa bytes are close to uniform. Interleaved, a general-purpose compressor
sees neither. So the bytes of equal significance are grouped into planes, float32 and bfloat16
values are first rotated left by one bit (the sign moves to the lowest bit, the exponent fills the
top byte exactly, as ZipNN does), and each plane is stored the cheapest of three ways: rANS under
its own byte frequencies (the exponent plane: a zero-order source), zstd (planes with repeats, such
as integer buffers or pruned zeros), or raw (a mantissa plane that no coder shrinks).

The ``zipnn`` package does the same in C, but ships as a source distribution only (a compiler at
install time, which CI machines may not have); this is numpy + the project's rANS and zstd.
Measured on trained float32 weights (``tests/shrink/test_whole_checkpoint.py``): >= 1.1x, the ZipNN
paper's ~1.2x.

Blob layout: ``u8 flags (1: rotated, 2: one zstd stream of all planes) | u8 itemsize |`` then
``itemsize x (u8 method, u64 length, payload)``, or one such part holding every plane.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import torch

from stalwart.errors import CorruptCheckpointError
from stalwart.shrink.entropy import ans_decode, ans_encode, zstd_compress, zstd_decompress

RAW, ZSTD, ANS = 0, 1, 2
ROTATED, WHOLE = 1, 2  # flags of the first byte
_PLANE = struct.Struct("<BQ")
# Rotating by one bit puts the whole exponent in the top byte for these (1 sign + 8 exponent bits).
_ROTATED = {torch.float32: (np.uint32, 32), torch.bfloat16: (np.uint16, 16)}
# rANS codes symbols one at a time from Python-visible arrays; past this many bytes a plane is
# left to zstd and raw (rANS time grows linearly; zstd is multi-threaded).
ANS_LIMIT = 1 << 26


def _rotate(words: np.ndarray, bits: int, left: bool) -> np.ndarray:
    shift = np.array(1 if left else bits - 1, dtype=words.dtype)
    back = np.array(bits - 1 if left else 1, dtype=words.dtype)
    return (words << shift) | (words >> back)


# rANS decodes ~30 MB/s here, zstd and raw ~1 GB/s: a plane is left to them unless rANS saves at
# least this share of it. Measured on Adam moments: the near-uniform mantissa planes gained 0-0.3%
# from rANS at a third of a second per 10M values each; the exponent planes gain 12-60%.
ANS_MIN_GAIN = 0.01


def _order0_bytes(plane: np.ndarray) -> float:
    """The zero-order entropy of ``plane`` in bytes: what rANS can reach, known without coding."""
    counts = np.bincount(plane, minlength=256)
    p = counts[counts > 0] / plane.size
    return float(-(p * np.log2(p)).sum()) * plane.size / 8


def _encode_plane(plane: np.ndarray) -> bytes:
    method, payload = min(
        [(RAW, plane.tobytes()), (ZSTD, zstd_compress(plane))], key=lambda option: len(option[1])
    )
    if plane.size <= ANS_LIMIT and _order0_bytes(plane) < (1 - ANS_MIN_GAIN) * len(payload):
        coded = ans_encode(plane.view(np.int8))
        if len(coded) < (1 - ANS_MIN_GAIN) * len(payload):
            method, payload = ANS, coded
    return _PLANE.pack(method, len(payload)) + payload


def _decode_plane(blob: memoryview, offset: int, count: int) -> tuple[np.ndarray, int]:
    try:
        method, length = _PLANE.unpack_from(blob, offset)
    except struct.error as exc:
        raise CorruptCheckpointError(f"a lossless tensor section is truncated: {exc}") from exc
    start = offset + _PLANE.size
    payload = bytes(blob[start : start + length])
    if len(payload) != length:
        raise CorruptCheckpointError("a lossless tensor section is truncated")
    if method == RAW:
        plane = np.frombuffer(payload, np.uint8)
    elif method == ZSTD:
        plane = np.frombuffer(zstd_decompress(payload), np.uint8)
    elif method == ANS:
        plane = ans_decode(payload).view(np.uint8)
    else:
        raise CorruptCheckpointError(f"a lossless tensor plane has unknown method {method}")
    if plane.size != count:
        raise CorruptCheckpointError(
            f"a lossless tensor plane holds {plane.size} bytes, its tensor needs {count}"
        )
    return plane, start + length


def encode_grouped(tensor: torch.Tensor) -> bytes:
    """``tensor``'s bytes, grouped by significance and coded plane by plane (bit-exact)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    itemsize = flat.element_size()
    raw = flat.view(torch.uint8).numpy()
    rotation = ROTATED if flat.dtype in _ROTATED else 0
    if rotation:
        word, bits = _ROTATED[flat.dtype]
        raw = _rotate(raw.view(word), bits, left=True).view(np.uint8)
    planes = np.ascontiguousarray(raw.reshape(flat.numel(), itemsize).T)
    per_plane = b"".join(_encode_plane(plane) for plane in planes)
    # zstd over all planes at once can also use what planes share (a pruned zero is zero in
    # every plane): it wins on some optimizer moments, by up to 5%.
    whole = zstd_compress(planes)
    if len(whole) + _PLANE.size < len(per_plane):
        return bytes([rotation | WHOLE, itemsize]) + _PLANE.pack(ZSTD, len(whole)) + whole
    return bytes([rotation, itemsize]) + per_plane


def decode_grouped(blob: bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`encode_grouped`."""
    view = memoryview(blob)
    if len(view) < 2:
        raise CorruptCheckpointError("a lossless tensor section is truncated")
    flags, itemsize = view[0], view[1]
    rotation = flags & ROTATED
    expected = torch.empty(0, dtype=dtype).element_size()
    if itemsize != expected or (rotation and dtype not in _ROTATED) or flags > ROTATED | WHOLE:
        raise CorruptCheckpointError(
            f"a lossless tensor section holds {itemsize}-byte values, its dtype {dtype} has "
            f"{expected}"
        )
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty((count, itemsize), dtype=np.uint8)
    if flags & WHOLE:
        planes, offset = _decode_plane(view, 2, count * itemsize)
        raw[:] = planes.reshape(itemsize, count).T
    else:
        offset = 2
        for index in range(itemsize):
            raw[:, index], offset = _decode_plane(view, offset, count)
    if offset != len(view):
        raise CorruptCheckpointError("a lossless tensor section has trailing bytes")
    raw = raw.reshape(-1)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if rotation:
        word, bits = _ROTATED[dtype]
        raw = _rotate(raw.view(word), bits, left=False).view(np.uint8)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(tuple(shape))
