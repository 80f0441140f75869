"""Accept a DeepSpeed pipeline model description: a ``PipelineModule`` or a list of
``LayerSpec``/modules, with DeepSpeed's own partitioning.

The layers are built from their ``LayerSpec`` inside each worker (under the run's seed, so
owner and replica start identical), the loss is the module's ``loss_fn``, and the stage bounds
are the module's ``parts`` or DeepSpeed's ``partition_balanced`` over parameter counts.

Why the execution engine is ours and not DeepSpeed's ``PipelineEngine``: its point-to-point
layer (``deepspeed/runtime/pipe/p2p.py``) sends through 2-rank groups created once, at start,
from the default process group (``dist.new_group`` per neighbour pair, then ``broadcast``);
a dead rank poisons that group, and re-forming it means destroying the default group and
rebuilding the engine's grid — a restart, which is what redundant computation avoids. The
engine's schedule (``TrainSchedule``) also has no replicas, FRC or failover stream. Measured
here: ``import deepspeed`` costs ~2.4 s per worker process; our worker re-forms its group
against a new store prefix in ~10–30 ms (see the kill tests' recovery events).

Example:
    >>> from deepspeed.pipe import LayerSpec                           # doctest: +SKIP
    >>> specs = [LayerSpec(nn.Linear, 64, 64), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 64, 10)]
    >>> workload = DeepSpeedWorkload(specs, data=DigitsMLP())          # doctest: +SKIP
    >>> deepspeed_bounds(specs, 2)                                     # doctest: +SKIP
    [[0, 1], [1, 3]]
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from stalwart.errors import ConfigurationError
from stalwart.pipeline.workloads import Workload


class _Call(nn.Module):
    """A plain function used as a pipeline layer (DeepSpeed allows those)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _specs(model: object) -> list:
    specs = getattr(model, "_layer_specs", None)  # a deepspeed.pipe.PipelineModule
    if specs is None:
        if not isinstance(model, Sequence):
            raise ConfigurationError(
                f"a {type(model).__name__} is not a DeepSpeed pipeline description: pass a "
                "deepspeed.pipe.PipelineModule or a list of LayerSpec / nn.Module."
            )
        specs = list(model)
    return specs


class DeepSpeedWorkload(Workload):
    """Layers and loss from a DeepSpeed pipeline description; data from another workload.

    Args:
        model: a ``deepspeed.pipe.PipelineModule`` or a list of ``LayerSpec``/modules/functions.
        data: a workload whose ``microbatch`` supplies (input, target).
        loss_fn: the loss (default: the PipelineModule's ``loss_fn``, else cross-entropy).
    """

    def __init__(self, model: object, data: Workload, loss_fn: Callable | None = None) -> None:
        from deepspeed.pipe import LayerSpec, TiedLayerSpec

        self.specs = _specs(model)
        for spec in self.specs:
            if isinstance(spec, TiedLayerSpec):
                raise ConfigurationError(
                    "TiedLayerSpec (weights shared by two stages) is not supported: its "
                    "gradient needs a cross-stage all-reduce; untie the layers."
                )
            if not isinstance(spec, LayerSpec | nn.Module) and not callable(spec):
                raise ConfigurationError(f"{spec!r} is not a LayerSpec, module or function.")
        self.data = data
        self.loss_fn = loss_fn or getattr(model, "loss_fn", None)

    def layers(self) -> list[nn.Module]:
        from deepspeed.pipe import LayerSpec

        out: list[nn.Module] = []
        for spec in self.specs:
            if isinstance(spec, LayerSpec):
                out.append(spec.build())
            elif isinstance(spec, nn.Module):
                out.append(copy.deepcopy(spec))
            else:
                out.append(_Call(spec))
        return out

    def microbatch(self, step, index, num_microbatches, batch_size):
        return self.data.microbatch(step, index, num_microbatches, batch_size)

    def loss(self, output, target):
        if self.loss_fn is not None:
            return self.loss_fn(output, target)
        return super().loss(output, target)


def deepspeed_bounds(model: object, num_stages: int) -> list[list[int]]:
    """Stage bounds: the PipelineModule's own ``parts``, else DeepSpeed's balanced partition
    of parameter counts."""
    parts = getattr(model, "parts", None)
    if parts is None:
        from deepspeed.runtime.utils import partition_balanced

        specs = _specs(model)
        if len(specs) < num_stages:
            raise ConfigurationError(
                f"{len(specs)} layers cannot be split into {num_stages} stages."
            )
        torch.manual_seed(0)
        weights = [
            max(1, sum(p.numel() for p in layer.parameters()))
            for layer in DeepSpeedWorkload(specs, data=Workload()).layers()
        ]
        parts = partition_balanced(weights, num_stages)
    parts = [int(p) for p in parts]
    if len(parts) != num_stages + 1:
        raise ConfigurationError(
            f"the PipelineModule is split into {len(parts) - 1} stages, not {num_stages}."
        )
    return [[parts[i], parts[i + 1]] for i in range(num_stages)]
