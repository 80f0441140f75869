"""Log-space quantile sketch (DDSketch without collapsing).

A positive value ``x`` falls in bucket ``ceil(log_gamma(x))`` with ``gamma = (1+alpha)/(1-alpha)``;
the bucket's representative ``2 gamma^k / (gamma + 1)`` is within relative error ``alpha`` of every
value in it, so any quantile read from the histogram is too. Histograms of shards merge by adding
counts, which is why the sketch (not a sort) sets the prune/protect thresholds: it is one pass over
the tensor, works on shards, and its buckets double as the points approximate k-means clusters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from stalwart.errors import ConfigurationError

DEFAULT_ALPHA = 0.01


def gamma_of(alpha: float) -> float:
    if not 0.0 < alpha < 1.0:
        raise ConfigurationError(f"sketch alpha must be in (0, 1), got {alpha}")
    return (1.0 + alpha) / (1.0 - alpha)


def bucket_index(magnitudes: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """Bucket ``ceil(log_gamma |x|)`` of each non-zero magnitude (int32; zero -> very negative)."""
    log_gamma = math.log(gamma_of(alpha))
    logs = torch.log(magnitudes.float()).div_(log_gamma).ceil_()
    return logs.clamp_(min=-(2**30)).to(torch.int32)


def representative(keys: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """The value every member of bucket ``k`` is within ``alpha`` (relative) of: 2 g^k / (g+1)."""
    gamma = gamma_of(alpha)
    return 2.0 * torch.exp(keys.double() * math.log(gamma)) / (gamma + 1.0)


@dataclass
class LogSketch:
    """Histogram of magnitudes in log-spaced buckets; quantiles with relative error <= alpha.

    Args:
        alpha: relative accuracy of every quantile (0.01 = 1%).

    Example::

        sketch = LogSketch.of(weights.abs())
        threshold = sketch.quantile(0.99)        # within 1% of the exact 99th percentile
        merged = sketch.merge(LogSketch.of(other_shard.abs()))
    """

    alpha: float = DEFAULT_ALPHA
    keys: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    counts: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    zero_count: int = 0

    @classmethod
    def of(cls, values: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> LogSketch:
        """Sketch the magnitudes of ``values``."""
        magnitudes = values.detach().reshape(-1).abs()
        nonzero = magnitudes > 0
        return cls.from_buckets(
            bucket_index(magnitudes[nonzero], alpha),
            alpha,
            zero_count=int(magnitudes.numel() - int(nonzero.sum())),
        )

    @classmethod
    def from_buckets(
        cls,
        buckets: torch.Tensor,
        alpha: float = DEFAULT_ALPHA,
        *,
        zero_count: int = 0,
        mask: torch.Tensor | None = None,
    ) -> LogSketch:
        """Sketch from precomputed bucket indices of non-zero magnitudes (one O(n) bincount).

        With ``mask``, only the buckets where it is True count (no gather of the selection).
        """
        if mask is not None:
            if not bool(mask.any()):
                return cls(alpha, zero_count=zero_count)
            low = int(torch.where(mask, buckets, torch.iinfo(buckets.dtype).max).min())
            shifted = (buckets - low).clamp_(min=0)
            counts = torch.bincount(shifted, weights=mask.to(torch.float32)).round_().long()
        else:
            if buckets.numel() == 0:
                return cls(alpha, zero_count=zero_count)
            low = int(buckets.min())
            counts = torch.bincount((buckets - low).long())
        keys = torch.nonzero(counts).reshape(-1)
        return cls(alpha, keys + low, counts[keys], zero_count)

    @property
    def count(self) -> int:
        return int(self.counts.sum()) + self.zero_count

    def merge(self, other: LogSketch) -> LogSketch:
        """The sketch of both inputs together (adds counts bucket by bucket)."""
        if other.alpha != self.alpha:
            raise ConfigurationError(
                f"cannot merge sketches of different accuracy ({self.alpha} vs {other.alpha})"
            )
        keys, inverse = torch.unique(torch.cat([self.keys, other.keys]), return_inverse=True)
        counts = torch.zeros(keys.numel(), dtype=torch.int64)
        counts.index_add_(0, inverse, torch.cat([self.counts, other.counts]))
        return LogSketch(self.alpha, keys, counts, self.zero_count + other.zero_count)

    def quantile(self, q: float) -> float:
        """The magnitude at rank ``q * (n - 1)`` (lower nearest rank), within ``alpha`` relative."""
        if not 0.0 <= q <= 1.0:
            raise ConfigurationError(f"quantile must be in [0, 1], got {q}")
        n = self.count
        if n == 0:
            raise ConfigurationError("quantile of an empty sketch")
        rank = math.floor(q * (n - 1))
        if rank < self.zero_count:
            return 0.0
        cumulative = torch.cumsum(self.counts, 0)
        position = int(torch.searchsorted(cumulative, rank - self.zero_count, right=True))
        return float(representative(self.keys[position : position + 1], self.alpha))
