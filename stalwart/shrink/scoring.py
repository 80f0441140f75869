"""Scoring a candidate quantization inside the live model, leaving no trace in training."""

from __future__ import annotations

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
