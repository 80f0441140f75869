"""Sketch accuracy and mergeability; approximate k-means against exact 1-D k-means."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.cluster import KMeans

from stalwart.shrink.kmeans import assign_sorted, weighted_kmeans_1d
from stalwart.shrink.partition import QuantConfig
from stalwart.shrink.quantize import FIRST_LEVEL, TensorAnalysis
from stalwart.shrink.sketch import LogSketch

ALPHA = 0.01


def _exact_quantile(values: torch.Tensor, q: float) -> float:
    ordered = torch.sort(values.abs().double()).values
    return float(ordered[math.floor(q * (ordered.numel() - 1))])


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5000),
    st.floats(-8, 3),
    st.floats(0.1, 4),
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
    st.integers(0, 2**31),
)
def test_every_quantile_within_alpha(n, log_scale, spread, qs, seed):
    rng = np.random.default_rng(seed)
    values = torch.from_numpy(rng.lognormal(log_scale, spread, n) * rng.choice([-1, 1], n))
    values[rng.random(n) < 0.1] = 0.0
    sketch = LogSketch.of(values, ALPHA)
    for q in qs:
        exact = _exact_quantile(values, q)
        estimate = sketch.quantile(q)
        assert abs(estimate - exact) <= ALPHA * exact + 1e-300


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2000), st.integers(1, 2000), st.integers(0, 2**31))
def test_merged_sketches_equal_sketch_of_concatenation(n1, n2, seed):
    rng = np.random.default_rng(seed)
    a = torch.from_numpy(rng.standard_normal(n1) * 10.0 ** rng.uniform(-4, 2))
    b = torch.from_numpy(rng.standard_normal(n2) * 10.0 ** rng.uniform(-4, 2))
    merged = LogSketch.of(a, ALPHA).merge(LogSketch.of(b, ALPHA))
    whole = LogSketch.of(torch.cat([a, b]), ALPHA)
    assert torch.equal(merged.keys, whole.keys) and torch.equal(merged.counts, whole.counts)
    assert merged.zero_count == whole.zero_count


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 8), st.integers(200, 3000), st.integers(0, 2**31))
def test_approximate_kmeans_matches_exact_on_separated_mixtures(k, n, seed):
    rng = np.random.default_rng(seed)
    # Well-separated mixture: centres 1 apart on both sides of zero, spread 0.02 (and no overlap).
    centres = (np.arange(k) - (k - 1) / 2) + 0.25
    labels = rng.integers(0, k, n)
    values = centres[labels] + rng.normal(0, 0.02, n)
    analysis = TensorAnalysis(torch.from_numpy(values).float())
    quantized = analysis.quantize(QuantConfig(bins=k, prune=0.0, protect=0.0))
    approximate = quantized.indices.long().numpy() - FIRST_LEVEL
    exact = KMeans(k, n_init=10, random_state=0).fit(values.reshape(-1, 1))
    rank = np.argsort(np.argsort(exact.cluster_centers_.reshape(-1)))
    present = np.unique(labels).size
    if present == k:
        assert np.array_equal(approximate, rank[exact.labels_])
    # Either way, every element sits with the elements of its own mixture component.
    for component in np.unique(labels):
        assert np.unique(approximate[labels == component]).size == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kmeans_inertia_within_one_percent_of_sklearn_on_weight_like_data(seed):
    """Overlapping clusters, as trained weights have: a Laplace peak on a wider Gaussian, no
    gaps for k-means to find. Lloyd's local optima are the risk here, not separation."""
    rng = np.random.default_rng(seed)
    n = 50_000
    values = np.concatenate([rng.laplace(0.0, 0.02, n // 2), rng.normal(0.01, 0.05, n - n // 2)])
    rng.shuffle(values)
    centroids = weighted_kmeans_1d(
        torch.from_numpy(values), torch.ones(n, dtype=torch.float64), 16
    ).numpy()
    assert centroids.size == 16 and np.all(np.diff(centroids) > 0)
    cluster = assign_sorted(torch.from_numpy(values), torch.from_numpy(centroids)).numpy()
    nearest = centroids[cluster]
    ours = float(np.square(values - nearest).sum())
    exact = KMeans(16, n_init=5, random_state=seed).fit(values.reshape(-1, 1)).inertia_
    assert ours <= 1.01 * exact, f"inertia {ours:.6g} vs scikit-learn's {exact:.6g}"
