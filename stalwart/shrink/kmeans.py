"""Approximate weighted 1-D k-means on a histogram (Inshrinkerator's clustering).

Clustering the raw parameters of a large layer is slow; clustering the few thousand bucket
representatives of its log-space histogram, each weighted, is not, and loses at most the bucket
width (relative ``alpha``). The weight of a point mixes how many values it stands for and how
large they are, ``sigma * count + (1 - sigma) * |value|`` (both normalised), so large weights,
which matter most for the model's output, get levels of their own even when they are rare.
"""

from __future__ import annotations

import numpy as np
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
    """Index of the nearest of the ascending ``centroids`` for each point (ties go down)."""
    midpoints = (centroids[1:] + centroids[:-1]) / 2
    return torch.searchsorted(midpoints, points.contiguous(), right=False)


def _plus_plus_init(
    points: np.ndarray, weights: np.ndarray, k: int, generator: np.random.Generator
) -> np.ndarray:
    # Weighted k-means++: each new centre drawn with probability ~ weight * distance^2 to the
    # nearest chosen one. A loop over k (<= a few dozen), vectorised over the points; a draw is
    # an inverse-CDF lookup (numpy, no per-call tensor overhead: ~35 us per torch.multinomial
    # made the draws most of a first checkpoint's k-means time).
    first = _draw(weights, generator)
    centres = [points[0 if first is None else first]]  # all weights zero: any point will do
    nearest = np.square(points - centres[0])
    for _ in range(1, k):
        mass = weights * nearest
        pick = _draw(mass, generator)
        if pick is None:
            break
        centres.append(points[pick])
        np.minimum(nearest, np.square(points - centres[-1]), out=nearest)
    return np.sort(np.array(centres))


def _draw(mass: np.ndarray, generator: np.random.Generator) -> int | None:
    """An index drawn with probability proportional to ``mass`` (None when it is all zero)."""
    cumulative = np.cumsum(mass)
    total = cumulative[-1]
    if not total > 0:
        return None
    # side="right": the first index whose cumulative mass exceeds the draw, never a zero mass.
    return int(np.searchsorted(cumulative, generator.random() * total, side="right"))


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
    # The histogram has a few thousand points: numpy, because per-call tensor overhead dominated
    # Lloyd's tiny steps.
    points = points.detach().double().reshape(-1).cpu().numpy()
    weights = weights.detach().double().reshape(-1).cpu().numpy()
    distinct = np.unique(points)
    if distinct.size <= k:
        return torch.from_numpy(distinct)
    if init is not None and init.numel() == k:
        # Warm start from the previous checkpoint's levels: Lloyd then settles near them, so
        # elements whose weights barely moved keep their index and the delta stays zero.
        start = np.sort(init.detach().double().reshape(-1).cpu().numpy())
        return torch.from_numpy(_lloyd(points, weights, start, iterations))
    generator = np.random.default_rng(seed)
    best, best_inertia = None, float("inf")
    for _ in range(max(1, restarts)):
        start = _plus_plus_init(points, np.maximum(weights, 0.0), k, generator)
        centroids = _lloyd(points, weights, start, iterations)
        nearest = centroids[_assign(points, centroids)]
        inertia = float(np.dot(weights, np.square(points - nearest)))
        if inertia < best_inertia:
            best, best_inertia = centroids, inertia
    return torch.from_numpy(best)


def _assign(points: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """:func:`assign_sorted` in numpy."""
    return np.searchsorted((centroids[1:] + centroids[:-1]) / 2, points, side="left")


def _lloyd(
    points: np.ndarray, weights: np.ndarray, centroids: np.ndarray, iterations: int
) -> np.ndarray:
    # 1-D clusters of sorted points are runs: prefix sums give each cluster's mass and moment
    # from its boundaries, O(k log n) per step instead of a pass over every point.
    order = np.argsort(points, kind="stable")
    points, weights = points[order], weights[order]
    mass_before = np.concatenate(([0.0], np.cumsum(weights)))
    moment_before = np.concatenate(([0.0], np.cumsum(weights * points)))
    edges = None
    for _ in range(iterations):
        # The points of cluster i are those above midpoint i - 1 and at most midpoint i (ties go
        # down, as in assign_sorted).
        midpoints = (centroids[1:] + centroids[:-1]) / 2
        new_edges = np.searchsorted(points, midpoints, side="right")
        if edges is not None and np.array_equal(new_edges, edges):
            break
        edges = new_edges
        bounds = np.concatenate(([0], edges, [points.size]))
        mass = np.diff(mass_before[bounds])
        moment = np.diff(moment_before[bounds])
        # An empty cluster keeps its centre; Lloyd cannot move it and dropping it loses a level.
        occupied = mass > 0
        centroids = np.sort(np.where(occupied, moment / np.where(occupied, mass, 1.0), centroids))
    return centroids
