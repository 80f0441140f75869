"""Quantization-aware delta encoding, rearrangement and run-length coding of index streams.

Successive checkpoints mostly keep each element in the same level, so ``(q_prev - q_cur) mod B``
is mostly zero. Grouping the deltas by the element's level in the PREVIOUS checkpoint puts elements
that drift alike next to each other (long runs); the decoder knows ``q_prev`` and rebuilds the same
grouping, so no permutation is stored. Runs are coded as ``-value`` (<= 0) followed by the run
length when it exceeds 1 (> 0), in int8: the two never collide, and a run longer than 127 is split.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_RUN = 127


def modular_difference(a: np.ndarray, b: np.ndarray, alphabet: int) -> np.ndarray:
    """``(a - b) mod alphabet`` for uint8 inputs below ``alphabet``, in uint8 arithmetic (the
    wrap-around of a negative difference is shifted from 256 down to ``alphabet``)."""
    difference = a - b
    difference[a < b] += np.uint8(alphabet)
    return difference


def delta_indices(
    current: torch.Tensor, previous: torch.Tensor | None, alphabet: int
) -> np.ndarray:
    """Deltas of ``current`` against ``previous`` (uint8 each), rearranged by previous level.

    ``alphabet`` is the larger of both index alphabets, so the modular difference is invertible.
    Without a previous checkpoint the indices themselves are coded.
    """
    cur = current.numpy()
    if previous is None:
        return cur.astype(np.uint8, copy=True)
    prev = previous.numpy()
    deltas = modular_difference(prev, cur, alphabet)
    # numpy's stable sort of uint8 keys is a radix sort: O(n).
    return deltas[np.argsort(prev, kind="stable")]


def undelta_indices(
    deltas: np.ndarray, previous: torch.Tensor | None, alphabet: int
) -> torch.Tensor:
    """Inverse of :func:`delta_indices`."""
    if previous is None:
        return torch.from_numpy(deltas.astype(np.uint8, copy=True))
    prev = previous.numpy()
    ordered = np.empty_like(deltas)
    ordered[np.argsort(prev, kind="stable")] = deltas
    return torch.from_numpy(modular_difference(prev, ordered, alphabet))


def run_length_encode(values: np.ndarray) -> np.ndarray:
    """int8 stream: ``-value`` per run, then its length if > 1 (runs split at 127)."""
    values = np.asarray(values, dtype=np.uint8)
    if values.size == 0:
        return np.empty(0, dtype=np.int8)
    starts = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
    lengths = np.diff(np.append(starts, values.size))
    pieces = (lengths + MAX_RUN - 1) // MAX_RUN
    run_of_piece = np.repeat(np.arange(lengths.size), pieces)
    first_piece = np.cumsum(pieces) - pieces
    piece_rank = np.arange(run_of_piece.size) - first_piece[run_of_piece]
    piece_lengths = np.minimum(lengths[run_of_piece] - piece_rank * MAX_RUN, MAX_RUN)
    has_length = piece_lengths > 1
    slot = np.arange(piece_lengths.size) + np.cumsum(has_length) - has_length
    stream = np.empty(piece_lengths.size + int(has_length.sum()), dtype=np.int8)
    stream[slot] = -values[starts][run_of_piece].astype(np.int16)
    stream[slot[has_length] + 1] = piece_lengths[has_length]
    return stream


def run_length_decode(stream: np.ndarray) -> np.ndarray:
    """Inverse of :func:`run_length_encode`."""
    stream = np.asarray(stream, dtype=np.int8)
    if stream.size == 0:
        return np.empty(0, dtype=np.uint8)
    symbols = np.flatnonzero(stream <= 0)
    following = np.append(stream, 0)[symbols + 1]
    lengths = np.where(following > 0, following, 1).astype(np.int64)
    return np.repeat((-stream[symbols].astype(np.int16)).astype(np.uint8), lengths)
