"""``RedundantPipelineStrategy``: Lightning pipeline training that survives preemption.

A thin adapter over :mod:`stalwart.pipeline`. ``trainer.fit`` hands the LightningModule's
layers (its ``pipeline_layers()``, or an ``nn.Sequential`` attribute ``model``) and the
training batches to the pipeline agent, which forks one worker per stage; the workers train
with redundant computation, survive lost peers, and the trained weights are loaded back into
the module. Lightning's own fit loop and its SIGTERM handling are not used inside the
workers: a SIGTERM there means "this node leaves", and the others carry on.

Example:
    >>> strategy = RedundantPipelineStrategy(num_stages=4, num_microbatches=4)
    >>> trainer = lightning.Trainer(strategy=strategy, accelerator="cpu", devices=1,
    ...                             max_steps=20)                        # doctest: +SKIP
    >>> trainer.fit(module, datamodule)                                  # doctest: +SKIP
    >>> strategy.result.losses[-1]                                       # doctest: +SKIP
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerStatus
from torch import nn

from stalwart.errors import ConfigurationError
from stalwart.pipeline.faults import Fault
from stalwart.pipeline.job import REDUNDANCY, PipelineJob
from stalwart.pipeline.launch import RunResult, launch
from stalwart.pipeline.workloads import IN_MEMORY, Workload


class LightningWorkload(Workload):
    """A LightningModule's layers and loss, and the batches of a dataloader, in order."""

    def __init__(self, module: pl.LightningModule, batches: list) -> None:
        if hasattr(module, "pipeline_layers"):
            self._layers = list(module.pipeline_layers())
        elif isinstance(getattr(module, "model", None), nn.Sequential):
            self._layers = list(module.model)
        else:
            raise ConfigurationError(
                f"{type(module).__name__} has no layers to pipeline: define "
                "`pipeline_layers()` returning a list of modules, or an nn.Sequential `model`."
            )
        self.module, self.batches = module, batches

    def layers(self) -> list[nn.Module]:
        # Copies of the module's own initial layers: every worker starts from the same weights.
        return [copy.deepcopy(layer) for layer in self._layers]

    def microbatch(self, step, index, num_microbatches, batch_size):
        x, y = self.batches[step % len(self.batches)][:2]
        return x.tensor_split(num_microbatches)[index], y.tensor_split(num_microbatches)[index]

    def loss(self, output, target):
        if hasattr(self.module, "pipeline_loss"):
            return self.module.pipeline_loss(output, target)
        return super().loss(output, target)


class _PipelineLauncher(_Launcher):
    """Replaces Lightning's fit loop with the pipeline agent (it forks the stage workers)."""

    def __init__(self, strategy: RedundantPipelineStrategy) -> None:
        self.strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def kill(self, signum: Any) -> None:
        """Workers are stopped by the agent itself (by pid) when the run ends or hangs."""

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer, **kwargs: Any) -> Any:
        module = args[0]
        loaders = args[1] if len(args) > 1 else kwargs.get("train_dataloaders")
        datamodule = args[3] if len(args) > 3 else kwargs.get("datamodule")
        if datamodule is None and isinstance(loaders, pl.LightningDataModule):
            datamodule = loaders
        if datamodule is not None:
            datamodule.setup("fit")
            loaders = datamodule.train_dataloader()
        if loaders is None:
            raise ConfigurationError("fit needs train_dataloaders or a datamodule.")
        batches = list(loaders)
        steps = trainer.max_steps if trainer.max_steps > 0 else trainer.max_epochs * len(batches)
        result = self.strategy.run(module, batches, steps)
        trainer.callback_metrics["train_loss"] = torch.tensor(result.losses[-1])
        trainer.state.status = TrainerStatus.FINISHED
        return None


class RedundantPipelineStrategy(ParallelStrategy):
    """Pipeline-parallel training with redundant computation (Bamboo), for Lightning.

    Args:
        num_stages: pipeline depth P (one worker process per stage).
        num_microbatches: micro-batches per step M (the batch size must be a multiple).
        redundancy: ``"eager"`` (eager FRC, lazy BRC), ``"lazy"`` or ``"none"``.
        num_pipelines: D (this runtime trains one pipeline).
        failure_timeout: seconds before a silent peer is declared lost.
        optimizer: ``"adam"`` or ``"sgd"``; ``lr`` its learning rate (the module's
            ``configure_optimizers`` is not used: every stage owner and its shadow build
            the same optimizer for their shard).
        checkpoint_every: steps between checkpoints (the fallback for fatal failures).
        faults: faults to inject (testing and demos).
    """

    strategy_name = "redundant_pipeline"

    def __init__(
        self,
        num_stages: int = 4,
        num_microbatches: int = 4,
        redundancy: str = "eager",
        num_pipelines: int = 1,
        failure_timeout: float = 10.0,
        optimizer: str = "adam",
        lr: float = 1e-3,
        schedule: str = "1f1b",
        checkpoint_every: int = 0,
        faults: Sequence[Fault] = (),
        timeout: float = 3600.0,
    ) -> None:
        super().__init__(
            parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment()
        )
        if redundancy not in REDUNDANCY:
            raise ConfigurationError(f"redundancy={redundancy!r}: use one of {REDUNDANCY}.")
        if not failure_timeout > 0:
            raise ConfigurationError(
                f"failure_timeout={failure_timeout}: give peers a positive number of seconds."
            )
        self.job = PipelineJob(
            num_stages=num_stages, num_microbatches=num_microbatches, redundancy=redundancy,
            num_pipelines=num_pipelines, failure_timeout=failure_timeout, optimizer=optimizer,
            lr=lr, schedule=schedule, checkpoint_every=checkpoint_every, verify_replicas=True,
        )  # fmt: skip
        if num_pipelines != 1 or num_stages < 1 or num_microbatches < 1:
            self.job.validate()  # raises the specific error before any process starts
        self.faults = list(faults)
        self.timeout = timeout
        self.result: RunResult | None = None

    # -- the pipeline run -------------------------------------------------------------
    def run(self, module: pl.LightningModule, batches: list, steps: int) -> RunResult:
        workload = LightningWorkload(module, batches)
        name = f"in-memory:{id(workload)}"
        IN_MEMORY[name] = workload
        first = batches[0][0]
        with tempfile.TemporaryDirectory(prefix="stalwart-pipeline-ckpt-") as tmp:
            job = PipelineJob(**{**self.job.__dict__, "workload": name, "steps": steps,
                                 "batch_size": len(first), "checkpoint_dir": tmp})  # fmt: skip
            try:
                bounds = job.validate().bounds  # bad input fails here, before any process
                self.result = launch(job, faults=self.faults, timeout=self.timeout)
            finally:
                IN_MEMORY.pop(name, None)
            final = Path(tmp) / f"step-{steps:06d}"
            for stage, (start, end) in enumerate(bounds):
                state = torch.load(final / f"stage-{stage}.pt", weights_only=True)["module"]
                nn.Sequential(*workload._layers[start:end]).load_state_dict(state)
        return self.result

    # -- ParallelStrategy ------------------------------------------------------------
    def _configure_launcher(self) -> None:
        self._launcher = _PipelineLauncher(self)

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    def model_to_device(self) -> None:
        """Stages live in the worker processes; nothing to move here."""

    def barrier(self, name: str | None = None) -> None:
        """Single controlling process: nothing to wait for."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor
