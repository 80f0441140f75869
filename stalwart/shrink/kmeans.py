"""Approximate weighted 1-D k-means on a histogram (Inshrinkerator's clustering).

Clustering the raw parameters of a large layer is slow; clustering the few thousand bucket
representatives of its log-space histogram, each weighted, is not, and loses at most the bucket
width (relative ``alpha``). The weight of a point mixes how many values it stands for and how
large they are, ``sigma * count + (1 - sigma) * |value|`` (both normalised), so large weights,
which matter most for the model's output, get levels of their own even when they are rare.
"""

from __future__ import annotations

import torch

DEFAULT_SIGMA = 0.2
DEFAULT_RESTARTS = 3


def point_weights(
    values: torch.Tensor, counts: torch.Tensor, sigma: float = DEFAULT_SIGMA
) -> torch.Tensor:
    """The paper's mix of normalised frequency and normalised magnitude per histogram point."""
    counts = counts.double()
    magnitude = values.double().abs()
    frequency = counts / counts.sum().clamp_min(1e-300)
    size = magnitude / magnitude.sum().clamp_min(1e-300)
    return sigma * frequency + (1.0 - sigma) * size


def assign_sorted(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the ascending ``centroids`` for each point (ties go down).
    With ``centroids`` of shape (starts, k), one row of indices per start."""
    midpoints = (centroids[..., 1:] + centroids[..., :-1]) / 2
    if midpoints.dim() > 1:
        points = points.expand(*midpoints.shape[:-1], -1)
    return torch.searchsorted(midpoints, points.contiguous(), right=False)


def _plus_plus_init(
    points: torch.Tensor, weights: torch.Tensor, k: int, starts: int, generator: torch.Generator
) -> torch.Tensor:
    """``starts`` independent weighted k-means++ starts, one per row, ascending: each new centre
    drawn with probability ~ weight * distance^2 to the nearest chosen one. A loop over k (<= a
    few dozen), vectorised over the points and the starts."""
    first = _draw(weights.expand(starts, -1), generator)
    centres = [points[first]]  # each (starts, 1)
    nearest = (points - centres[0]).square()
    for _ in range(1, k):
        mass = weights * nearest
        # A start whose weighted points are all centres already (zero-weight points left) draws
        # among the remaining distinct points instead: every row needs k centres, and Lloyd
        # keeps an empty cluster's centre where it is.
        exhausted = mass.sum(1, keepdim=True) <= 0
        mass = torch.where(exhausted, (nearest > 0).double(), mass)
        centres.append(points[_draw(mass, generator)])
        nearest = torch.minimum(nearest, (points - centres[-1]).square())
    return torch.sort(torch.cat(centres, dim=1), dim=1).values


def _draw(mass: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row with probability ~ ``mass`` (inverse CDF: a cumulative sum and a
    binary search, ~3x cheaper than ``torch.multinomial`` on a few thousand points)."""
    cumulative = torch.cumsum(mass, dim=1)
    target = torch.rand(mass.shape[0], 1, generator=generator, dtype=mass.dtype)
    target = target * cumulative[:, -1:]
    # right=True: a zero-mass point (equal cumulative sum to its left neighbour) is never drawn.
    index = torch.searchsorted(cumulative, target, right=True)
    return index.clamp_max(mass.shape[1] - 1)


def weighted_kmeans_1d(
    points: torch.Tensor,
    weights: torch.Tensor,
    k: int,
    *,
    iterations: int = 50,
    seed: int = 0,
    init: torch.Tensor | None = None,
    restarts: int = DEFAULT_RESTARTS,
) -> torch.Tensor:
    """Ascending centroids of ``k`` clusters of weighted 1-D ``points`` (Lloyd from k-means++).

    Returns fewer than ``k`` centroids only when there are fewer distinct points than ``k``.
    ``init`` (k values) replaces the k-means++ start. Without it, Lloyd runs from ``restarts``
    k-means++ starts and the lowest weighted inertia wins (scikit-learn's ``n_init``): one start
    merged two well-separated clusters and split a third in ~2% of 6-8-component mixtures.

    Example::

        centroids = weighted_kmeans_1d(representatives, point_weights(representatives, counts), 8)
        cluster = assign_sorted(values, centroids)
    """
    points = points.double().reshape(-1)
    weights = weights.double().reshape(-1)
    distinct = torch.unique(points)
    if distinct.numel() <= k:
        return distinct
    if init is not None and init.numel() == k:
        # Warm start from the previous checkpoint's levels: Lloyd then settles near them, so
        # elements whose weights barely moved keep their index and the delta stays zero.
        return _lloyd(points, weights, torch.sort(init.double().reshape(-1)).values, iterations)
    generator = torch.Generator().manual_seed(seed)
    starts = _plus_plus_init(points, weights.clamp_min(0), k, max(1, restarts), generator)
    # All starts run side by side (one batched Lloyd): the restarts cost about one start's
    # Python and dispatch overhead, which is what dominates on a few thousand points.
    centroids = _lloyd(points, weights, starts, iterations)
    error = points - torch.gather(centroids, 1, assign_sorted(points, centroids))
    inertia = (weights * error.square()).sum(1)
    return centroids[int(torch.argmin(inertia))]  # the first of equal minima, as in n_init


def _lloyd(
    points: torch.Tensor, weights: torch.Tensor, centroids: torch.Tensor, iterations: int
) -> torch.Tensor:
    """Lloyd iterations from ascending ``centroids``: shape (k,), or (starts, k) for starts run
    side by side (a start that has converged stays where it is while the others go on)."""
    batched = centroids.dim() > 1
    centroids = centroids if batched else centroids[None]
    weights = weights.expand(centroids.shape[0], -1)
    membership = None
    for _ in range(iterations):
        new_membership = assign_sorted(points, centroids)
        if membership is not None and torch.equal(new_membership, membership):
            break
        membership = new_membership
        mass = torch.zeros_like(centroids).scatter_add_(1, membership, weights)
        moment = torch.zeros_like(centroids).scatter_add_(1, membership, weights * points)
        occupied = mass > 0
        # An empty cluster keeps its centre; Lloyd cannot move it and dropping it loses a level.
        centroids = torch.where(occupied, moment / mass.clamp_min(1e-300), centroids)
        centroids = torch.sort(centroids, dim=1).values
    return centroids if batched else centroids[0]
