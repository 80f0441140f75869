"""Scoring a candidate quantization inside the live model, leaving no trace in training."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from stalwart.hindsight.rng import capture_rng, restore_rng


def live_evaluator(
    module: nn.Module, score: Callable[[nn.Module], float]
) -> Callable[[Mapping[str, torch.Tensor]], float]:
    """``evaluate(state_dict) -> loss`` for :func:`stalwart.shrink.save`'s search.

    Each candidate is loaded into ``module`` and scored in eval mode without gradients; the
    weights, the train/eval mode and every RNG come back exactly as they were, so a search
    between two batches does not change what training computes next.

    Args:
        module: the model being trained.
        score: ``score(module) -> held-out loss``.

    Example::

        evaluate = live_evaluator(model, lambda m: float(loss_fn(m(x_val), y_val)))
        stalwart.shrink.save(model.state_dict(), "ep3.shrunk", evaluate=evaluate)
    """
    original = {name: t.detach().clone() for name, t in module.state_dict().items()}

    def evaluate(state_dict: Mapping[str, torch.Tensor]) -> float:
        rng = capture_rng()
        was_training = module.training
        module.load_state_dict(state_dict)
        module.eval()
        try:
            with torch.no_grad():
                return float(score(module))
        finally:
            module.load_state_dict(original)
            module.train(was_training)
            restore_rng(rng)

    return evaluate


def first_batches(
    loader: Iterable[Any], count: int, to_device: Callable[[Any], Any] = lambda batch: batch
) -> list[Any]:
    """The first ``count`` batches of ``loader``, on the device, for scoring candidates.

    Iterating a loader draws from the RNG (its base seed, a shuffling sampler's order): the
    generators are put back, so taking held-out batches does not shift training's randomness.
    """
    rng = capture_rng()
    batches = []
    try:
        for batch in loader:
            batches.append(to_device(batch))
            if len(batches) == count:
                break
    finally:
        restore_rng(rng)
    return batches


def _leading_sizes(batch: Any) -> set[int]:
    if isinstance(batch, torch.Tensor):
        return {batch.shape[0]} if batch.dim() else {-1}
    if isinstance(batch, Mapping):
        return set().union(*(_leading_sizes(value) for value in batch.values()))
    if isinstance(batch, list | tuple):
        return set().union(*(_leading_sizes(value) for value in batch))
    return {-1}  # anything else (a string, a number) may describe the rows: not sliceable


def _head(batch: Any, rows: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:rows]
    if isinstance(batch, Mapping):
        return type(batch)({key: _head(value, rows) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_head(value, rows) for value in batch))
    return type(batch)(_head(value, rows) for value in batch)


def screening_batches(batches: list[Any], fraction: float) -> list[Any] | None:
    """About ``fraction`` of the rows of ``batches``, taken from the first batch, to screen
    candidates on; None when that is not smaller than what it would stand in for.

    A batch is sliced when all its tensors share their first dimension (nested in tuples, lists
    or dicts); otherwise the first batch stands in whole, if there is more than one.
    """
    if fraction <= 0 or not batches:
        return None
    sizes = [_leading_sizes(batch) for batch in batches]
    if all(len(s) == 1 and min(s) > 0 for s in sizes):
        total = sum(min(s) for s in sizes)
        rows = max(1, math.ceil(fraction * total))
        if rows < min(sizes[0]):
            return [_head(batches[0], rows)]
    return batches[:1] if len(batches) > 1 else None
