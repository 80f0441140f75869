"""Split an ``nn.Sequential`` into P contiguous stages of balanced cost.

Cost per layer is its parameter count or its measured forward+backward time; the split
minimises the most expensive stage (exact dynamic programme over prefix sums — layer counts are
small, so O(L^2 P) is nothing next to a training step).

Example:
    >>> import torch.nn as nn
    >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    >>> partition(model, 3)
    [(0, 2), (2, 4), (4, 6)]
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from stalwart.errors import ConfigurationError


def layer_list(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The layers of an ``nn.Sequential`` (or of a list of modules)."""
    if isinstance(model, nn.Sequential | nn.ModuleList | list | tuple):
        return list(model)
    raise ConfigurationError(
        f"a {type(model).__name__} cannot be split into pipeline stages: pass an nn.Sequential "
        "(or a list of layers) whose layers run one after another."
    )


def parameter_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Parameter count per layer (layers without parameters cost 1, so they still count)."""
    return [float(max(1, sum(p.numel() for p in layer.parameters()))) for layer in layers]


def measured_costs(
    layers: Sequence[nn.Module], example: torch.Tensor, repeats: int = 3
) -> list[float]:
    """Median forward+backward seconds per layer on ``example`` (fed through in order)."""
    costs = []
    x = example
    for layer in layers:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.float().sum().backward()
            times.append(time.perf_counter() - start)
        costs.append(sorted(times)[len(times) // 2])
        with torch.no_grad():
            x = layer(x)
    return costs


def balanced_bounds(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` bounds of ``num_stages`` stages minimising the largest sum."""
    n = len(costs)
    if num_stages < 1:
        raise ConfigurationError(f"num_stages={num_stages}: a pipeline needs at least 1 stage.")
    if n < num_stages:
        raise ConfigurationError(
            f"the model has {n} layers and cannot be split into {num_stages} stages: "
            f"use at most {n} stages or split the model into more nn.Sequential layers."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[p][i]: minimal max-stage cost of splitting the first i layers into p stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for p in range(1, num_stages + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                value = max(best[p - 1][j], prefix[i] - prefix[j])
                if value < best[p][i]:
                    best[p][i], cut[p][i] = value, j
    bounds = []
    i = n
    for p in range(num_stages, 0, -1):
        j = cut[p][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def partition(
    model: nn.Module | Sequence[nn.Module],
    num_stages: int,
    method: str = "parameters",
    example: torch.Tensor | None = None,
) -> list[tuple[int, int]]:
    """Stage bounds for ``model``, balanced by ``"parameters"`` or measured ``"time"``.

    Args:
        model: an ``nn.Sequential`` or list of layers.
        num_stages: P.
        method: ``"parameters"`` or ``"time"`` (needs ``example``, a first-layer input).
        example: input for the time measurement.
    """
    layers = layer_list(model)
    if method == "parameters":
        costs = parameter_costs(layers)
    elif method == "time":
        if example is None:
            raise ConfigurationError("partition by 'time' needs an example input batch.")
        costs = measured_costs(layers, example)
    else:
        raise ConfigurationError(f"partition method {method!r}: use 'parameters' or 'time'.")
    return balanced_bounds(costs, num_stages)
