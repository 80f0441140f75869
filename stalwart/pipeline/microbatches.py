"""The micro-batches of a step, and the shapes that cross each stage boundary.

A worker reads micro-batch ``k`` of ``step`` from the workload (the same rows on every worker,
so a shadow redoes a victim's work exactly) or, in driven mode, splits the batch the driver put
in the store for that step. A receiving stage must allocate its buffer before the message
arrives, so :meth:`MicroBatches.boundary_meta` gives every stage's output shape and dtype.
"""

from __future__ import annotations

import io

import torch
from torch import nn
from torch.distributed import Store

from stalwart.pipeline import keys
from stalwart.pipeline.held_stages import stage_module
from stalwart.pipeline.job import PipelineJob
from stalwart.pipeline.workloads import PipelineWorkload

#: stage -> (shape, dtype) of its output
BoundaryMeta = dict[int, tuple[torch.Size, torch.dtype]]


class MicroBatches:
    """Micro-batches of one worker, split ``num_microbatches x num_pipelines`` ways per step.

    Args:
        job: the run.
        workload: the data (and, for the shapes, the layers).
        store: the run's store (driven mode reads the batches there).
        device: where the micro-batches go.
    """

    def __init__(
        self, job: PipelineJob, workload: PipelineWorkload, store: Store, device: torch.device
    ) -> None:
        self.job, self.workload, self.store, self.device = job, workload, store, device
        self.parts = job.num_microbatches * job.num_pipelines
        self._batches: dict[int, tuple] = {}
        self._meta: dict[tuple, BoundaryMeta] = {}
        self._shape_model: list[nn.Module] | None = None

    def get(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Input and target of global micro-batch ``mb`` of ``step``."""
        if not self.job.batches_from_store:
            x, y = self.workload.microbatch(step, mb, self.parts, self.job.batch_size)
            return x.to(self.device), y.to(self.device)
        if step not in self._batches:
            raw = self.store.get(keys.batch(step))
            x, y = torch.load(io.BytesIO(raw), weights_only=True)[:2]
            self._batches = {step: (x.tensor_split(self.parts), y.tensor_split(self.parts))}
        xs, ys = self._batches[step]
        return xs[mb].to(self.device), ys[mb].to(self.device)

    def boundary_meta(self, step: int, mb: int) -> BoundaryMeta:
        """Shape and dtype of every stage's output for micro-batch ``mb`` of ``step``, from one
        no-grad pass of a full model copy, cached per input shape (the last batch of an epoch
        may be smaller)."""
        x = self.get(step, mb)[0].cpu()
        key = (tuple(x.shape), x.dtype)
        if key not in self._meta:
            if self._shape_model is None:
                torch.manual_seed(self.job.seed)
                layers = self.workload.layers()
                stages = range(self.job.num_stages)
                self._shape_model = [stage_module(self.job, layers, s) for s in stages]
            meta = {}
            with torch.no_grad():
                for s, module in enumerate(self._shape_model):
                    x = module(x)
                    meta[s] = (x.shape, x.dtype)
            self._meta[key] = meta
        return self._meta[key]
