"""Scoring a candidate quantization inside the live model, leaving no trace in training."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stalwart.errors import ConfigurationError
from stalwart.rng import capture_rng, restore_rng


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
    # Taken at the first call (as in live_continuation): an evaluator a save builds but does not
    # call (its answer accepted on the screen) copies nothing.
    original: dict[str, torch.Tensor] = {}

    def evaluate(state_dict: Mapping[str, torch.Tensor]) -> float:
        if not original:
            original.update({n: t.detach().clone() for n, t in module.state_dict().items()})
        rng = capture_rng()
        was_training = module.training
        module.load_state_dict(state_dict)
        module.eval()
        try:
            with torch.no_grad():
                return _as_loss(score(module))
        finally:
            module.load_state_dict(original)
            module.train(was_training)
            restore_rng(rng)

    return evaluate


def live_continuation(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    batches: Sequence[Any],
    loss_of: Callable[[nn.Module, Any, int], torch.Tensor],
    score: Callable[[nn.Module], float],
    load_optimizer_state: Callable[[torch.optim.Optimizer, Mapping], None] | None = None,
) -> Callable[[Mapping[str, torch.Tensor], Sequence[Mapping]], float]:
    """``continue_training(weights, optimizer_states) -> held-out loss`` for the optimizer check
    of :func:`stalwart.shrink.save` (see :mod:`stalwart.shrink.moments`).

    Loads ``weights`` into ``module`` and each state into its optimizer, takes one optimizer step
    per batch of ``batches`` (in eval mode: dropout off, so two continuations differ only by their
    starting state), and returns ``score(module)``. The weights, gradients, optimizer states,
    train/eval mode and every RNG come back exactly as they were.

    Args:
        module: the model being trained.
        optimizers: its optimizers, in the order their states sit in the checkpoint.
        batches: what to train on (the last training batches before the save).
        loss_of: ``loss_of(module, batch, index) -> loss`` to call ``backward()`` on.
        score: ``score(module) -> held-out loss`` after the steps.
        load_optimizer_state: how a checkpoint's optimizer state is loaded into an optimizer
            (default ``optimizer.load_state_dict``; Composer keys it by parameter name).
    """
    # Taken at the first call, not here: a save that reuses an earlier check (ChainWriter) builds
    # this function and never calls it, and the clone is a full copy of the weights.
    original: dict[str, torch.Tensor] = {}
    load = load_optimizer_state or (lambda optimizer, state: optimizer.load_state_dict(state))

    def continue_training(
        weights: Mapping[str, torch.Tensor], optimizer_states: Sequence[Mapping]
    ) -> float:
        if len(optimizer_states) != len(optimizers):
            raise ValueError(
                f"{len(optimizer_states)} optimizer states for {len(optimizers)} optimizers"
            )
        if not original:
            original.update({n: t.detach().clone() for n, t in module.state_dict().items()})
        rng = capture_rng()
        was_training = module.training
        gradients = [(p, None if p.grad is None else p.grad.clone()) for p in module.parameters()]
        saved = [copy.deepcopy(optimizer.state_dict()) for optimizer in optimizers]
        try:
            module.load_state_dict(weights)
            module.eval()
            for optimizer, state in zip(optimizers, optimizer_states, strict=True):
                load(optimizer, copy.deepcopy(state))  # stepping must not touch the candidate
            for index, batch in enumerate(batches):
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
                with torch.enable_grad():
                    loss_of(module, batch, index).backward()
                for optimizer in optimizers:
                    optimizer.step()
            with torch.no_grad():
                return _as_loss(score(module))
        finally:
            module.load_state_dict(original)
            for optimizer, state in zip(optimizers, saved, strict=True):
                optimizer.load_state_dict(state)
            for parameter, gradient in gradients:
                parameter.grad = gradient
            module.train(was_training)
            restore_rng(rng)

    return continue_training


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


def _as_loss(value: Any) -> float:
    """A scorer's answer as a float, or a ConfigurationError saying what it must return."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"the held-out loss function returned {value!r}; it must return a number (a float "
            "or a one-element tensor), e.g. evaluate=lambda model: float(loss_fn(model(x), y))"
        ) from None
