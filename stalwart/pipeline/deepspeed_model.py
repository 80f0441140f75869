"""Accept a DeepSpeed pipeline model description: a ``deepspeed.pipe.PipelineModule`` or a list
of ``LayerSpec``/modules, partitioned by DeepSpeed's own partitioner.

The layers are rebuilt from their ``LayerSpec`` inside each worker (under the run's seed, so
owner and replica start identical; plain modules are copied), the loss is the module's
``loss_fn``, and the stage bounds are the module's ``parts`` when it was built for the same
number of stages, else DeepSpeed's ``partition_method`` ('parameters', 'uniform' or
'type:regex') applied by DeepSpeed's own code (``PipelineModule._count_layer_params`` /
``_find_layer_type`` and ``deepspeed.runtime.utils.partition_balanced`` / ``partition_uniform``).

Building a ``PipelineModule`` needs ``deepspeed.comm`` initialised, and on a CPU machine
``deepspeed.init_distributed`` JIT-compiles its shared-memory all-reduce op (195 s here, on 2
cores at load average ~5; once per machine, into ``~/.cache/torch_extensions``).
:func:`single_process_deepspeed`
builds the description in one process without that op: a one-rank gloo group, the op marked
unavailable, torn down afterwards so forked workers start clean.

Why the execution engine is ours and not DeepSpeed's ``PipelineEngine``
(``benchmarks/deepspeed_p2p_after_kill.py`` measures it; numbers in docs/pipeline.md): losing a
rank is not what stops it - its p2p layer (``deepspeed/runtime/pipe/p2p.py``, ``dist.send`` /
``dist.recv`` on the default group) raises "Connection closed by peer" within ~10 ms and the
survivors can still make a new torch group. What stops it is that the lost stage's layers and
optimizer state exist nowhere else (a ``PipelineModule`` builds only its own stage's layers)
and the engine's grid is fixed to the world it started with (``PipelineParallelGrid`` refuses a
2-stage grid while the default group still counts the dead rank). Recovering means a new default
group, a new engine and a checkpoint load - a restart, which redundant computation exists to
avoid - and its ``TrainSchedule`` has no replicas, FRC or failover stream. Our workers keep a
replica of the successor's layers and form a new group against a new store prefix instead.

Example:
    >>> from deepspeed.pipe import LayerSpec, PipelineModule            # doctest: +SKIP
    >>> specs = [LayerSpec(nn.Linear, 64, 64), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 64, 10)]
    >>> with single_process_deepspeed():                                 # doctest: +SKIP
    ...     module = PipelineModule(specs, num_stages=1, loss_fn=nn.CrossEntropyLoss())
    >>> workload = DeepSpeedWorkload(module, data=DigitsMLP())          # doctest: +SKIP
    >>> deepspeed_bounds(module, 2, partition_method="uniform")         # doctest: +SKIP
    [[0, 2], [2, 3]]
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from stalwart.errors import ConfigurationError
from stalwart.pipeline.workloads import PipelineWorkload

_SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU shared-memory all-reduce, JIT-compiled


@contextmanager
def single_process_deepspeed() -> Iterator[None]:
    """Initialise ``deepspeed.comm`` in this process just long enough to build a
    ``PipelineModule`` as a model description, without compiling any DeepSpeed op.

    Inside: a one-rank gloo group (unless torch.distributed is already initialised, which is
    then used as is), ``LOCAL_RANK`` defaulting to 0, and DeepSpeed's CPU shared-memory op
    marked unavailable so ``deepspeed.init_distributed`` does not JIT-compile it. On exit the
    group created here is destroyed (a forked stalwart worker must not inherit it).

    Example:
        >>> with single_process_deepspeed():                             # doctest: +SKIP
        ...     module = PipelineModule(specs, num_stages=1, partition_method="type:Linear")
    """
    import deepspeed
    import deepspeed.comm
    import deepspeed.ops

    created = not dist.is_initialized()
    had_local_rank = "LOCAL_RANK" in os.environ
    os.environ.setdefault("LOCAL_RANK", "0")  # PipelineModule asserts it is set
    ops = deepspeed.ops.__compatible_ops__
    shm = ops.get(_SHM_OP)
    ops[_SHM_OP] = False  # read by deepspeed.comm.torch.build_shm_op
    try:
        if created:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        deepspeed.init_distributed(dist_backend="gloo")
        yield
    finally:
        if shm is not None:
            ops[_SHM_OP] = shm
        if created and dist.is_initialized():
            deepspeed.comm.destroy_process_group()
        if not had_local_rank:
            os.environ.pop("LOCAL_RANK", None)


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


class DeepSpeedWorkload(PipelineWorkload):
    """Layers and loss from a DeepSpeed pipeline description; data from another workload.

    Args:
        model: a ``deepspeed.pipe.PipelineModule`` or a list of ``LayerSpec``/modules/functions.
        data: a workload whose ``microbatch`` supplies (input, target).
        loss_fn: the loss (default: the PipelineModule's ``loss_fn``, else cross-entropy).

    Example:
        >>> workload = DeepSpeedWorkload(module, data=DigitsMLP())       # doctest: +SKIP
        >>> IN_MEMORY["in-memory:ds"] = workload                          # doctest: +SKIP
    """

    def __init__(
        self, model: object, data: PipelineWorkload, loss_fn: Callable | None = None
    ) -> None:
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


def deepspeed_bounds(
    model: object, num_stages: int, partition_method: str = "parameters"
) -> list[list[int]]:
    """Stage bounds ``[[start, end), ...]`` of a DeepSpeed pipeline description.

    A ``PipelineModule`` built for ``num_stages`` stages keeps its own ``parts``. Otherwise
    (e.g. one built with ``num_stages=1`` by :func:`single_process_deepspeed`, or a list of
    ``LayerSpec``) DeepSpeed's ``partition_method`` is applied exactly as ``PipelineModule``
    applies it (DeepSpeed's default, 'parameters', balances trainable parameter counts).
    """
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime import utils as ds_utils

    specs = _specs(model)
    if getattr(model, "num_stages", None) == num_stages and hasattr(model, "parts"):
        parts = model.parts
    else:
        if len(specs) < num_stages:
            raise ConfigurationError(
                f"{len(specs)} layers cannot be split into {num_stages} stages."
            )
        holder = SimpleNamespace(_layer_specs=specs)  # what DeepSpeed's helpers read
        method = partition_method.lower()
        if method == "uniform":
            parts = ds_utils.partition_uniform(num_items=len(specs), num_parts=num_stages)
        elif method == "parameters":
            with torch.random.fork_rng():  # counting builds each layer once: keep the RNG
                weights = PipelineModule._count_layer_params(holder)
            parts = ds_utils.partition_balanced(weights=weights, num_parts=num_stages)
        elif method.startswith("type:"):
            try:
                hits = set(PipelineModule._find_layer_type(holder, partition_method[5:]))
            except RuntimeError as exc:  # DeepSpeed: "found no valid layers to partition"
                raise ConfigurationError(
                    f"partition_method={partition_method!r}: {exc} Name a layer class that "
                    "the model has."
                ) from None
            weights = [int(i in hits) for i in range(len(specs))]
            parts = ds_utils.partition_balanced(weights=weights, num_parts=num_stages)
        else:
            raise ConfigurationError(
                f"partition_method={partition_method!r}: use 'parameters', 'uniform' or "
                "'type:<layer class regex>' (DeepSpeed's methods)."
            )
    parts = [int(p) for p in parts]
    if len(parts) != num_stages + 1:
        raise ConfigurationError(
            f"the PipelineModule is split into {len(parts) - 1} stages, not {num_stages}."
        )
    return [[parts[i], parts[i + 1]] for i in range(num_stages)]
