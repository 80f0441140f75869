"""The one update rule every mode uses, so that an audit replay reproduces the weights bit for bit.

``weights - lr * scale * sum(gradients)``, the sum taken by :func:`gradient_sum` in the order
the audit record lists the gradients. Synchronous modes use ``scale = 1 / N`` (the mean over
the N workers); asynchronous modes apply every gradient at full rate (``scale = 1``) unless a
backlog piled up while the PS was down, when :func:`backlog_scale` lowers it to the mean of the
workers' local trajectories (local SGD's averaging step).

Why that is the mean of trajectories: a stateless worker applies each of its own gradients to
its local copy of the weights (:meth:`stalwart.ps.worker.Worker.run`), so while the PS is down
worker ``w`` walks ``w_C - lr * sum_k g[w, k]`` from the last committed weights ``w_C``, every
gradient computed where the previous one left it. Averaging the M workers' end points is
``w_C - lr * (1 / M) * sum_{w, k} g[w, k]``: one update of this rule with ``scale = 1 / M``,
so the audit record (ids, lr, scale) still replays bit for bit.

Some of a backlog may arrive pre-summed, as workers' trails (:mod:`stalwart.ps.trail` says why);
the record lists those spans (``sums``) and :func:`gradient_sum_with_trails` sums them the same
way, so the replay stays bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch


def backlog_scale(pending: int, workers: int, threshold: int) -> float:
    """1 for up to ``threshold`` pending gradients; beyond, ``1 / workers``: the backlog of
    ``workers`` local trajectories is merged as their mean.

    Each worker's gradients in a backlog form one local SGD trajectory, so they add up to real
    progress (the trajectory's length), not to one large-batch gradient. Summing the
    trajectories (scale 1) moves ``workers`` times as far as any of them went, from weights they
    all started at: ``benchmarks/ps_backlog_rule.py`` measures the rules side by side. The
    earlier rule, ``1 / pending`` (one step of the mean gradient), threw away the information of
    all but one of the gradients: 443 gradients of a 0.7 s outage became one SGD step.
    """
    if pending <= threshold:
        return 1.0
    return 1.0 / max(1, workers)


def gradient_sum(vectors: Iterable[np.ndarray]) -> torch.Tensor | None:
    """The float32 sum of flat gradient vectors, accumulated in the given order (None if empty).

    A running sum over (read-only) views of the received bytes, consumed lazily: a backlog of
    hundreds of gradients is never held, copied or stacked into one (k, d) tensor at once
    (stacking cost more than fetching it, and holding it is the recovery memory spike the
    paper reports).
    """
    total: np.ndarray | None = None
    for vector in vectors:
        if total is None:
            total = np.array(vector, dtype=np.float32)  # a writable copy of the first
        else:
            np.add(total, vector, out=total)
    return None if total is None else torch.from_numpy(total)


def apply_update(
    weights: torch.Tensor, total: torch.Tensor, lr: float, scale: float
) -> torch.Tensor:
    """New weights from ``weights`` and the :func:`gradient_sum` of the update's gradients."""
    return weights - (lr * scale) * total


def gradient_sum_with_trails(
    vectors: Sequence[np.ndarray], sums: Iterable[Sequence[int]]
) -> torch.Tensor | None:
    """:func:`gradient_sum` of ``vectors`` where each ``[start, end)`` span of ``sums`` enters as
    one vector, its own :func:`gradient_sum`: the float32 operations of a PS that received that
    span as a worker's trail, in the same order, so an audit replay reproduces its update bit for
    bit.

    Example:
        >>> v = [np.float32([1.0]), np.float32([1e8]), np.float32([-1e8])]
        >>> float(gradient_sum(v)), float(gradient_sum_with_trails(v, [[1, 3]]))
        (0.0, 1.0)
    """

    def items() -> Iterable[np.ndarray]:
        position = 0
        for start, end in sorted((int(a), int(b)) for a, b in sums):
            if not position <= start < end <= len(vectors):
                raise ValueError(
                    f"span [{start}, {end}) of {len(vectors)} vectors overlaps another or is "
                    "out of range: the audit record is corrupt"
                )
            yield from vectors[position:start]
            span = gradient_sum(vectors[start:end])
            assert span is not None
            yield span.numpy()
            position = end
        yield from vectors[position:]

    return gradient_sum(items())
