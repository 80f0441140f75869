"""The stages one worker holds (its own and its replicas): modules, optimizers, gradients.

Every worker builds its stages from the same seed (or the same checkpoint step files), so an
owner and its shadow start identical; after every step both apply the same optimizer step to
the same gradient, so they stay identical bit for bit (:func:`state_digest` checks it).

Example:
    >>> stages = HeldStages(job.validate(), DigitsMLP(), torch.device("cpu"))  # doctest: +SKIP
    >>> stages.build([1, 2], checkpoint=None)                                 # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from stalwart.flat import flatten_grads, unflatten_grads
from stalwart.pipeline.job import PipelineJob, optimizer_spec
from stalwart.pipeline.stage_files import load_stage, save_stage, stage_path
from stalwart.pipeline.workloads import PipelineWorkload


def state_digest(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> str:
    """SHA-256 over parameter bytes and every optimizer-state tensor (bit-for-bit identity)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state):
            value = state[key]
            data = value if torch.is_tensor(value) else torch.tensor(value)
            h.update(key.encode())
            h.update(data.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def stage_module(job: PipelineJob, layers: list[nn.Module], stage: int) -> nn.Sequential:
    """Stage ``stage`` of the model ``layers`` (by ``job.bounds``)."""
    start, end = job.bounds[stage]
    return nn.Sequential(*layers[start:end])


class HeldStages:
    """``modules[stage]`` and ``optimizers[stage]`` of the stages a worker holds.

    Args:
        job: the run (bounds, optimizer, seed, checkpoint directory).
        workload: builds the layers.
        device: where the modules live.
    """

    def __init__(self, job: PipelineJob, workload: PipelineWorkload, device: torch.device):
        self.job, self.workload, self.device = job, workload, device
        self.modules: dict[int, nn.Module] = {}
        self.optimizers: dict[int, torch.optim.Optimizer | None] = {}

    def _make_optimizer(self, module: nn.Module) -> torch.optim.Optimizer | None:
        if not has_parameters(module):
            return None  # e.g. a stage of only activations: nothing to optimise
        cls, kwargs = optimizer_spec(self.job)
        return cls(module.parameters(), **kwargs)

    def build(self, stages: Iterable[int], checkpoint: int | None) -> None:
        """(Re)build ``stages`` from the seed, or from the step files of ``checkpoint``."""
        torch.manual_seed(self.job.seed)
        layers = self.workload.layers()
        self.modules, self.optimizers = {}, {}
        directory = self.job.checkpoint_dir
        for s in stages:
            module = stage_module(self.job, layers, s).to(self.device)
            opt = self._make_optimizer(module)
            if checkpoint is not None and directory:
                state = load_stage(stage_path(directory, checkpoint, s), self.device)
                module.load_state_dict(state["module"])
                if opt is not None:
                    opt.load_state_dict(state["optimizer"])
            self.modules[s], self.optimizers[s] = module, opt

    def keep(self, stages: Iterable[int]) -> None:
        """Drop every stage not in ``stages``."""
        keep = set(stages)
        for s in list(self.modules):
            if s not in keep:
                del self.modules[s], self.optimizers[s]

    def zero_grads(self) -> None:
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)

    def optimizer_step(self, stages: Sequence[int]) -> None:
        for s in stages:
            if (opt := self.optimizers[s]) is not None:
                opt.step()
            self.modules[s].zero_grad(set_to_none=True)

    def flat_grad(self, stage: int) -> torch.Tensor:
        """The gradient of ``stage`` as one vector (a missing gradient counts as zeros)."""
        return flatten_grads(self.modules[stage].parameters())

    def set_grad(self, stage: int, flat: torch.Tensor) -> None:
        unflatten_grads(self.modules[stage].parameters(), flat)

    def numel(self, stage: int) -> int:
        return sum(p.numel() for p in self.modules[stage].parameters())

    def digest(self, stage: int) -> str:
        return state_digest(self.modules[stage], self.optimizers[stage])

    def save(self, step: int, stages: Iterable[int]) -> None:
        """Write the step files of ``stages`` after ``step`` (durably; see stage_files)."""
        directory = self.job.checkpoint_dir
        for s in stages:
            save_stage(self.modules[s], self.optimizers[s], stage_path(directory, step, s))


def has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
