"""Partition one tensor and quantize the rest to non-uniform levels.

Index layout of a quantized tensor (uint8, one per element): 0 = pruned (restores to 0), 1 =
protected (restores to the stored bfloat16 value), 2.. = the levels in ascending order. Keeping the
two special levels at fixed indices makes an element that stays pruned or protected between two
checkpoints a zero delta, whatever the bin counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from stalwart.shrink.kmeans import assign_sorted, point_weights, weighted_kmeans_1d
from stalwart.shrink.partition import QuantConfig
from stalwart.shrink.sketch import DEFAULT_ALPHA, LogSketch, bucket_index, representative

PRUNED = 0
PROTECTED = 1
FIRST_LEVEL = 2


@dataclass
class QuantizedTensor:
    """A tensor as indices + codebook + protected values (what the file stores, before coding)."""

    indices: torch.Tensor  # uint8, flat
    levels: torch.Tensor  # float32, ascending
    protected: torch.Tensor  # bfloat16, protected elements in flat order
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def alphabet(self) -> int:
        """Number of distinct index values (levels + the pruned and protected markers)."""
        return FIRST_LEVEL + self.levels.numel()

    def dequantize(self) -> torch.Tensor:
        table = np.concatenate([np.zeros(FIRST_LEVEL, np.float32), self.levels.float().numpy()])
        indices = self.indices.numpy()
        values = table[indices]  # numpy indexes with the uint8 array directly: no int64 copy
        values[indices == PROTECTED] = self.protected.float().numpy()
        return torch.from_numpy(values).reshape(self.shape).to(self.dtype)


class TensorAnalysis:
    """What every candidate configuration of one tensor shares, computed once per checkpoint.

    Args:
        tensor: the parameter.
        gradient: its gradient EMA (same shape) for sensitivity, or None (magnitude only).
        layer_type: see :mod:`stalwart.shrink.partition`.
        alpha: sketch accuracy.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        gradient: torch.Tensor | None = None,
        layer_type: str = "other",
        alpha: float = DEFAULT_ALPHA,
    ) -> None:
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.layer_type = layer_type
        self.alpha = alpha
        self.values = tensor.detach().reshape(-1).float()
        self.gradient = None if gradient is None else gradient.detach().reshape(-1).float()
        self.magnitude = self.values.abs()
        self.buckets = bucket_index(self.magnitude, alpha)
        self.nonzero = self.magnitude > 0
        self.previous_levels: torch.Tensor | None = None

    @cached_property
    def magnitude_sketch(self) -> LogSketch:
        return LogSketch.from_buckets(
            self.buckets,
            self.alpha,
            zero_count=int(self.values.numel() - int(self.nonzero.sum())),
            mask=self.nonzero,
        )

    @cached_property
    def sensitivity(self) -> torch.Tensor | None:
        return None if self.gradient is None else (self.gradient * self.values).abs_()

    @cached_property
    def sensitivity_sketch(self) -> LogSketch | None:
        return None if self.sensitivity is None else LogSketch.of(self.sensitivity, self.alpha)

    def _metric(self, name: str) -> tuple[torch.Tensor, LogSketch]:
        if name == "sensitivity" and self.sensitivity is not None:
            return self.sensitivity, self.sensitivity_sketch
        return self.magnitude, self.magnitude_sketch

    def masks(self, config: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """(protect, prune) masks; thresholds are sketch quantiles (relative error alpha)."""
        protect = torch.zeros_like(self.nonzero)
        if config.protect > 0:
            protect |= self.magnitude > self.magnitude_sketch.quantile(1.0 - config.protect)
            if self.sensitivity is not None:
                protect |= self.sensitivity > self.sensitivity_sketch.quantile(1.0 - config.protect)
        prune = torch.zeros_like(self.nonzero)
        if config.prune > 0:
            metric, sketch = self._metric(config.prune_metric)
            prune = (metric <= sketch.quantile(config.prune)) & ~protect
        return protect, prune

    def quantize(
        self, config: QuantConfig, seed: int = 0, init: torch.Tensor | None = None
    ) -> QuantizedTensor:
        """Indices, codebook and protected values under ``config``; ``init`` warm-starts
        k-means (the previous checkpoint's levels)."""
        protect, prune = self.masks(config)
        rest = ~(protect | prune)
        init = self.previous_levels if init is None else init
        levels = self._codebook(rest, config.bins_for(self.layer_type), seed, init)
        if levels.numel():
            # Elements of one histogram bucket share a level: assignment is a table lookup.
            table = assign_sorted(self._id_values, levels.double()) + FIRST_LEVEL
            indices = table.to(torch.uint8)[self._ids]
        else:
            indices = torch.full_like(self._ids, PRUNED, dtype=torch.uint8)
        indices.masked_fill_(prune, PRUNED)
        indices.masked_fill_(protect, PROTECTED)
        protected = self.values[protect].to(torch.bfloat16)
        return QuantizedTensor(indices, levels.float(), protected, self.shape, self.dtype)

    @cached_property
    def _span(self) -> tuple[int, int]:
        sketch = self.magnitude_sketch
        if sketch.keys.numel() == 0:
            return 0, 1
        low = int(sketch.keys[0])
        return low, int(sketch.keys[-1]) - low + 1

    @cached_property
    def _ids(self) -> torch.Tensor:
        # One histogram id per element, computed once: positive buckets, negative, then zero.
        low, span = self._span
        ids = (self.buckets - low).clamp_(0, span - 1)
        ids += span * (self.values < 0).to(torch.int32)
        return ids.masked_fill_(~self.nonzero, 2 * span).long()

    @cached_property
    def _id_values(self) -> torch.Tensor:
        low, span = self._span
        magnitudes = representative(torch.arange(low, low + span), self.alpha)
        return torch.cat([magnitudes, -magnitudes, torch.zeros(1, dtype=torch.float64)])

    def _codebook(
        self, rest: torch.Tensor, bins: int, seed: int, init: torch.Tensor | None
    ) -> torch.Tensor:
        # The histogram of the quantized elements only, without gathering them: a weighted count.
        counts = torch.bincount(
            self._ids, weights=rest.to(torch.float32), minlength=self._id_values.numel()
        )
        present = counts > 0
        if not bool(present.any()):
            return torch.empty(0)
        points = self._id_values[present]
        weights = point_weights(points, counts[present])
        return weighted_kmeans_1d(points, weights, bins, seed=seed, init=init)
